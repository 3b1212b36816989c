"""The few-row product as a Mosaic kernel (interpreted on CPU) against a float64 NumPy product,
its gradient against the XLA dot's, and where ``takes`` sends a product; its residual and gated
(SwiGLU) forms against float64 and against the unfused kernels they replace; several products of
the same rows in one call (``rows_projections``) against the plain kernel's, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.gla.limits import GATED, PLAIN, RESIDUAL, matmul_form
from laplace_jax.ops.matmul import (
    gated_reference,
    gated_rows_matmul,
    projections_take,
    reference,
    residual_reference,
    residual_rows_matmul,
    rows_matmul,
    rows_projections,
    takes,
)
from laplace_jax.ops.matmul.mosaic import MAX_ROWS, column_block, projection_steps
from laplace_jax.ops.swiglu import mosaic_swiglu


def _inputs(M, I, O, dtype, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal(s), dtype) for s in ((M, I), (I, O)))


@pytest.mark.parametrize("M, I, O", [(1, 256, 384), (8, 128, 1024), (256, 512, 640)])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_the_kernel_is_the_float64_product(M, I, O, out):
    """bf16 operands (their products are exact in fp32): the fp32 result within I fp32 roundings
    of each entry's absolute sum (2^-24 I sum|x_i w_i|; measured far below), the bf16 one within
    one bf16 rounding more (2^-8 |y|); the same as the XLA dot's."""
    x, w = _inputs(M, I, O, jnp.bfloat16, seed=M)
    got = np.asarray(jax.jit(lambda a, b: rows_matmul(a, b, out, True))(x, w), np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
    bound = 2.0**-24 * I * scale + (2.0**-8 * np.abs(want) if out == "bfloat16" else 0.0)
    assert got.shape == (M, O) and got.dtype == np.float64
    assert np.all(np.abs(got - want) <= bound)
    if out == "float32":
        np.testing.assert_allclose(got, np.asarray(reference(x, w, jnp.float32), np.float64), rtol=0, atol=1e-5)


def test_the_gradient_is_the_xla_dots():
    """fp32: the custom VJP's dx and dw against jax.grad of the XLA dot, within 1e-6 of scale."""
    x, w = _inputs(16, 256, 384, jnp.float32, seed=3)
    ct = jnp.asarray(np.random.default_rng(4).standard_normal((16, 384)), jnp.float32)
    ours = jax.grad(lambda a, b: jnp.sum(rows_matmul(a, b, jnp.float32, True) * ct), argnums=(0, 1))(x, w)
    xla = jax.grad(lambda a, b: jnp.sum(reference(a, b, jnp.float32) * ct), argnums=(0, 1))(x, w)
    for a, b in zip(ours, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_takes_few_rows_of_whole_lane_tiles_in_one_dtype():
    bf16 = jnp.bfloat16
    assert takes(1, 3072, 8192, bf16, bf16) and takes(MAX_ROWS, 8192, 3072, bf16, bf16)
    assert not takes(MAX_ROWS + 1, 3072, 8192, bf16, bf16)  # the XLA dot keeps both cores busy
    assert not takes(256, 3072, 16, bf16, bf16)  # gk's low-rank product: not a lane tile
    assert not takes(256, 16, 1536, bf16, bf16)
    assert not takes(256, 3072, 8192, jnp.float32, bf16)


@pytest.mark.parametrize(
    "M, I, O, block",
    [
        (512, 3072, 8192, 512),
        (256, 3072, 8192, 256),
        (512, 8192, 3072, 256),
        (512, 3072, 1536, 256),
        (256, 3072, 50304, 128),
        (512, 3072, 1024, 512),
    ],
)
def test_column_blocks_divide_the_weight_and_split_evenly_over_two_cores(M, I, O, block):
    """1536 columns at 512 rows: 256-wide blocks (six: three per core) where 512 would give three."""
    assert column_block(M, I, O) == block and O % block == 0


def _silu64(z):
    return z / (1.0 + np.exp(-z))


@pytest.mark.parametrize("M, I, O", [(8, 128, 1024), (256, 512, 640)])
def test_the_residual_form_is_the_float64_sum_and_the_unfused_kernel_plus_add(M, I, O):
    """bf16: r + x w within the product's bound plus two bf16 roundings (of the product, then of
    the sum: 2^-8 (|x w| + |x w + r|)), and equal, bit for bit, to the plain kernel's bf16 product
    plus r as XLA adds two bf16 arrays (what the decode step ran before this form)."""
    x, w = _inputs(M, I, O, jnp.bfloat16, seed=M + 1)
    r = jnp.asarray(np.random.default_rng(M).standard_normal((M, O)), jnp.bfloat16)
    got = jax.jit(lambda a, b, c: residual_rows_matmul(a, b, c, True))(x, w, r)
    assert got.dtype == jnp.bfloat16 and got.shape == (M, O)
    unfused = jax.jit(lambda a, b, c: c + rows_matmul(a, b, jnp.bfloat16, True))(x, w, r)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(unfused, np.float32))
    x64, w64, r64 = (np.asarray(a, np.float64) for a in (x, w, r))
    product, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
    want = product + r64
    bound = 2.0**-24 * I * scale + 2.0**-8 * (np.abs(product) + np.abs(want)) * 1.01
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


@pytest.mark.parametrize("M, I, O", [(8, 128, 1024), (256, 512, 640)])
def test_the_gated_form_is_the_float64_swiglu_and_the_unfused_kernels(M, I, O):
    """bf16: silu(x wg) (x wu) within the products' bounds, their bf16 roundings carried through
    the gate (|silu'| < 1.1) and one bf16 rounding of the result; and equal, bit for bit, to the
    plain kernel's two bf16 products fed to SwiGLU's Mosaic kernel (the decode step before)."""
    x, wg = _inputs(M, I, O, jnp.bfloat16, seed=M + 2)
    wu = jnp.asarray(np.random.default_rng(M + 3).standard_normal((I, O)), jnp.bfloat16)
    got = jax.jit(lambda a, b, c: gated_rows_matmul(a, b, c, True))(x, wg, wu)
    assert got.dtype == jnp.bfloat16 and got.shape == (M, O)
    product = lambda a, b: rows_matmul(a, b, jnp.bfloat16, True)  # noqa: E731
    unfused = jax.jit(lambda a, b, c: mosaic_swiglu(product(a, b), product(a, c), True))(x, wg, wu)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(unfused, np.float32))
    x64, g64, u64 = (np.asarray(a, np.float64) for a in (x, wg, wu))
    gate, up = x64 @ g64, x64 @ u64
    want = _silu64(gate) * up
    err_gate = 2.0**-24 * I * (np.abs(x64) @ np.abs(g64)) + 2.0**-8 * np.abs(gate)
    err_up = 2.0**-24 * I * (np.abs(x64) @ np.abs(u64)) + 2.0**-8 * np.abs(up)
    bound = 1.1 * err_gate * (np.abs(up) + err_up) + np.abs(_silu64(gate)) * err_up + 2.0**-8 * np.abs(want) * 1.01
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


