"""Hybrid models (``model.attn``: softmax attention layers among the GLA ones): fla's config
contract, prefill + decode == forward with a fixed KV ring, fla's own model's logits (a child
process, fla's kernels as PyTorch), serving, training."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, TESTS, micro_config, reference_value_and_grad, sharded_value_and_grad
from serving_helpers import reference_greedy, serve_config

from laplace_jax import ModelConfig, decode_step, forward, init_params, init_state, prefill
from laplace_jax.checkpoint import save_model
from laplace_jax.config import RunConfig
from laplace_jax.convert import load_fla, main
from laplace_jax.errors import ConfigError
from laplace_jax.info import state_bytes
from laplace_jax.models.layout import layer_groups
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.request import Request, SamplingParams
from laplace_jax.train.loop import run

WINDOWED = dict(layers=[1, 3], num_heads=4, num_kv_heads=2, window_size=6)
MIXED = [dict(layers=[0], num_heads=2, qkv_bias=True, rope_theta=500.0), dict(layers=[2], num_heads=4, window_size=20)]


def hybrid(attn, **kw):
    base = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, use_short_conv=True, chunk_size=8, max_seq_len=64)
    return ModelConfig(**{**base, **kw}, attn=attn)


# ----- config: fla's contract --------------------------------------------------------------
@pytest.mark.parametrize(
    "attn,message",
    [
        (dict(layers=[4], num_heads=2), "out of range"),
        (dict(layers=[-1], num_heads=2), "out of range"),
        ([dict(layers=[1], num_heads=2), dict(layers=[1], num_heads=4)], "model.attn[0] already assigns"),
        (dict(layers=[1, 1], num_heads=2), "twice"),
        (dict(layers=[1]), "'num_heads' is required"),
        (dict(num_heads=2), "'layers' is required"),
        (dict(layers="1", num_heads=2), "list of integer layer indices"),
        (dict(layers=[True], num_heads=2), "only integer layer indices"),
        (dict(layers=[1], num_heads=0), "num_heads must be a positive integer"),
        (dict(layers=[1], num_heads=2, num_kv_heads=-1), "num_kv_heads must be a positive integer"),
        (dict(layers=[1], num_heads=2, qkv_bias="yes"), "qkv_bias must be a Boolean"),
        (dict(layers=[1], num_heads=2, window_size=0), "window_size must be None or a positive integer"),
        (dict(layers=[1], num_heads=2, rope_theta=float("inf")), "rope_theta must be positive and finite"),
        (dict(layers=[1], num_heads=2, rope_theta=-1.0), "rope_theta must be positive and finite"),
        (dict(layers=[1], num_heads=3), "whole, even number"),
        (dict(layers=[1], num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(layers=[1], num_heads=2, windw_size=4), "unknown field(s) ['windw_size']"),
        ("layer 1", "must be None, a dictionary, or a list of dictionaries"),
        (["x"], "model.attn[0] must be a dictionary"),
    ],
)
def test_bad_specs_are_refused_as_fla_refuses_them(attn, message):
    with pytest.raises(ConfigError) as e:
        hybrid(attn)
    assert message in str(e.value)


def test_dict_and_list_forms_and_a_saved_config_are_one_config():
    a, b = hybrid(dict(layers=[1], num_heads=4)), hybrid([dict(layers=[1], num_heads=4)])
    assert a == b and hash(a) == hash(b)
    assert a.attn[0].kv_heads == 4 and a.attn[0].window_size is None and a.attn[0].rope_theta == 10000.0
    saved = json.loads(json.dumps(hybrid(MIXED).to_dict()))
    assert ModelConfig.from_mapping(saved) == hybrid(MIXED)


def test_a_config_file_sets_attn():
    from laplace_jax.config import load_config_file

    c = load_config_file(os.path.join(ROOT, "configs", "recall_tiny.py") + ":hybrid")
    cfg = RunConfig.from_mapping(c)
    assert cfg.model.attn[0].layers == (1,) and cfg.model.attn[0].window_size == 256


# ----- the model -----------------------------------------------------------------------------
def test_layer_groups_keep_compile_size_flat_in_depth():
    """Attention every other layer is one scanned group of two blocks at any depth: the lowered
    forward has the same number of loops at 4 and at 12 layers."""

    def loops(n):
        cfg = hybrid(dict(layers=list(range(1, n, 2)), num_heads=2, window_size=4), n_layers=n)
        assert len(layer_groups(cfg)) == 1
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        text = jax.jit(lambda p, t: forward(cfg, p, t)).lower(params, jnp.zeros((1, 16), jnp.int32)).as_text()
        return text.count("stablehlo.while")

    assert loops(4) == loops(12)


@pytest.mark.parametrize(
    "attn", [WINDOWED, MIXED, dict(layers=[0, 1, 2, 3], num_heads=2)], ids=["windowed-gqa", "mixed", "all-attention"]
)
def test_prefill_then_decode_equals_forward(attn):
    """A 13-token prefill then 27 decode steps (past the 6- and 20-token windows) equal the
    forward pass, fp32, within 1e-5 x max |logit|; so does a padded prefill chunk."""
    cfg = hybrid(attn)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)
    full = forward(cfg, params, tokens)
    scale = float(jnp.abs(full).max())
    logits, state = prefill(cfg, params, tokens[:, :13])
    out = [logits]
    step = jax.jit(decode_step, static_argnums=0)
    for t in range(13, 40):
        logits, state = step(cfg, params, tokens[:, t], state)
        out.append(logits[:, None])
    assert float(jnp.abs(jnp.concatenate(out, 1) - full).max()) <= 1e-5 * scale
    padded = jnp.pad(tokens[:, :11], ((0, 0), (0, 5)))  # 11 real tokens in a 16-token chunk
    _, state = prefill(cfg, params, padded, init_state(cfg, 2), jnp.array([11, 11]))
    rest, _ = prefill(cfg, params, tokens[:, 11:], state)
    assert float(jnp.abs(rest - full[:, 11:]).max()) <= 1e-5 * scale


def test_a_row_that_is_not_live_keeps_its_ring_bit_for_bit():
    cfg = hybrid(WINDOWED)
    params = init_params(cfg, jax.random.key(0))
    _, state = prefill(cfg, params, jax.random.randint(jax.random.key(2), (2, 9), 0, 64))
    _, after = decode_step(cfg, params, jnp.array([3, 4]), state, jnp.array([True, False]))
    for old, new, spec in zip(state, after, [cfg.attn_spec(i) for i in range(4)], strict=True):
        for key in old:
            np.testing.assert_array_equal(np.asarray(old[key][1]), np.asarray(new[key][1]))
        if spec is not None:
            assert int(new["pos"][0]) == 10 and int(new["pos"][1]) == 9


def test_state_is_fixed_and_counted():
    cfg = hybrid(MIXED)
    parts = state_bytes(cfg)
    # layer 0: full attention, a 64-slot buffer of 2 kv heads x 16; layer 2: a 20-slot ring of 4 x 8
    assert parts["k"] == parts["v"] == 4 * (64 * 2 * 16 + 20 * 4 * 8)
    assert parts["pos"] == 2 * 4
    gla_only = {"gla", "conv_q", "conv_k", "conv_v"}
    assert "gla" in parts and state_bytes(dataclasses.replace(cfg, attn=None)).keys() == gla_only


# ----- fla's own model -----------------------------------------------------------------------
CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from fla_on_cpu import fla_on_cpu
from fla.models import GLAConfig, GLAForCausalLM
jobs, prompt, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
with fla_on_cpu(), torch.no_grad():
    for name, job in jobs.items():
        if "config" in job:  # fla's own hybrid, random weights, saved as fla saves it
            torch.manual_seed(0)
            m = GLAForCausalLM(GLAConfig(**job["config"])).eval()
            for n, p in m.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
            m.save_pretrained(job["dir"], safe_serialization=True)
        else:  # our export, loaded by transformers
            m = transformers.AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True).eval()
        out[name] = m(torch.tensor([prompt])).logits[0].tolist()
print("RESULT " + json.dumps(out))
"""


