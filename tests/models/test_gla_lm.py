"""The whole GLA model vs the PyTorch reference, loaded through laplace_jax.convert."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from fla_files import fla_config, write_fla_checkpoint
from torch_gla import GLAForCausalLM

from laplace_jax import ModelConfig, decode_step, forward, init_params, prefill
from laplace_jax.convert import load_fla, params_to_state_dict
from laplace_jax.errors import ConfigError

LOGIT_TOL = 1e-4  # |jax - torch| <= 1e-4 * (|torch| + max|torch|) elementwise, fp32


@pytest.mark.parametrize(
    "short_conv, kv_heads, fuse_norm", [(False, None, True), (True, None, True), (False, 2, True), (True, 2, False)]
)
def test_logits_match_torch_reference(tmp_path, short_conv, kv_heads, fuse_norm):
    c = fla_config(use_short_conv=short_conv, num_kv_heads=kv_heads, fuse_norm=fuse_norm)
    ref_model = write_fla_checkpoint(tmp_path, c)
    cfg, params = load_fla(str(tmp_path), chunk_size=64)
    tokens = np.random.default_rng(0).integers(0, c["vocab_size"], (2, 150))  # 150: not a multiple of 64
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(tokens)).double().numpy()
    out = np.asarray(jax.jit(forward, static_argnums=0)(cfg, params, jnp.asarray(tokens)), np.float64)
    err = np.abs(out - ref)
    assert np.all(err <= LOGIT_TOL * (np.abs(ref) + np.abs(ref).max())), err.max()


def test_gradients_at_strong_decay_match_torch_float64(tmp_path):
    """Every parameter's gradient against float64 torch autograd of the token recurrence, with
    gates that decay ~4 nats per token (normalizer 1, gate bias -4): the gate projection's bias
    sums the gate gradient over every position, so any cancellation in it shows here. Weights at
    the model's init scale (0.02): the kernel before the cancellation-free gate gradient measured
    2.1e-4 in gk_proj.1.bias here, this one 2.2e-6."""
    c = fla_config(gate_logit_normalizer=1.0)
    ref_model = write_fla_checkpoint(tmp_path, c, std=0.02, gate_bias=-4.0).double()
    cfg, params = load_fla(str(tmp_path), chunk_size=64)
    r = np.random.default_rng(0)
    tokens = r.integers(0, c["vocab_size"], (2, 150))
    w = r.standard_normal((2, 150, c["vocab_size"]))
    (ref_model(torch.from_numpy(tokens)) * torch.from_numpy(w)).sum().backward()
    w32 = jnp.asarray(w, jnp.float32)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(forward(cfg, p, jnp.asarray(tokens)) * w32)))(params)
    ours = params_to_state_dict(cfg, grads)
    errors = {}
    for name, p in ref_model.named_parameters():
        ref = p.grad.numpy()
        errors[name] = float(np.abs(ours[name].astype(np.float64) - ref).max() / np.abs(ref).max())
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, (worst, errors[worst])
    assert "model.layers.0.attn.gk_proj.1.bias" in errors


@pytest.mark.parametrize("short_conv", [False, True])
def test_prefill_then_decode_equals_forward(short_conv):
    cfg = ModelConfig(
        vocab_size=61, d_model=64, n_layers=2, n_heads=2, use_short_conv=short_conv, chunk_size=32, init_std=0.1
    )
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 77), 0, cfg.vocab_size)
    full = forward(cfg, params, tokens)
    P = 70
    logits, state = prefill(cfg, params, tokens[:, :P])
    np.testing.assert_allclose(logits, full[:, :P], atol=1e-5 * float(jnp.abs(full).max()))
    step = jax.jit(decode_step, static_argnums=0)
    for t in range(P, 77):
        out, state = step(cfg, params, tokens[:, t], state)
        np.testing.assert_allclose(out, full[:, t], atol=1e-5 * float(jnp.abs(full).max()))


def test_chunked_prefill_continues_state():
    cfg = ModelConfig(
        vocab_size=61, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1
    )
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 50), 0, cfg.vocab_size)
    full, s_full = prefill(cfg, params, tokens)
    a, s = prefill(cfg, params, tokens[:, :20])
    b, s = prefill(cfg, params, tokens[:, 20:], s)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, atol=1e-5 * float(jnp.abs(full).max()))
    for leaf, leaf_full in zip(jax.tree.leaves(s), jax.tree.leaves(s_full), strict=True):
        np.testing.assert_allclose(leaf, leaf_full, atol=1e-5)


BF16_LOGIT_BOUND = 3e-2  # RMS relative error of bf16-compute logits vs fp32 (docs/kernels.md)


def test_bf16_compute_error_is_bounded():
    kw = dict(vocab_size=256, d_model=128, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=64, init_std=0.05)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 200), 0, 256)
    ref = forward(ModelConfig(**kw), params, tokens)
    out = forward(ModelConfig(**kw, dtype="bfloat16"), params, tokens)
    assert out.dtype == jnp.float32
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    print(f"bf16 vs fp32 logits RMS relative error: {err:.2e}")
    assert err < BF16_LOGIT_BOUND


def test_remat_and_recurrent_impl_give_same_logits():
    kw = dict(vocab_size=61, d_model=64, n_layers=3, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 61)
    ref = forward(ModelConfig(**kw), params, tokens)
    extras = (*(dict(remat=p) for p in ("full", "save_dots", "save_gla")), dict(attn_impl="recurrent"))
    for extra in (*extras, dict(scan_layers=False)):
        np.testing.assert_allclose(forward(ModelConfig(**kw, **extra), params, tokens), ref, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_pallas_impls_give_the_same_logits_and_gradients_under_jit(impl, every_platform):
    """model.attn_impl="pallas" / "mosaic" (interpreted on CPU) against "chunk", through jit and grad;
    "auto" compiles to the Pallas kernel for a GPU and to the XLA kernel for this CPU."""
    kw = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 61)

    def loss_and_grads(impl):
        loss = lambda p: jnp.sum(forward(ModelConfig(**kw, attn_impl=impl), p, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    (ref_loss, ref), (loss, grads) = loss_and_grads("chunk"), loss_and_grads(impl)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))

    def uses_pallas(impl):
        jaxpr = jax.make_jaxpr(lambda p: forward(ModelConfig(**kw, attn_impl=impl), p, tokens))(params)
        return "pallas_call" in str(jaxpr)

    def lowered_auto(platform_name):  # the default, compiled for a GPU and for this CPU
        fn = jax.jit(lambda p: forward(ModelConfig(**kw, attn_impl="auto"), p, tokens))
        return fn.trace(params).lower(lowering_platforms=(platform_name,)).as_text()

    assert uses_pallas(impl)
    assert "xla.gpu.triton" in lowered_auto("cuda") and "triton" not in lowered_auto("cpu")
    with pytest.raises(ConfigError, match="power of two"):
        ModelConfig(**{**kw, "chunk_size": 24}, attn_impl=impl)


def test_decode_with_the_mosaic_step_kernels_equals_the_xla_step():
    """model.attn_impl="mosaic" in ``decode_step`` (128 rows, V = 192 and 384 v channels: the Mosaic
    GLA step and v's conv step, interpreted) against "chunk" (the XLA steps), three tokens from a
    prefilled state, a live mask on the last: fp32 logits and states within 1e-5, and the masked
    rows keep their state bit for bit."""
    from laplace_jax import init_state

    kw = dict(vocab_size=61, d_model=384, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.05)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    B = 128
    prompt = jax.random.randint(jax.random.key(1), (B, 5), 0, 61)
    live = jnp.arange(B) % 4 != 0

    def run(impl):
        cfg = ModelConfig(**kw, attn_impl=impl)
        _, state = prefill(cfg, params, prompt, init_state(cfg, B))
        step = jax.jit(lambda t, s, m=None: decode_step(cfg, params, t, s, m))
        outs = []
        for i in range(3):
            logits, new = step(prompt[:, i], state, live if i == 2 else None)
            outs.append(logits)
            last, state = state, new
        return jnp.stack(outs), state, last

    (ref, ref_state, _), (got, got_state, before) = run("chunk"), run("mosaic")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(before), strict=True):
        assert np.array_equal(np.asarray(a)[~live], np.asarray(b)[~live])
    cfg = ModelConfig(**kw, attn_impl="mosaic")
    jaxpr = str(jax.make_jaxpr(lambda t: decode_step(cfg, params, t, init_state(cfg, B)))(prompt[:, 0]))
    assert "gla_mosaic_step" in jaxpr and "short_conv_mosaic_step" in jaxpr


@pytest.mark.slow
def test_remat_policies_give_the_same_gradients_and_keep_what_they_say():
    kw = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 61)

    def grads(remat):
        loss = lambda p: jnp.sum(forward(ModelConfig(**kw, remat=remat), p, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    ref = grads("none")
    for policy in ("full", "save_dots", "save_gla"):
        for a, b in zip(jax.tree.leaves(grads(policy)), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))  # fp32 re-association

    def saved(remat):  # the residuals kept between forward and backward
        _, f_vjp = jax.vjp(lambda p: forward(ModelConfig(**kw, remat=remat), p, tokens), params)
        return jax.tree.leaves(f_vjp)

    kept = {p: saved(p) for p in ("none", "full", "save_dots", "save_gla")}
    sizes = {p: sum(x.nbytes for x in leaves) for p, leaves in kept.items()}
    assert sizes["full"] < sizes["save_gla"] < sizes["none"]
    assert sizes["full"] < sizes["save_dots"] < sizes["none"]
    # save_gla keeps the GLA inputs as [layers, B, T, features] rows, not [.., T, H, d] (a TPU pads
    # a few heads' tiles: docs/tpu.md, the 340M train step)
    cfg, (B, T) = ModelConfig(**kw), tokens.shape
    shapes = {x.shape for x in kept["save_gla"]}
    assert {(cfg.n_layers, B, T, cfg.key_dim), (cfg.n_layers, B, T, cfg.value_dim)} <= shapes
    assert not any(s[2:4] == (T, cfg.n_heads) for s in shapes if len(s) == 5)
    assert ModelConfig(**kw, remat=True).remat == "full" and ModelConfig(**kw, remat=False).remat == "none"
    with pytest.raises(ConfigError, match=r"model\.remat must be one of"):
        ModelConfig(**kw, remat="everything")


def test_tied_embeddings_have_no_head():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, tie_embeddings=True)
    params = init_params(cfg, jax.random.key(0))
    assert "lm_head" not in params
    assert forward(cfg, params, jnp.zeros((1, 3), jnp.int32)).shape == (1, 3, 50)


def test_bad_model_inputs():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, use_short_conv=True)
    params = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="integer token ids"):
        forward(cfg, params, jnp.zeros((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        forward(cfg, params, jnp.zeros((3,), jnp.int32))
    _, state = prefill(cfg, params, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="batch 3"):
        decode_step(cfg, params, jnp.zeros((3,), jnp.int32), state)


def analytic_param_count(cfg: ModelConfig) -> int:
    """Independent count from the architecture (fla's GLA layer: q/k/v/g/o projections, low-rank
    gate, short convs, gated norm; SwiGLU MLP), written out by hand."""
    d, G = cfg.d_model, cfg.kv_groups
    kd, vd = int(d * cfg.expand_k), int(d * cfg.expand_v)
    mlp = cfg.mlp_dim or 256 * math.ceil(int(d * cfg.hidden_ratio * 2 / 3) / 256)
    attn = d * kd + d * kd // G + d * vd // G + d * vd + vd * d
    attn += d * cfg.gate_low_rank_dim + cfg.gate_low_rank_dim * kd // G + kd // G + vd // cfg.n_heads
    if cfg.use_short_conv:
        attn += cfg.conv_size * (kd + kd // G + vd // G)
    layer = attn + 3 * d * mlp + 2 * d
    head = 0 if cfg.tie_embeddings else d * cfg.vocab_size
    return cfg.vocab_size * d + cfg.n_layers * layer + d + head


@pytest.mark.parametrize("name", ["tiny", "gla_340m", "gla_1b3", "3b"])
def test_param_count_of_every_config(name):
    from laplace_jax.config import load_run_config
    from laplace_jax.info import model_report

    cfg = load_run_config(f"configs/{name}.py").model
    rep = model_report(cfg)
    assert rep["params"] == analytic_param_count(cfg)
    if name == "3b":
        assert rep["params"] == 3_029_528_064  # the original team's 3.028e9, with short convs
        assert rep["state_bytes_per_sequence"] == 29_491_200
        assert rep["kv_cache_bytes_bf16"] == 2_415_919_104
        assert round(rep["kv_cache_over_state"], 1) == 81.9


def test_torch_reference_param_count_matches():
    c = fla_config(use_short_conv=True, num_kv_heads=2)
    from laplace_jax.convert import config_from_fla

    n_torch = sum(p.numel() for p in GLAForCausalLM(c).parameters())
    assert n_torch == analytic_param_count(config_from_fla(c))


def test_padded_prefill_chunks_are_state_neutral():
    """Fixed-size chunks with a padded tail give the state and logits of the exact prompt."""
    cfg = ModelConfig(
        vocab_size=61, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1
    )
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 45), 0, cfg.vocab_size)
    want_logits, want = prefill(cfg, params, tokens[:, :37])
    P = 16
    state = None
    for start in range(0, 48, P):
        chunk = (
            jnp.zeros((2, P), jnp.int32).at[:, : max(0, min(P, 37 - start))].set(tokens[:, start : min(start + P, 37)])
        )
        n = jnp.full((2,), max(0, min(P, 37 - start)), jnp.int32)
        logits, state = prefill(cfg, params, chunk, state, n)
    np.testing.assert_allclose(logits[:, 37 - 32 - 1], want_logits[:, -1], atol=1e-5)
    for leaf, leaf_want in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(leaf, leaf_want, atol=1e-5)


@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
@pytest.mark.parametrize("compute", ["bfloat16", "float32"])
def test_3b_decode_step_updates_the_state_in_place(weights, compute):
    """The 3B decode step at W=256 as serving compiles it (weights packed as placed, state donated),
    from abstract inputs: XLA's temporaries stay a small fraction of the 7.5 GB state. Before,
    bf16 weights cost 10.7 GiB (an f32 copy of every layer's weights, hoisted out of the loop)."""
    import dataclasses

    from laplace_jax.config import load_run_config
    from laplace_jax.models.gla_lm import abstract_params, init_state, pack_weights

    cfg = dataclasses.replace(load_run_config("configs/3b.py").model, dtype=compute)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(weights)), abstract_params(cfg))
    params = jax.eval_shape(pack_weights, params)
    state = jax.eval_shape(lambda: init_state(cfg, 256))
    token = jax.ShapeDtypeStruct((256,), jnp.int32)
    step = jax.jit(lambda p, t, s: decode_step(cfg, p, t, s), donate_argnums=(2,))
    temps = step.lower(params, token, state).compile().memory_analysis().temp_size_in_bytes
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert temps < 0.25 * state_bytes, (temps / 2**30, state_bytes / 2**30)