def test_the_fused_forms_gradients_are_their_references():
    """fp32: the residual and gated forms' custom VJPs against jax.grad of the XLA ops they fuse."""
    x, w = _inputs(16, 256, 384, jnp.float32, seed=5)
    r = jnp.asarray(np.random.default_rng(6).standard_normal((16, 384)), jnp.float32)
    u = jnp.asarray(np.random.default_rng(7).standard_normal((256, 384)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((16, 384)), jnp.float32)
    pairs = [
        (lambda a, b, c: residual_rows_matmul(a, b, c, True), residual_reference, (x, w, r)),
        (lambda a, b, c: gated_rows_matmul(a, b, c, True), gated_reference, (x, w, u)),
    ]
    for kernel, ref, args in pairs:
        ours = jax.grad(lambda *a, f=kernel: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(*args)
        xla = jax.grad(lambda *a, f=ref: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(*args)
        for a, b in zip(ours, xla, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_a_compiled_call_names_its_form_by_its_operands():
    """``tpu`` reads a call's form from its operands' shapes: x [M, I], w [I, O], then r [M, O] or u [I, O]."""
    assert matmul_form([(256, 3072), (3072, 8192)]) == PLAIN
    assert matmul_form([(256, 8192), (8192, 3072), (256, 3072)]) == RESIDUAL
    assert matmul_form([(256, 3072), (3072, 8192), (3072, 8192)]) == GATED


@pytest.mark.parametrize("M, I, widths", [(8, 128, (256, 256, 512, 512)), (256, 384, (512, 256)), (1, 256, (256, 768))])
def test_projections_are_the_plain_kernels_products_bit_for_bit(M, I, widths):
    """bf16: each output of the one call equals the plain kernel's bf16 product with that weight,
    bit for bit (the same fp32 product of a column block, rounded once), so within one bf16
    rounding plus I fp32 roundings of the float64 product; and the gradient is the XLA dots'."""
    r = np.random.default_rng(M + I)
    x = jnp.asarray(r.standard_normal((M, I)), jnp.bfloat16)
    ws = tuple(jnp.asarray(r.standard_normal((I, o)), jnp.bfloat16) for o in widths)
    got = jax.jit(lambda a, b: rows_projections(a, b, True))(x, ws)
    assert [y.shape for y in got] == [(M, o) for o in widths] and all(y.dtype == jnp.bfloat16 for y in got)
    x64 = np.asarray(x, np.float64)
    for y, w in zip(got, ws, strict=True):
        plain = jax.jit(lambda a, b: rows_matmul(a, b, jnp.bfloat16, True))(x, w)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(plain, np.float32))
        w64 = np.asarray(w, np.float64)
        want = x64 @ w64
        bound = 2.0**-24 * I * (np.abs(x64) @ np.abs(w64)) + 2.0**-8 * np.abs(want) * 1.01
        assert np.all(np.abs(np.asarray(y, np.float64) - want) <= bound)
    x32, w32 = x.astype(jnp.float32), tuple(w.astype(jnp.float32) for w in ws)
    cts = tuple(jnp.asarray(r.standard_normal((M, o)), jnp.float32) for o in widths)
    loss = lambda f: lambda a, b: sum(jnp.sum(y * c) for y, c in zip(f(a, b), cts, strict=True))  # noqa: E731
    ours = jax.grad(loss(lambda a, b: rows_projections(a, b, True)), argnums=(0, 1))(x32, w32)
    xla = jax.grad(loss(lambda a, b: [reference(a, w, a.dtype) for w in b]), argnums=(0, 1))(x32, w32)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(xla), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_projections_split_every_weight_evenly_or_not_at_all():
    """Grid steps: every weight's columns in whole lane tiles per step, an even count (two cores)."""
    assert projection_steps((1536, 1536, 3072, 3072)) == 12  # the 3B's q, k, v, g
    assert projection_steps((256, 256, 512, 512)) == 2
    assert projection_steps((384, 768)) == 0  # three steps: not even
    assert projection_steps((128, 256)) == 0  # one step: no split
    bf16 = jnp.bfloat16
    assert projections_take(256, 3072, (1536, 1536, 3072, 3072), bf16, bf16)
    assert not projections_take(256, 3072, (1536,), bf16, bf16)  # one weight: the plain kernel
    assert not projections_take(MAX_ROWS + 1, 3072, (1536, 3072), bf16, bf16)
    assert not projections_take(256, 3072, (1536, 16), bf16, bf16)
