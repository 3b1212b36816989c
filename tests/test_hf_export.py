"""A trained run goes to Hugging Face in one command: `convert to-fla RUN OUT` writes a directory
that transformers' AutoTokenizer and AutoModelForCausalLM (trust_remote_code, fla's own classes,
whose Triton kernels run here as PyTorch through fla_on_cpu) load, with the JAX model's logits
and greedy text, and a tokenizer that round-trips every byte."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from fla_on_cpu import fla_on_cpu

from laplace_jax.convert import load_fla, main
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.generate import sample
from laplace_jax.loading import load_for_inference
from laplace_jax.models.gla_lm import forward
from laplace_jax.train.loop import run
from tests.helpers import micro_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    run(
        micro_config(train=dict(steps=6, ckpt_every=3)),
        str(base / "run"),
        devices=jax.devices()[:1],
        log=lambda *_: None,
    )
    assert main(["to-fla", str(base / "run"), str(base / "hf"), "--step", "6"]) == 0
    return base / "run", base / "hf"


def test_export_has_the_files_and_ids_transformers_needs(exported):
    _, hf = exported
    config = json.loads((hf / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (0, 0, 0)
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_laplace_gla.GLAForCausalLM"
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "modeling_laplace_gla.py", "model.safetensors"):
        assert (hf / name).is_file(), name


def test_export_round_trip_is_value_exact(exported):
    run_dir, hf = exported
    cfg, params, _, _ = load_for_inference(str(run_dir))
    cfg2, params2 = load_fla(str(hf))
    assert cfg2.n_layers == cfg.n_layers and cfg2.vocab_size == cfg.vocab_size
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), b)


def test_tokenizer_round_trips_every_byte_and_invalid_utf8(exported):
    _, hf = exported
    t = transformers.AutoTokenizer.from_pretrained(str(hf))
    ours = ByteTokenizer()
    assert t.eos_token_id == ours.eos_id == t.pad_token_id
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(chr(rng.choice([rng.randint(1, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                       for _ in range(rng.randint(0, 12)))  # fmt: skip
        assert t.encode(text, add_special_tokens=False) == ours.encode(text)
        ids = [rng.randint(1, 255) for _ in range(rng.randint(1, 12))]  # arbitrary bytes, invalid UTF-8 included
        assert t.decode(ids) == ours.decode(ids)
    assert t.decode([104, 105, 0], skip_special_tokens=True) == ours.decode([104, 105, 0]) == "hi"


def test_transformers_loads_the_export_with_the_jax_models_logits_and_greedy_text(exported):
    run_dir, hf = exported
    cfg, params, tok, _ = load_for_inference(str(run_dir))
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True).eval()
    ids = tok.encode("the quick brown fox")
    with fla_on_cpu(), torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0].numpy()
        out = m.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, use_cache=False)
    want = np.asarray(forward(cfg, params, jnp.asarray([ids]))[0])
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    greedy = sample(cfg, params, ids, 12, temperature=0.0)
    assert out[0, len(ids) :].tolist() == greedy