def test_packed_weights_give_the_same_logits():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, use_short_conv=True, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, jax.random.key(0)))
    from laplace_jax.models.gla_lm import pack_weights

    packed = pack_weights(params)
    assert any(x.dtype == jnp.uint16 for x in jax.tree.leaves(packed["layers"]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 20)))
    for fn in (lambda p: prefill(cfg, p, tokens)[0], lambda p: forward(cfg, p, tokens)):
        np.testing.assert_array_equal(np.asarray(fn(params)), np.asarray(fn(packed)))


def test_per_layer_weights_give_the_same_prefill_decode_and_verify():
    """unstack_weights (serving's TPU form, its vectors narrower than a lane tile placed as
    [1, w] rows): prefill (then unrolled, as decode) and decode_step agree with the stacked
    weights' within fp32 rounding (prefill: a scan against a loop), verify exactly; forward
    refuses the form with a message."""
    from laplace_jax.models.gla_lm import unstack_weights, verify

    kw = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, init_std=0.1)
    cfg = ModelConfig(**kw)
    params = init_params(cfg, jax.random.key(0))
    per_layer = unstack_weights(cfg, params)
    assert isinstance(per_layer["layers"], tuple) and len(per_layer["layers"]) == cfg.n_layers
    rows = [w.shape for w in jax.tree.leaves(per_layer["layers"]) if w.shape[0] == 1]
    assert {(1, 32), (1, 64)} <= set(rows), rows  # the 32-wide head norm's gain, the 64-wide norms'
    tokens = jax.random.randint(jax.random.key(1), (2, 39), 0, cfg.vocab_size)
    (a, sa), (b, sb) = (prefill(cfg, p, tokens[:, :37]) for p in (params, per_layer))
    scale = float(jnp.max(jnp.abs(a)))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale)
    for x, y in zip(jax.tree.leaves(sb), jax.tree.leaves(sa), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for t in range(37, 39):
        (la, sa), (lb, sb) = (decode_step(cfg, p, tokens[:, t], s) for p, s in ((params, sa), (per_layer, sb)))
        np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5 * scale)
    live = jnp.ones((2,), bool)
    va, vb = (verify(cfg, p, tokens[:, 30:34], sa, live)[0] for p in (params, per_layer))
    np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    with pytest.raises(ValueError, match="stacked weights"):
        forward(cfg, per_layer, tokens)
