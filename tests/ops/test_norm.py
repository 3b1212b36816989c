"""RMSNorm (plain and gated) as Mosaic kernels, interpreted on CPU: forward and gradients against
a float64 NumPy norm, and the row blocks ``takes`` and ``row_block`` choose."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.norm import mosaic_residual_rms_norm, mosaic_rms_norm, rms_norm, takes
from laplace_jax.ops.norm.mosaic import BLOCK_ELEMENTS, row_block

EPS = 1e-6


def _norm64(x, g, z):
    """The norm in float64, each run of len(g) features on its own: x / rms(x) * g (* z sigmoid(z))."""
    heads = x.reshape(*x.shape[:-1], -1, g.shape[-1])
    y = (heads / np.sqrt(np.mean(heads * heads, axis=-1, keepdims=True) + EPS) * g).reshape(x.shape)
    return y if z is None else y * z / (1 + np.exp(-z))


def _inputs(N, D, gated, seed=0, groups=1):
    r = np.random.default_rng(seed)
    scale = np.exp(r.uniform(-3, 3, (N, groups, 1)))  # rows and heads of very different sizes
    x = jnp.asarray((r.standard_normal((N, groups, D // groups)) * scale).reshape(N, D), jnp.float32)
    g = jnp.asarray(1 + 0.5 * r.standard_normal(D // groups), jnp.float32)
    z = jnp.asarray(3 * r.standard_normal((N, D)), jnp.float32) if gated else None
    return x, g, z


def _f64(*arrays):
    return [None if a is None else np.asarray(a, np.float64) for a in arrays]


@pytest.mark.parametrize("N, D, groups", [(1, 256, 1), (256, 384, 1), (24, 192, 1), (1024, 128, 1), (40, 768, 4)])
@pytest.mark.parametrize("gated", [False, True])
def test_the_kernel_is_the_float64_norm(N, D, groups, gated):
    """fp32 in and out: within 1e-6 relative of each head's largest output (a few fp32
    roundings: the mean, the rsqrt, three products); bf16 out: one bf16 rounding more (2^-8
    |y|). Four heads of 192 (GLA's gated norm at the 3B head width): each normalised alone."""
    x, g, z = _inputs(N, D, gated, seed=N + D, groups=groups)
    want = _norm64(*_f64(x, g, z))
    heads = np.abs(want).reshape(N, groups, -1)
    row_max = np.repeat(np.max(heads, axis=-1, keepdims=True), D // groups, axis=-1).reshape(N, D)
    got = np.asarray(jax.jit(lambda *a: mosaic_rms_norm(a[0], a[1], EPS, jnp.float32, a[2], True))(x, g, z))
    assert got.shape == (N, D)
    assert np.all(np.abs(got - want) <= 1e-6 * row_max)
    got16 = np.asarray(mosaic_rms_norm(x, g, EPS, jnp.bfloat16, z, True), np.float64)
    assert np.all(np.abs(got16 - want) <= 2.0**-8 * np.abs(want) + 1e-6 * row_max)


@pytest.mark.parametrize("gated, groups", [(False, 1), (True, 1), (True, 2)])
def test_the_gradients_are_the_float64_norms(gated, groups):
    """dx, dgain (and dgate) of sum(norm * ct) against the float64 gradient of the plain norm, by
    jax.grad in float64 (x64 enabled for it). Within 1e-5 of each gradient's largest entry (fp32
    sums over 192 features and 48 rows; two heads of 192 share one gain)."""
    D = 192 * groups
    x, g, z = _inputs(48, D, gated, seed=7, groups=groups)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((48, D)), jnp.float32)
    args = (x, g) if z is None else (x, g, z)

    def ours(*a):
        return jnp.sum(mosaic_rms_norm(a[0], a[1], EPS, jnp.float32, a[2] if gated else None, True) * ct)

    got = jax.grad(ours, argnums=tuple(range(len(args))))(*args)
    with jax.enable_x64():
        a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
        ct64 = jnp.asarray(np.asarray(ct), jnp.float64)

        def exact(*a):
            return jnp.sum(rms_norm(a[0], a[1], EPS, jnp.float64, a[2] if gated else None) * ct64)

        want = [np.asarray(w) for w in jax.grad(exact, argnums=tuple(range(len(args))))(*a64)]
    for name, a, b in zip(["x", "gain", "gate"], got, want, strict=False):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=1e-5 * np.max(np.abs(b)), err_msg=name)