def run_child(jobs: dict, prompt: list[int]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(jobs), json.dumps(prompt)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.split("RESULT ")[-1])


FLA_SPECS = {
    "dict-full": dict(layers=[1], num_heads=4),
    "dict-window-gqa": dict(layers=[1, 3], num_heads=4, num_kv_heads=2, window_size=7),
    "list-mixed": [
        dict(layers=[0], num_heads=4, num_kv_heads=1, qkv_bias=True, rope_theta=500.0),
        dict(layers=[2, 3], num_heads=2, window_size=16),
    ],
}


def test_fla_hybrids_import_with_fla_logits_and_export_to_transformers(tmp_path):
    """fla's GLAForCausalLM with ``attn`` (dict and list forms, full and windowed, GQA on and off)
    imports with its own logits within 1e-4 x max |logit| (fp32, 40 tokens, past every window);
    our export of a hybrid loads in transformers with ours."""
    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_heads=2, expand_k=0.5, use_short_conv=True)
    jobs = {name: {"config": {**base, "attn": attn}, "dir": str(tmp_path / name)} for name, attn in FLA_SPECS.items()}
    cfg = hybrid(WINDOWED, d_model=64, vocab_size=256)
    ours = jax.tree.map(
        lambda x: x + 0.05 * np.random.default_rng(0).standard_normal(x.shape), init_params(cfg, jax.random.key(5))
    )
    save_model(str(tmp_path / "ours"), cfg, ours)
    assert main(["to-fla", str(tmp_path / "ours"), str(tmp_path / "export"), "--tokenizer", "byte"]) == 0
    jobs["export"] = {"dir": str(tmp_path / "export")}
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 64, 40)]
    logits = run_child(jobs, prompt)
    for name in FLA_SPECS:
        got_cfg, params = load_fla(str(tmp_path / name))
        assert got_cfg.attn == hybrid(FLA_SPECS[name], d_model=64).attn
        ref = np.asarray(logits[name])
        got = np.asarray(forward(got_cfg, params, jnp.asarray([prompt])))[0]
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), name
    ref = np.asarray(logits["export"])
    got = np.asarray(forward(cfg, ours, jnp.asarray([prompt])))[0]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["attn"] == {**WINDOWED, "qkv_bias": False, "rope_theta": 10000.0}
    back_cfg, back = load_fla(str(tmp_path / "export"))
    assert back_cfg.attn == cfg.attn
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b), ours, back)


