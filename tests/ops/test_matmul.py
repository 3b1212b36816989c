"""The few-row product as a Mosaic kernel (interpreted on CPU) against a float64 NumPy product,
its gradient against the XLA dot's, and where ``takes`` sends a product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.matmul import reference, rows_matmul, takes
from laplace_jax.ops.matmul.mosaic import MAX_ROWS, column_block


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


@pytest.mark.parametrize("I, O, block", [(3072, 8192, 512), (8192, 3072, 256), (3072, 1536, 256), (3072, 50304, 128)])
def test_column_blocks_divide_the_weight_and_split_evenly_over_two_cores(I, O, block):
    """1536 columns: 256-wide blocks (six: three per core) where 512 would give three."""
    assert column_block(I, O) == block and O % block == 0