def test_the_naive_norm_is_fla_rmsnorm_in_torch():
    """The reference itself: the plain norm against torch's RMSNorm (fp32), and the gated one
    against rmsnorm(x) * w * silu(z) written in torch."""
    torch = pytest.importorskip("torch")
    x, g, z = _inputs(16, 256, True, seed=3)
    tx, tg, tz = (torch.tensor(np.asarray(a)) for a in (x, g, z))
    plain = torch.nn.functional.rms_norm(tx, (256,), tg, EPS)
    np.testing.assert_allclose(rms_norm(x, g, EPS, jnp.float32), plain.numpy(), rtol=2e-6, atol=2e-6)
    gated = plain * torch.nn.functional.silu(tz)
    np.testing.assert_allclose(rms_norm(x, g, EPS, jnp.float32, z), gated.numpy(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    "rows, features, block",
    [(256, 3072, 128), (32768, 3072, 128), (4096, 192, 512), (1, 3072, 1), (12, 3072, 12), (24, 64, 8)],
)
def test_row_blocks_divide_the_rows_and_split_evenly_over_two_cores(rows, features, block):
    """256 decode rows: two blocks of 128 (one per core), not one of 256; a lone row or a few
    rows that no block divides: one block of them all."""
    assert row_block(rows, features) == block and takes(rows, features)
    assert block * features <= BLOCK_ELEMENTS or block == rows


def test_takes_no_rows_that_neither_divide_nor_fit_one_block():
    assert not takes(1001, 3072) and not takes(0, 3072)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_residual_norm_is_the_add_then_the_float64_norm(dtype):
    """(x + h, norm(x + h)) from one kernel: r is the sum rounded once to x's dtype (what x + h
    gives), y the float64 norm of that r within the plain kernel's bounds."""
    x, g, _ = _inputs(64, 384, False, seed=11)
    h, _, _ = _inputs(64, 384, False, seed=12)
    x, h = x.astype(dtype), h.astype(dtype)
    r, y = jax.jit(lambda *a: mosaic_residual_rms_norm(*a, EPS, jnp.float32, interpret=True))(x, h, g)
    np.testing.assert_array_equal(np.asarray(r, np.float64), np.asarray(x + h, np.float64))
    want = _norm64(*_f64(r, g, None))
    assert np.all(np.abs(np.asarray(y, np.float64) - want) <= 1e-6 * np.max(np.abs(want), axis=-1, keepdims=True))


def test_the_residual_norms_gradients_are_the_float64_ones():
    """sum(r * ct_r) + sum(y * ct_y): dx = dh (the add's two inputs) and dgain against jax.grad of
    the add and the plain norm in float64, within 1e-5 of each gradient's largest entry."""
    x, g, _ = _inputs(48, 256, False, seed=13)
    h, _, _ = _inputs(48, 256, False, seed=14)
    r = np.random.default_rng(15)
    ct_r, ct_y = (jnp.asarray(r.standard_normal((48, 256)), jnp.float32) for _ in range(2))

    def ours(x, h, g):
        r, y = mosaic_residual_rms_norm(x, h, g, EPS, jnp.float32, interpret=True)
        return jnp.sum(r * ct_r) + jnp.sum(y * ct_y)

    got = jax.grad(ours, argnums=(0, 1, 2))(x, h, g)
    with jax.enable_x64():
        a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (x, h, g, ct_r, ct_y)]

        def exact(x, h, g):
            return jnp.sum((x + h) * a64[3]) + jnp.sum(rms_norm(x + h, g, EPS, jnp.float64) * a64[4])

        want = [np.asarray(w) for w in jax.grad(exact, argnums=(0, 1, 2))(*a64[:3])]
    for name, a, b in zip(["x", "h", "gain"], got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=1e-5 * np.max(np.abs(b)), err_msg=name)


@pytest.mark.parametrize("gated", [False, True])
def test_a_bf16_gain_is_read_as_stored_and_gives_the_f32_gains_norm(gated):
    """Serving's bf16 weights reach the kernels as bf16 gains (converted in VMEM, no convert op):
    bit for bit the norm of the same gain widened to fp32 outside, plain, gated and after a
    residual add."""
    x, g, z = _inputs(256, 384, gated, seed=9, groups=2)
    g16 = g.astype(jnp.bfloat16)
    ours = mosaic_rms_norm(x, g16, EPS, jnp.bfloat16, z, True)
    wide = mosaic_rms_norm(x, g16.astype(jnp.float32), EPS, jnp.bfloat16, z, True)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(wide, np.float32))
    g16 = jnp.concatenate([g16, g16])  # the residual norm's gain is as wide as x
    r, y = mosaic_residual_rms_norm(x, x, g16, EPS, jnp.bfloat16, interpret=True)
    r32, y32 = mosaic_residual_rms_norm(x, x, g16.astype(jnp.float32), EPS, jnp.bfloat16, interpret=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y32, np.float32))
    np.testing.assert_array_equal(np.asarray(r), np.asarray(r32))