# ----- serving -------------------------------------------------------------------------------
SERVED = dataclasses.replace(
    hybrid([dict(layers=[1], num_heads=4, window_size=24), dict(layers=[2], num_heads=2)], vocab_size=256),
    init_std=0.3, chunk_size=16, max_seq_len=512,
)  # fmt: skip
SERVED_PARAMS = init_params(SERVED, jax.random.key(3))
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)


def ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 256, n)]


def engine(cache_bytes):
    serve = serve_config(
        max_num_seqs=2, prefill_chunk=16, steps_per_call=3, max_model_len=512, prefix_cache_bytes=cache_bytes,
        prefix_block=64,
    )  # fmt: skip
    e = Engine(SERVED, SERVED_PARAMS, serve, eos_id=0)
    e.warmup()
    return e


def test_served_hybrid_is_exact_compiles_nothing_after_warmup_and_resumes_bit_identically():
    """Greedy completions equal the model's own decode loop; a prompt sharing a 128-id prefix
    resumes from the cached state (KV ring included) with the same tokens and logprobs as a
    full prefill; n=2 members share one prefill; JAX compiles nothing after warmup."""
    prefix = ids(128, 0)
    prompts = [prefix + ids(30, 1), prefix + ids(17, 2)]
    want = reference_greedy(prompts[0], 12, eos_id=-1, params=SERVED_PARAMS, cfg=SERVED)  # before the engines
    off = engine(0)
    a = off.generate([prompts[0]], GREEDY) + off.generate([prompts[1]], GREEDY)  # one at a time, as below
    assert off.compiles.total("serving") == 0  # JAX's compile events on this thread since warmup
    on = engine(1 << 26)  # (its warmup would count as the first engine's serving compiles)
    before = on.programs.prefilled_tokens
    b = on.generate([prompts[0]], GREEDY) + on.generate([prompts[1]], GREEDY)
    assert on.programs.prefilled_tokens - before == len(prompts[0]) + len(prompts[1]) - 128
    assert on.prefix.stats.hits == 1
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens and x.logprobs == y.logprobs
    assert a[0].tokens == want
    outs = {0: [], 1: []}
    sp = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    before = on.programs.prefilled_tokens
    on.submit(*(Request(prompts[1], sp[j], lambda t, r, out=outs[j]: out.extend(t)) for j in range(2)))
    on.run_until_idle()
    assert len(outs[0]) == len(outs[1]) == 6 and outs[0] != outs[1]  # two seeds
    assert on.programs.prefilled_tokens - before <= len(prompts[1])  # the two members share one prefill
    assert on.compiles.total("serving") == 0


