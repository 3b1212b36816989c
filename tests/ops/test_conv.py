"""The short convolution's decode step: the XLA form and the Mosaic kernel (interpreted on CPU)
against a float64 NumPy step written out here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.ops.conv import conv_step, mosaic_conv_step, short_conv_step


def _inputs(B, D, W, dtype=np.float32, seed=0):
    r = np.random.default_rng(seed)
    x, cache, kernel = (r.standard_normal(s).astype(dtype) for s in ((B, D), (B, W * D), (W, D)))
    return x, cache, kernel


def _step_f64(x, cache, kernel, lengths=None):
    """y = silu(sum_w window_w * kernel_w) over the window [cache taps 1 .. W-1, x]; the cache
    shifts by one input, except on rows whose length is 0, where y is 0."""
    x, cache, kernel = (np.asarray(a, np.float64) for a in (x, cache, kernel))
    B, D = x.shape
    window = np.concatenate([cache.reshape(B, -1, D)[:, 1:], x[:, None]], axis=1)  # [B, W, D]
    y = np.einsum("bwd,wd->bd", window, kernel)
    new, y = window.reshape(B, -1), y / (1 + np.exp(-y))
    if lengths is not None:
        live = np.asarray(lengths)[:, None] > 0
        new, y = np.where(live, new, cache), np.where(live, y, 0.0)
    return y, new


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("step", ["xla", "mosaic"])
@pytest.mark.parametrize("W", [1, 3, 4])
def test_the_conv_step_matches_float64(step, W):
    """fp32, 256 rows, 384 channels: y within 1e-6 of its scale (measured <= 1.4e-7), the cache
    exact (it only moves)."""
    x, cache, kernel = _inputs(256, 384, W, seed=W)
    fn = conv_step if step == "xla" else lambda *a: mosaic_conv_step(*a, interpret=True)
    y, new = fn(x, cache, kernel)
    y_ref, new_ref = _step_f64(x, cache, kernel)
    assert y.shape == (256, 384) and new.shape == cache.shape
    assert _rel(y, y_ref) <= 1e-6
    assert np.array_equal(np.asarray(new), new_ref.astype(np.float32))


@pytest.mark.parametrize("W", [1, 4])
def test_the_mosaic_conv_step_keeps_padding_rows_and_agrees_in_bf16(W):
    """bf16 as decode runs it, a third of the rows padding (length 0): the cache equals the XLA
    step's bit for bit (padding rows unchanged), y is 0 on padding rows in both (a GLA layer's k
    and v: nothing enters the state); y within bf16 rounding of the float64 step (the
    kernel sums in fp32 and rounds once, the XLA form rounds each product; measured 3.3e-3 and
    4.9e-3 of y's scale, bound 2e-2 as every bf16 bound here)."""
    x, cache, kernel = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(128, 256, W, seed=7))
    lengths = jnp.asarray(np.arange(128) % 3 != 0, jnp.int32)
    y, new = jax.jit(lambda *a: mosaic_conv_step(*a, interpret=True))(x, cache, kernel, lengths)
    y_xla, new_xla = conv_step(x, cache, kernel, lengths)
    y_ref, new_ref = _step_f64(x, cache, kernel, lengths)
    assert np.array_equal(np.asarray(new), np.asarray(new_xla))
    assert np.array_equal(np.asarray(new, np.float64), new_ref)
    pad = np.asarray(lengths) == 0
    assert np.array_equal(np.asarray(new)[pad], np.asarray(cache)[pad])
    assert not np.any(np.asarray(y, np.float32)[pad]) and not np.any(np.asarray(y_xla, np.float32)[pad])
    assert np.all(np.any(np.asarray(y, np.float32)[~pad] != 0, axis=-1))  # live rows: real outputs
    assert y.dtype == jnp.bfloat16 and _rel(y, y_ref) <= 2e-2 and _rel(y_xla, y_ref) <= 2e-2


def test_the_two_core_row_blocks_give_the_same_numbers():
    """256 rows in blocks of 128 (a two-core chip's, ``two_cores``) or one block of 256, bf16 with
    a third of the rows padding: y and the cache equal bit for bit, and the cache equals the XLA
    step's (each row's arithmetic is the same; only the grid's row blocks differ)."""
    x, cache, kernel = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(256, 256, 4, seed=11))
    lengths = jnp.asarray(np.arange(256) % 3 != 0, jnp.int32)
    got = {
        two: jax.jit(lambda *a, two=two: mosaic_conv_step(*a, interpret=True, two_cores=two))(x, cache, kernel, lengths)
        for two in (False, True)
    }
    for a, b in zip(got[False], got[True], strict=True):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert np.array_equal(np.asarray(got[True][1]), np.asarray(conv_step(x, cache, kernel, lengths)[1]))


def test_short_conv_step_takes_the_kernel_for_whole_tiles_only(every_platform):
    """impl="mosaic": the kernel for 128 rows x 128 channels; 3 rows or 96 channels (not whole
    lane tiles) and "chunk" take the XLA step; the same cache either way. impl="auto": the kernel
    in a program compiled for TPU, the XLA step in one compiled for CPU."""

    def uses_kernel(B, D, impl):
        x, cache, kernel = _inputs(B, D, 4, seed=B + D)
        fn = lambda *a: short_conv_step(*a, impl=impl)  # noqa: E731
        _, new = fn(x, cache, kernel)
        assert np.array_equal(np.asarray(new), np.asarray(conv_step(x, cache, kernel)[1]))
        return "short_conv_mosaic_step" in str(jax.make_jaxpr(fn)(x, cache, kernel))

    assert uses_kernel(128, 128, "mosaic") and uses_kernel(256, 384, "mosaic")
    assert not uses_kernel(3, 128, "mosaic") and not uses_kernel(128, 96, "mosaic")
    assert not uses_kernel(128, 128, "chunk")

    def lowered(B, D, platform_name):  # "auto" follows the compile target: the kernel only for a TPU
        x, cache, kernel = _inputs(B, D, 4)
        fn = jax.jit(lambda *a: short_conv_step(*a, impl="auto")).trace(x, cache, kernel)
        return fn.lower(lowering_platforms=(platform_name,)).as_text(debug_info=True)

    assert "short_conv_mosaic_step" in lowered(128, 128, "tpu") and "short_conv_step_xla" in lowered(128, 128, "cpu")
    assert "short_conv_mosaic_step" not in lowered(128, 128, "cpu") + lowered(128, 96, "tpu")
