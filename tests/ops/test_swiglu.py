"""SwiGLU's gate as Mosaic kernels, interpreted on CPU: forward and gradients against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.swiglu import mosaic_swiglu, swiglu, takes


def _inputs(N, F, dtype, seed=0):
    r = np.random.default_rng(seed)
    gate = r.standard_normal((N, F)) * 4  # well into both tails of the sigmoid
    up = r.standard_normal((N, F))
    return jnp.asarray(gate, dtype), jnp.asarray(up, dtype)


@pytest.mark.parametrize("N, F", [(1, 256), (256, 384), (24, 8192)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_is_the_float64_product(N, F, dtype):
    """fp32: within 4 fp32 roundings of |y| (exp, reciprocal, two products); bf16 operands: one
    bf16 rounding of the result (the kernel computes in fp32 and rounds once)."""
    gate, up = _inputs(N, F, dtype, seed=N)
    g64 = np.asarray(gate, np.float64)
    want = g64 / (1 + np.exp(-g64)) * np.asarray(up, np.float64)
    got = np.asarray(jax.jit(lambda a, b: mosaic_swiglu(a, b, True))(gate, up), np.float64)
    assert got.shape == (N, F)
    rel = 2.0**-8 if dtype == "bfloat16" else 4 * 2.0**-24
    assert np.all(np.abs(got - want) <= rel * np.abs(want) + 1e-30)


def test_the_gradients_are_the_float64_ones():
    """fp32: dgate and dup of sum(y * ct) against jax.grad of the plain product in float64, within
    1e-6 of each gradient's largest entry."""
    gate, up = _inputs(48, 256, jnp.float32, seed=5)
    ct = jnp.asarray(np.random.default_rng(6).standard_normal((48, 256)), jnp.float32)
    got = jax.grad(lambda a, b: jnp.sum(mosaic_swiglu(a, b, True) * ct), argnums=(0, 1))(gate, up)
    with jax.enable_x64():
        a64, b64, c64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (gate, up, ct))
        want = jax.grad(lambda a, b: jnp.sum(swiglu(a, b) * c64), argnums=(0, 1))(a64, b64)
    for name, a, b in zip(["gate", "up"], got, want, strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=1e-6 * np.max(np.abs(b)), err_msg=name)


def test_the_naive_gate_is_torchs_silu_times_up():
    torch = pytest.importorskip("torch")
    gate, up = _inputs(16, 256, jnp.float32, seed=2)
    want = torch.nn.functional.silu(torch.tensor(np.asarray(gate))) * torch.tensor(np.asarray(up))
    np.testing.assert_allclose(swiglu(gate, up), want.numpy(), rtol=1e-6, atol=1e-7)


def test_takes_rows_that_split_into_blocks():
    assert takes(32768, 8192) and takes(256, 8192) and takes(1, 8192)
    assert not takes(1001, 8192)
