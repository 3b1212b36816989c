"""The chunked GLA kernels (XLA, Pallas GPU, Pallas TPU) vs recurrent_gla vs an independent PyTorch
recurrence (fp32 and bf16).

The Pallas kernels run in the Pallas interpreter here (CPU); every kernel test runs on every kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch_gla import naive_recurrent_gla

from laplace_jax.ops.gla import chunk_gla, gla, gla_step, recurrent_gla
from laplace_jax.ops.gla.naive import SWEEP_DECAYS, decay_sweep_inputs
from laplace_jax.ops.gla.naive import random_gla_inputs as _inputs
from laplace_jax.ops.gla.naive import rel_error as _rel

TOL = 5e-6  # max abs error relative to the output scale (max |o_ref|), fp32: 10x the worst measured (5e-7)


KERNELS = pytest.mark.parametrize("kernel", ["chunk", "chunk-tpu", "pallas", "mosaic"])


def _chunk(kernel: str):
    """A chunked GLA kernel under test: "chunk" (as XLA:CPU traces it: the blocks layout),
    "chunk-tpu" (the chunk kernel traced as for a TPU, run here: the full-width layout a systolic
    array gets), "pallas" (GPU), "mosaic" (TPU)."""
    if kernel != "chunk-tpu":
        return functools.partial(gla, impl=kernel)
    return functools.partial(chunk_gla, layout="full")


# every T on the chunk kernel; the interpreted Pallas kernel on the T that exercise a partial
# chunk, one chunk exactly and many chunks (the interpreter is slow on CPU)
AGREE = [("chunk", T) for T in (1, 100, 128, 300, 2048)]
AGREE += [(kernel, T) for kernel in ("chunk-tpu", "pallas", "mosaic") for T in (100, 128, 2048)]


@pytest.mark.parametrize("kernel, T", AGREE)
@pytest.mark.parametrize("decay", ["weak", "strong"])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_recurrent_torch_agree(T, decay, with_state, kernel):
    q, k, v, g, s0 = _inputs(T, decay, seed=T)
    init = s0 if with_state else None
    f64 = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731  the oracle runs in float64
    o_t, s_t = naive_recurrent_gla(*(f64(x) for x in (q, k, v, g)), initial_state=None if init is None else f64(init))
    o_t, s_t = o_t.numpy(), s_t.numpy()
    o_c, s_c = _chunk(kernel)(q, k, v, g, initial_state=init)
    o_r, s_r = recurrent_gla(q, k, v, g, initial_state=init)
    assert o_c.shape == o_t.shape and s_c.dtype == jnp.float32
    assert np.all(np.isfinite(o_c))
    assert _rel(o_c, o_t) <= TOL
    assert _rel(o_r, o_t) <= TOL
    assert _rel(s_c, s_t) <= TOL
    assert _rel(s_r, s_t) <= TOL
    print(f"T={T} {decay}: chunk ({kernel}) vs float64 oracle {_rel(o_c, o_t):.1e}, recurrent {_rel(o_r, o_t):.1e}")


@KERNELS
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
def test_chunk_size_does_not_change_result(chunk_size, kernel):
    q, k, v, g, s0 = _inputs(300, "weak")
    ref, _ = chunk_gla(q, k, v, g, initial_state=s0, chunk_size=128)
    o, _ = _chunk(kernel)(q, k, v, g, initial_state=s0, chunk_size=chunk_size)
    assert _rel(o, np.asarray(ref, np.float64)) <= TOL


@KERNELS
@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_gradients_chunk_equal_recurrent(decay, kernel):
    q, k, v, g, s0 = _inputs(300, decay, seed=7)
    r = np.random.default_rng(1)
    w_o = r.standard_normal((2, 300, 2, 32)).astype(np.float32)
    w_s = r.standard_normal(s0.shape).astype(np.float32)

    def loss(fn, *args):
        o, s = fn(*args[:4], initial_state=args[4])
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    chunk = _chunk(kernel)
    grads_c = jax.grad(lambda *a: loss(chunk, *a), argnums=range(5))(q, k, v, g, s0)
    grads_r = jax.grad(lambda *a: loss(recurrent_gla, *a), argnums=range(5))(q, k, v, g, s0)
    for name, gc, gr in zip(["q", "k", "v", "g", "s0"], grads_c, grads_r, strict=True):
        assert np.all(np.isfinite(gc)), name
        assert _rel(gc, np.asarray(gr, np.float64)) <= TOL, name


@KERNELS
@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_gradients_match_torch_float64_autograd(decay, kernel):
    """The hand-written backward against autograd of an independent float64 torch recurrence."""
    T = 150
    q, k, v, g, s0 = _inputs(T, decay, seed=11)
    r = np.random.default_rng(2)
    w_o = r.standard_normal((2, T, 2, 32))
    w_s = r.standard_normal(s0.shape)
    xs = [torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (q, k, v, g, s0)]
    o_t, s_t = naive_recurrent_gla(*xs[:4], initial_state=xs[4])
    ((o_t * torch.from_numpy(w_o)).sum() + (s_t * torch.from_numpy(w_s)).sum()).backward()

    def loss(*a):
        o, s = _chunk(kernel)(*a[:4], initial_state=a[4], chunk_size=64)
        return jnp.sum(o * w_o.astype(np.float32)) + jnp.sum(s * w_s.astype(np.float32))

    grads = jax.grad(loss, argnums=range(5))(q, k, v, g, s0)
    for name, ours, ref in zip(["q", "k", "v", "g", "s0"], grads, xs, strict=True):
        assert _rel(ours, ref.grad.numpy()) <= TOL, name


# the decay sweep (naive.decay_sweep_inputs, shared with benchmarks/bench_decay_sweep.py): per-token
# log-decays from almost none to -16 nats
SWEEP_PER_ELEMENT, SWEEP_SUMMED = 2e-6, 1e-5  # measured ~1e-7 to 6e-7 on both kernels


@functools.cache
def _sweep_grad(kernel):
    def loss(q, k, v, g, s0, w_o, w_s):
        o, s = _chunk(kernel)(q, k, v, g, initial_state=s0, chunk_size=64)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    return jax.jit(jax.grad(loss, argnums=range(5)))


@KERNELS
@pytest.mark.parametrize("decay", SWEEP_DECAYS)
def test_gradients_exact_at_every_decay(decay, kernel):
    """All five gradients against float64 torch autograd of the token recurrence, per element and
    summed over batch and positions (what a gate bias sees): the gate gradient must not cancel
    however strong the decay (T = 150: a partial chunk of 64, sub-blocks between pairs)."""
    *xs, w_o, w_s = decay_sweep_inputs(decay, seed=3)  # the benchmark's inputs: B2 T150 H2 K32 V32
    xs = [x.astype(np.float32) for x in xs]
    ts = [torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in xs]
    o_t, s_t = naive_recurrent_gla(*ts[:4], initial_state=ts[4])
    ((o_t * torch.from_numpy(w_o)).sum() + (s_t * torch.from_numpy(w_s)).sum()).backward()
    grads = _sweep_grad(kernel)(*xs, w_o.astype(np.float32), w_s.astype(np.float32))
    for name, ours, ref in zip(["q", "k", "v", "g", "s0"], grads, ts, strict=True):
        ref = ref.grad.numpy()
        assert _rel(ours, ref) <= SWEEP_PER_ELEMENT, (name, _rel(ours, ref))
        if name != "s0":
            summed = np.sum(np.asarray(ours, np.float64), axis=(0, 1))
            assert _rel(summed, ref.sum(axis=(0, 1))) <= SWEEP_SUMMED, (name, "summed")
    # each (head, key channel) against its own scale: "mixed" must not hide a strong channel
    err = np.abs(np.asarray(grads[3], np.float64) - ts[3].grad.numpy()).max(axis=(0, 1))
    assert np.max(err / np.abs(ts[3].grad.numpy()).max(axis=(0, 1))) <= SWEEP_PER_ELEMENT


@pytest.mark.parametrize("C", [16, 128])
def test_mosaic_doubling_sums_are_the_level_sums_and_their_transpose(C):
    """The Mosaic kernels' decay sums (``block_sums``, rolls on the vector unit) against float64
    products with the 0/1 level matrices of ``levels.py`` (an independent construction), and their
    transpose (the gate gradient's sums) likewise: within L fp32 roundings of each same-sign sum
    (decays -0.01 to -16 per token), within 4 L roundings of the absolute terms for mixed signs."""
    from jax.experimental import pallas as pl

    from laplace_jax.ops.gla.levels import level_matrices
    from laplace_jax.ops.gla.mosaic import block_sums, block_sums_T

    L, D, u = C.bit_length() - 1, 128, 2.0**-24
    rng = np.random.default_rng(C)
    g = -np.exp(rng.uniform(np.log(0.01), np.log(16.0), (C, D))).astype(np.float32)
    y = rng.normal(size=(L + 2, C, D)).astype(np.float32)

    def kernel(g_ref, y_ref, sums_ref, tot_ref, t_ref):
        sides, incl, rev, tot = block_sums(g_ref[...])
        for i, x in enumerate([*sides, incl, rev]):
            sums_ref[i] = x
        tot_ref[...] = tot
        t_ref[...] = block_sums_T([y_ref[i] for i in range(L)], y_ref[L], y_ref[L + 1])

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((L + 2, C, D), (C, D), (C, D))]
    sums, tot, t = pl.pallas_call(kernel, out_shape=shapes, interpret=True)(g, y)
    m = level_matrices(C)
    M = np.concatenate([m["sides"].reshape(-1, C), m["incl"], m["rev_excl"]]).astype(np.float64)
    ref = (M @ g.astype(np.float64)).reshape(L + 2, C, D)
    assert np.all(np.abs(sums - ref) <= L * u * np.abs(ref) + 1e-30)
    assert np.all(np.abs(tot - ref[L, -1]) <= L * u * np.abs(ref[L, -1]))  # every row: the chunk's total
    y64 = y.reshape(-1, D).astype(np.float64)
    ref_t, bound = M.T @ y64, 4 * L * u * (M.T @ np.abs(y64))
    assert np.all(np.abs(t - ref_t) <= bound)


@pytest.mark.parametrize("layout", ["full", "blocks"])
@pytest.mark.parametrize("C", [16, 48])
def test_the_scores_backward_reads_only_the_lower_triangle_of_dA(layout, C):
    """The backward hands the levels the score gradient without a tril: each level pairs its upper
    rows with its lower ones, so garbage above the diagonal (large, both signs) must change no
    gradient bit, in either layout and for a chunk padded to the next power of two (48 -> 64)."""
    from laplace_jax.ops.gla.levels import scores_bwd

    rng = np.random.default_rng(C)
    q, k = (jnp.asarray(rng.normal(size=(2, C, 8)), jnp.float32) for _ in range(2))
    g = jnp.asarray(-np.exp(rng.uniform(np.log(0.01), np.log(16.0), (2, C, 8))), jnp.float32)
    dA = rng.normal(size=(2, C, C))
    lower = jnp.asarray(np.tril(dA), jnp.float32)
    garbage = jnp.asarray(np.tril(dA) + np.triu(1e6 * rng.normal(size=(2, C, C)), 1), jnp.float32)
    want = scores_bwd(q, k, g, lower, 0.3, jnp.float32, layout)
    got = scores_bwd(q, k, g, garbage, 0.3, jnp.float32, layout)
    for w, x in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(w))


def test_autodiff_saves_only_inputs_chunk_states_and_scores():
    """What jax.grad keeps between forward and backward: the inputs, the [N, B, H, K, V] chunk
    states and the [N, B, H, C, C] scores, nothing per sub-block or per diagonal."""
    B, T, H, K, V, C = 2, 256, 2, 16, 32, 128
    q, k, v, g, s0 = _inputs(T, "weak", B=B, H=H, K=K, V=V)
    _, f_vjp = jax.vjp(lambda *a: chunk_gla(*a[:4], initial_state=a[4], chunk_size=C), q, k, v, g, s0)
    sizes = sorted(x.size for x in jax.tree.leaves(f_vjp))
    inputs = [x.size for x in (q, k, v, g, s0)]
    states, scores = (T // C) * B * H * K * V, (T // C) * B * H * C * C
    assert sizes == sorted([*inputs, states, scores])


def test_step_matches_torch_single_step():
    """gla_step against the independent torch recurrence run for one token from a state (float64)."""
    q, k, v, g, s0 = _inputs(1, "strong", seed=9)
    f64 = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    o_t, s_t = naive_recurrent_gla(*(f64(x) for x in (q, k, v, g)), initial_state=f64(s0))
    o, s = gla_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], s0)
    assert _rel(o, o_t.numpy()[:, 0]) <= 1e-6 and _rel(s, s_t.numpy()) <= 1e-6


@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_steps_match_the_torch_recurrence(decay):
    """gla_step token by token (the decode path) against the independent float64 torch recurrence."""
    q, k, v, g, s0 = _inputs(20, decay, seed=4)
    f64 = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    o_t, s_t = naive_recurrent_gla(*(f64(x) for x in (q, k, v, g)), initial_state=f64(s0))
    s, outs = s0, []
    for t in range(20):
        o, s = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], s)
        outs.append(o)
    assert _rel(np.stack(outs, 1), o_t.numpy()) <= TOL and _rel(s, s_t.numpy()) <= TOL


BF16_BOUND = 2e-2  # RMS relative error of bf16-input chunk_gla vs fp32 (documented in docs/kernels.md)


@KERNELS
def test_bf16_inputs_accumulate_in_fp32(kernel):
    q, k, v, g, _s0 = _inputs(512, "weak", seed=3)
    ref, _s_ref = chunk_gla(q, k, v, g)
    o, s = _chunk(kernel)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), g)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    err = float(jnp.linalg.norm(o.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    print(f"bf16 chunk_gla ({kernel}) RMS relative error: {err:.2e}")
    assert err < BF16_BOUND


@KERNELS
def test_bf16_gradients_stay_within_the_bf16_bound(kernel):
    """Gradients with bf16 q, k, v (the training configuration) against fp32 inputs: the Pallas
    kernel's bf16 score and score-gradient dot operands must not cost more than bf16 inputs do."""
    q, k, v, g, _s0 = _inputs(256, "strong", seed=5)
    w_o = np.random.default_rng(6).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)

    def grads(dtype):
        def loss(q, k, v, g):
            o, _ = _chunk(kernel)(q.astype(dtype), k.astype(dtype), v.astype(dtype), g, chunk_size=64)
            return jnp.sum(o.astype(jnp.float32) * w_o)

        return jax.grad(loss, argnums=range(4))(q, k, v, g)

    for name, lo, ref in zip("qkvg", grads(jnp.bfloat16), grads(jnp.float32), strict=True):
        err = float(jnp.linalg.norm(lo.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        assert np.isfinite(err) and err < BF16_BOUND, (name, err)


@pytest.mark.parametrize("kernel", ["pallas", "mosaic"])
def test_pallas_autodiff_saves_only_inputs_and_chunk_states(kernel):
    """The Pallas kernels recompute their scores: jax.grad keeps the (padded or transposed) inputs
    and the chunk-start states [B, H, N, K, V], nothing else (besides the pads' scalar fill values)."""
    B, T, H, K, V, C = 1, 64, 2, 16, 32, 32
    q, k, v, g, s0 = _inputs(T, "weak", B=B, H=H, K=K, V=V)
    _, f_vjp = jax.vjp(lambda *a: gla(*a[:4], impl=kernel, initial_state=a[4], chunk_size=C), q, k, v, g, s0)
    sizes = sorted(x.size for x in jax.tree.leaves(f_vjp) if x.ndim)
    states = (T // C) * B * H * K * V
    assert sizes == sorted([q.size, k.size, v.size, g.size, states])


def test_pallas_tiles_and_padding_do_not_change_result():
    """Odd head widths (K 24 -> 32, V 40 -> 48 in tiles of 16) against the XLA kernel."""
    q, k, v, g, s0 = _inputs(70, "strong", K=24, V=40)
    ref, s_ref = chunk_gla(q, k, v, g, initial_state=s0, chunk_size=32)
    from laplace_jax.ops.gla.pallas import pallas_gla

    o, s = pallas_gla(q, k, v, g, s0, scale=24**-0.5, chunk_size=32, block_v=16, interpret=True)
    assert o.shape == ref.shape and s.shape == s_ref.shape
    assert _rel(o, np.asarray(ref, np.float64)) <= TOL and _rel(s, np.asarray(s_ref, np.float64)) <= TOL


EDGES = [
    ("pallas", 1, 16, 16, 16),
    ("pallas", 17, 16, 8, 16),
    ("pallas", 33, 20, 24, 32),
    ("pallas", 100, 48, 80, 64),
    ("mosaic", 1, 16, 16, 16),
    ("mosaic", 33, 20, 24, 32),
    ("mosaic", 300, 96, 192, 128),
    ("mosaic", 130, 128, 256, 64),
]
EDGE_IDS = [
    "one token", "one sub-block per chunk, V below a tile", "odd widths", "3 K tiles, partial V tile",
    "one token", "odd widths", "3B head widths (widened to 128 and 256 lanes)", "whole lanes (no widening)",
]  # fmt: skip
EDGE_IDS = [f"{edge[0]}: {what}" for edge, what in zip(EDGES, EDGE_IDS, strict=True)]


@pytest.mark.parametrize("kernel, T, K, V, C", EDGES, ids=EDGE_IDS)
def test_pallas_edge_shapes_forward_and_gradients_equal_the_xla_kernel(kernel, T, K, V, C):
    """Shapes at the Pallas kernels' edges (empty loops, a single sub-block or level, padding
    inside a tile, head widths that are not whole 128-lane tiles) with an initial state and a
    strong decay: outputs, final state and all five gradients."""
    q, k, v, g, s0 = _inputs(T, "strong", B=1, H=2, K=K, V=V, seed=T)
    r = np.random.default_rng(T)
    w_o, w_s = r.standard_normal((1, T, 2, V)).astype(np.float32), r.standard_normal(s0.shape).astype(np.float32)

    def run(kernel):
        def loss(*a):
            o, s = _chunk(kernel)(*a[:4], initial_state=a[4], chunk_size=C)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

        return jax.grad(loss, argnums=range(5), has_aux=True)(q, k, v, g, s0)

    (grads, outs), (ref_grads, ref_outs) = run(kernel), run("chunk")
    names = ["o", "s", "q", "k", "v", "g", "s0"]
    for name, ours, ref in zip(names, [*outs, *grads], [*ref_outs, *ref_grads], strict=True):
        assert _rel(ours, np.asarray(ref, np.float64)) <= TOL, name


def test_bad_inputs_raise_clear_errors():
    q, k, v, g, s0 = _inputs(10, "weak")
    with pytest.raises(ValueError, match="rank 4"):
        chunk_gla(q[0], k, v, g)
    with pytest.raises(ValueError, match="share one shape"):
        chunk_gla(q, k[..., :8], v, g)
    with pytest.raises(ValueError, match="v must be"):
        recurrent_gla(q, k, v[:, :5], g)
    with pytest.raises(TypeError, match="floating"):
        chunk_gla(q.astype(np.int32), k, v, g)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gla(q, k, v, g, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gla(q, k, v, g, chunk_size=24)
    for impl in ("pallas", "mosaic"):
        for bad in (8, 48):  # 48: a multiple of 16, but Triton blocks and the levels take powers of two
            with pytest.raises(ValueError, match="power of two"):
                gla(q, k, v, g, impl=impl, chunk_size=bad)
    with pytest.raises(ValueError, match="GLA kernel must be one of chunk, pallas, mosaic, recurrent, auto"):
        gla(q, k, v, g, impl="triton")


@pytest.mark.parametrize("decay", ["weak", "strong"])
def test_the_packages_float64_reference_matches_torch_and_its_autograd(decay):
    """ops/gla/naive.py (NumPy, the benchmarks' reference) against tests/torch_gla.py (PyTorch):
    outputs, final state and all five gradients of its hand-written reverse-time recurrence."""
    from laplace_jax.ops.gla.naive import naive_gla, naive_gla_vjp

    q, k, v, g, s0 = _inputs(37, decay, seed=3)
    o, s = naive_gla(q, k, v, g, initial_state=s0)
    xs = [torch.from_numpy(np.asarray(x, np.float64)).requires_grad_() for x in (q, k, v, g, s0)]
    o_t, s_t = naive_recurrent_gla(*xs[:4], initial_state=xs[4])
    assert _rel(o, o_t.detach().numpy()) < 1e-13 and _rel(s, s_t.detach().numpy()) < 1e-13
    r = np.random.default_rng(0)
    do, dS = r.standard_normal(o.shape), r.standard_normal(s.shape)
    ((o_t * torch.from_numpy(do)).sum() + (s_t * torch.from_numpy(dS)).sum()).backward()
    for name, ours, x in zip(["q", "k", "v", "g", "s0"], naive_gla_vjp(q, k, v, g, s0, do, dS), xs, strict=True):
        assert _rel(ours, x.grad.numpy()) < 1e-13, name


def _lowered(fn, platform_name: str, *args) -> str:
    """StableHLO of ``fn``'s gradient lowered for ``platform_name`` from this CPU host, with locations."""
    grad = jax.grad(lambda *a: fn(*a)[0].astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
    return jax.jit(grad).trace(*args).lower(lowering_platforms=(platform_name,)).as_text(debug_info=True)


def test_the_kernel_follows_the_compile_target(every_platform):
    """ "auto" picks per compile target, not per the process's backend: lowered from this CPU host
    for a TPU it is the Mosaic kernel, for a GPU the Triton one, for the CPU the XLA kernel in the
    blocks layout; the XLA kernel's "auto" layout is the full-width one for a TPU (a systolic
    array). No context manager: what ``jax.jit(f).lower`` on TPU devices does."""
    from laplace_jax.ops.gla.dispatch import kernel_for

    q, k, v, g = (x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(_inputs(256, "weak")[:4]))
    auto = functools.partial(gla, impl="auto", chunk_size=128)
    kernels = {p: _lowered(auto, p, q, k, v, g) for p in ("tpu", "cuda", "cpu")}
    assert "gla_mosaic_fwd" in kernels["tpu"] and "gla_mosaic_bwd" in kernels["tpu"]
    assert "triton" not in kernels["tpu"] and "gla_scores" not in kernels["tpu"]
    assert "xla.gpu.triton" in kernels["cuda"] and "gla_mosaic" not in kernels["cuda"]
    assert (
        "gla_scores_blocks" in kernels["cpu"] and "gla_mosaic" not in kernels["cpu"] and "triton" not in kernels["cpu"]
    )
    layouts = {p: _lowered(chunk_gla, p, q, k, v, g) for p in ("tpu", "cpu")}
    assert "gla_scores_full" in layouts["tpu"] and "gla_scores_bwd_full" in layouts["tpu"]
    assert "gla_scores_blocks" not in layouts["tpu"] and "gla_scores_full" not in layouts["cpu"]
    # where the faster kernel does not take the chunk, auto says why and runs the XLA kernel
    kernel, why = kernel_for("auto", "tpu", 64)
    assert kernel == "chunk" and "multiple of 128; got 64" in why
    assert kernel_for("auto", "cuda", 48)[0] == "chunk" and kernel_for("auto", "neuron", 128)[0] == "chunk"
    assert "gla_mosaic" not in _lowered(functools.partial(gla, impl="auto", chunk_size=64), "tpu", q, k, v, g)
    with pytest.raises(ValueError, match="layout must be one of auto, full, blocks"):
        chunk_gla(*_inputs(16, "weak")[:4], layout="diagonal")


def test_a_platform_without_its_plugin_gets_no_branch_and_a_refusal_waits_for_lowering(monkeypatch):
    """``per_platform`` traces a branch only for platforms whose PJRT plugin this host has (libtpu
    for a TPU); explicit "mosaic" at a chunk the TPU compiler rejects runs interpreted for CPU and
    raises only when a program is lowered for TPU."""
    import importlib.util

    from laplace_jax import platform

    found = platform.lowerable_platforms()
    assert "cpu" in found and ("tpu" in found) == (importlib.util.find_spec("libtpu") is not None)
    q, k, v, g = _inputs(128, "weak")[:4]
    with_plugins = {p for p in ("tpu", "cuda") if p in found}
    eqns = str(jax.make_jaxpr(lambda *a: gla(*a, impl="auto", chunk_size=128))(q, k, v, g))
    assert ("pallas_call" in eqns) == bool(with_plugins)
    monkeypatch.setattr(platform, "lowerable_platforms", lambda: frozenset(("cpu", "tpu")))  # as with libtpu
    narrow = functools.partial(gla, impl="mosaic", chunk_size=64)
    assert "gla_scores" not in _lowered(narrow, "cpu", q, k, v, g)  # the Pallas interpreter, no XLA kernel
    with pytest.raises(ValueError, match=r"multiple of 128 \(got 64\).*model\.chunk_size=128"):
        _lowered(narrow, "tpu", q, k, v, g)


def test_a_neuron_host_traces_one_kernel_and_no_conditional(every_platform):
    """Neuron's compiler takes no ``lax.cond``: where only one platform will compile the program (a
    Neuron host; ``platform.only_for``), "auto" is that platform's kernel called directly, with no
    per-platform branch and no Pallas call left in the program."""
    from laplace_jax.platform import only_for

    q, k, v, g = _inputs(128, "weak")[:4]
    everywhere = {e.primitive.name for e in jax.make_jaxpr(lambda *a: gla(*a, impl="auto"))(q, k, v, g).jaxpr.eqns}
    with only_for("neuron"):  # a new function: traces are cached per function, not per context
        jaxpr = jax.make_jaxpr(lambda *a: gla(*a, impl="auto"))(q, k, v, g)
    assert "cond" in everywhere and not {"cond", "pallas_call"} & {e.primitive.name for e in jaxpr.jaxpr.eqns}


def _one_step_f64(q, k, v, g, s0, scale):
    """One token in float64 numpy, written out: S' = diag(e^g) S + k v^T, o = S'^T (scale q)."""
    q, k, v, g, s0 = (np.asarray(x, np.float64) for x in (q, k, v, g, s0))
    s = np.exp(g)[..., None] * s0 + k[..., :, None] * v[..., None, :]
    return np.einsum("bhk,bhkv->bhv", scale * q, s), s


@pytest.mark.parametrize("decay", SWEEP_DECAYS)
def test_the_mosaic_step_kernel_matches_float64_at_every_decay(decay):
    """The Mosaic decode-step kernel (interpreted) against a float64 step, -0.01 .. -16 nats/token
    and mixed, 128 rows (one lane tile) and K = 24 (three K blocks accumulate the output): within
    1e-6 of the output and state scales (fp32 rounding: measured <= 1.2e-7)."""
    from laplace_jax.ops.gla import mosaic_gla_step

    B, H, K, V = 128, 2, 24, 16
    q, k, v, _, s0 = _inputs(1, "weak", seed=11, B=B, H=H, K=K, V=V)
    r = np.random.default_rng(5)
    rates = np.asarray([d for d in SWEEP_DECAYS if d != "mixed"], np.float32)
    g = r.choice(rates, (B, H, K)) if decay == "mixed" else np.full((B, H, K), decay, np.float32)
    o, s = mosaic_gla_step(q[:, 0], k[:, 0], v[:, 0], g, s0, scale=K**-0.5, interpret=True)
    o_ref, s_ref = _one_step_f64(q[:, 0], k[:, 0], v[:, 0], g, s0, K**-0.5)
    assert o.shape == (B, H, V) and s.shape == (B, H, K, V) and s.dtype == jnp.float32
    assert _rel(o, o_ref) <= 1e-6 and _rel(s, s_ref) <= 1e-6


def test_the_mosaic_step_kernel_writes_each_head_group_into_its_own_columns():
    """V = 64: two heads make a 128-lane block of o (``heads_per_group``), so H = 6 is three groups
    whose accumulators are transposed into o's rows [B, H * V] one block each; against the float64
    step (mixed decays), within the sweep's 1e-6."""
    from laplace_jax.ops.gla import mosaic_gla_step
    from laplace_jax.ops.gla.mosaic_step import heads_per_group

    B, H, K, V = 128, 6, 16, 64
    assert heads_per_group(H, V) == 2 and heads_per_group(16, 192) == 2 and heads_per_group(2, 16) == 2
    q, k, v, _, s0 = _inputs(1, "weak", seed=13, B=B, H=H, K=K, V=V)
    rates = np.asarray([d for d in SWEEP_DECAYS if d != "mixed"], np.float32)
    g = np.random.default_rng(6).choice(rates, (B, H, K))
    o, s = mosaic_gla_step(q[:, 0], k[:, 0], v[:, 0], g, s0, scale=K**-0.5, interpret=True)
    o_ref, s_ref = _one_step_f64(q[:, 0], k[:, 0], v[:, 0], g, s0, K**-0.5)
    assert o.shape == (B, H, V) and _rel(o, o_ref) <= 1e-6 and _rel(s, s_ref) <= 1e-6


def test_the_mosaic_step_kernel_follows_the_torch_recurrence_and_keeps_padding_rows():
    """20 tokens through ``gla_decode(impl="mosaic")`` against the independent float64 torch
    recurrence (strong decays, bf16 q/k/v as decode runs them: 2e-2 like every bf16 bound); a row
    whose token is padding (k = v = 0, g = 0: how the layer masks one) keeps its state bit for bit."""
    from laplace_jax.ops.gla import gla_decode

    B, H, K, V = 256, 2, 16, 32
    q, k, v, g, s0 = _inputs(20, "strong", seed=12, B=B, H=H, K=K, V=V)
    f64 = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    rounded = [np.asarray(bf(x), np.float32) for x in (q, k, v)]
    o_t, s_t = naive_recurrent_gla(*(f64(x) for x in (*rounded, g)), initial_state=f64(s0))
    step = jax.jit(functools.partial(gla_decode, impl="mosaic", interpret=True))
    s, outs = jnp.asarray(s0), []
    for t in range(20):
        o, s = step(bf(q[:, t]), bf(k[:, t]), bf(v[:, t]), g[:, t], s)
        outs.append(o.astype(jnp.float32))
    assert _rel(np.stack(outs, 1), o_t.numpy()) <= 2e-2 and _rel(s, s_t.numpy()) <= 1e-5
    pad = np.arange(B) % 3 == 0
    zero = lambda x: np.where(pad.reshape(-1, *([1] * (x.ndim - 1))), 0, x)  # noqa: E731
    _, s1 = step(bf(q[:, 0]), bf(zero(k[:, 0])), bf(zero(v[:, 0])), zero(g[:, 0]), s)
    assert np.array_equal(np.asarray(s1)[pad], np.asarray(s)[pad])


def test_gla_decode_takes_the_mosaic_kernel_where_the_state_is_batch_minor(every_platform):
    """impl="mosaic": the kernel for 128 or 256 rows with V = 32, the XLA step for 3 rows (a batch
    that leaves most of each lane tile empty) or V = 128 (the TPU keeps such a state V-minor);
    "chunk": the XLA step. Same numbers either way. impl="auto": the kernel in a program compiled
    for TPU, the XLA step in one compiled for CPU."""
    from laplace_jax.ops.gla import gla_decode

    def uses_kernel(B, impl, V=32):
        q, k, v, g, s0 = _inputs(1, "weak", seed=B, B=B, H=2, K=16, V=V)
        fn = functools.partial(gla_decode, impl=impl, interpret=True)
        args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], s0)
        o, s = fn(*args)
        o_ref, s_ref = gla_step(*args)
        assert _rel(o, o_ref) <= 1e-6 and _rel(s, s_ref) <= 1e-6
        return "gla_mosaic_step" in str(jax.make_jaxpr(fn)(*args))

    assert uses_kernel(128, "mosaic") and uses_kernel(256, "mosaic")
    assert not uses_kernel(3, "mosaic") and not uses_kernel(128, "mosaic", V=128)
    assert not uses_kernel(128, "chunk")

    def lowered(B, platform_name, V=32):  # "auto" follows the compile target: the kernel only for a TPU
        q, k, v, g, s0 = _inputs(1, "weak", seed=B, B=B, H=2, K=16, V=V)
        traced = jax.jit(functools.partial(gla_decode, impl="auto")).trace(q[:, 0], k[:, 0], v[:, 0], g[:, 0], s0)
        return traced.lower(lowering_platforms=(platform_name,)).as_text(debug_info=True)

    assert "gla_mosaic_step" in lowered(128, "tpu") and "gla_step_xla" in lowered(128, "cpu")
    assert "gla_mosaic_step" not in lowered(128, "cpu") + lowered(128, "tpu", V=128)