def test_full_attention_bounds_max_model_len():
    with pytest.raises(ValueError, match=r"full-attention layers \[2\] keep a KV buffer of max_seq_len"):
        Engine(SERVED, SERVED_PARAMS, serve_config(max_model_len=1024), eos_id=0)


# ----- training ------------------------------------------------------------------------------
def _quiet(*_):
    pass


@pytest.mark.usefixtures("compile_cache")  # the resume compiles nothing new
def test_hybrid_trains_resumes_exactly_and_fsdp_equals_one_device(tmp_path):
    attn = dict(attn=dict(layers=[1], num_heads=4, num_kv_heads=2, window_size=24, qkv_bias=True))
    cfg = micro_config(model=attn, train=dict(steps=8, ckpt_every=4))
    straight = run(cfg, str(tmp_path / "a"), devices=jax.devices()[:1], log=_quiet)
    run(cfg, str(tmp_path / "b"), max_steps=4, devices=jax.devices()[:1], log=_quiet)
    resumed = run(cfg, str(tmp_path / "b"), devices=jax.devices()[:1], log=_quiet)
    a = {h["step"]: h["loss"] for h in straight["history"]}
    b = {h["step"]: h["loss"] for h in resumed["history"]}
    assert sorted(b) == [5, 6, 7, 8] and all(a[s] == b[s] for s in b)  # bitwise on CPU
    assert a[8] < a[1]
    four = run(cfg, str(tmp_path / "four"), devices=jax.devices()[:4], log=_quiet)  # fsdp over 4
    np.testing.assert_allclose([h["loss"] for h in four["history"]], [a[s] for s in sorted(a)], atol=1e-5)


@pytest.mark.parametrize(
    "attn,context",
    [
        (dict(layers=[1], num_heads=4, window_size=24), 2),  # the previous slice's last 23 keys
        (dict(layers=[0], num_heads=4, num_kv_heads=2), 4),  # full attention: every slice's keys
        (dict(layers=[1], num_heads=2, window_size=100), 4),  # a window longer than a slice
    ],
    ids=["window-halo", "full-gather", "long-window-gather"],
)
def test_context_parallel_hybrid_equals_one_device(attn, context):
    """The micro hybrid with each 128-token sequence split over 2 or 4 devices (and fsdp 2): the
    loss and every gradient equal one device's within 1e-5 relative."""
    from laplace_jax.hlo_stats import collectives_by_source

    cfg = micro_config(
        mesh=dict(fsdp=2, context=context), data=dict(seq_len=128), model=dict(max_seq_len=128, attn=attn)
    )
    params = init_params(cfg.model, jax.random.key(0))
    batch = np.random.default_rng(0).integers(1, 256, (8, 129)).astype(np.int32)
    ref_loss, ref_grads = reference_value_and_grad(cfg.model)(params, batch)
    loss, grads, hlo = sharded_value_and_grad(cfg, 2 * context, params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * float(jnp.max(jnp.abs(r))) + 1e-12, jax.tree_util.keystr(path)
    # the compiled step exchanges the keys as planned (a neighbour halo or an all-gather, named by
    # their scopes; the short convs' halos are the other permutes), and files it under "context"
    halo = attn.get("window_size") is not None and attn["window_size"] - 1 <= 128 // context
    names = {
        kind: re.findall(rf" {kind}(?:-start)?\(.*?op_name=\"([^\"]*)\"", hlo)
        for kind in ("collective-permute", "all-gather")
    }
    own_halos = [n for n in names["collective-permute"] if "context_halo" in n and "conv1d" not in n]
    kv_gathers = [n for n in names["all-gather"] if "context_kv" in n]
    assert (len(own_halos) > 0, len(kv_gathers) > 0) == (halo, not halo)
    assert collectives_by_source(hlo).keys() <= {"context", "weights", "embeddings", "other"}
    assert "all-gather" not in collectives_by_source(hlo).get("other", {})
