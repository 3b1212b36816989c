"""The short convolution's decode step as a Pallas TPU (Mosaic) kernel.

Same contract as ``conv_step`` (``step.py``, its reference), with y returned batch-minor. Each
step of the XLA form costs three ops on the TPU compiler at the 3B config and 256 rows: the
shift of the cache (a concatenate the compiler lowers as pad + max, 16.1 us for v's 6.3 MB),
the taps' sum and a relayout of y into the batch-minor layout the GLA step reads (5.1 us). This
kernel moves the same bytes once: the grid walks the W taps of one block of rows, step s reading
tap s + 1 and writing it to tap s of the cache (in place: the call aliases it), the last step
writing x; the taps' products add up in an fp32 VMEM block, and y = silu(sum) leaves transposed,
[D, B], which is the layout ``mosaic_gla_step`` reads without a copy.

``takes(B, D)``: 128-row tiles (y's lanes) and D a multiple of 128 (a tap is a lane-aligned
slice of the flat cache); anything else takes the XLA step. ``two_cores`` (a chip with two
TensorCores, v4 and v5p: the layer says so from its compile target): blocks of 128 rows, so the
"parallel" row axis has a block for each core at 256 rows; the one-core chips keep the GLA step's
row blocks, whose fewer grid steps schedule faster there (the compiler's static schedule of the
3B's v conv step at 256 rows, 4 taps and the row mask: v5p 16,416 -> 9,875 cycles, v5e 24,525 ->
26,792, v6e 15,873 -> 18,321). ``lengths``: a padding row
(length 0) keeps its cache, which costs the kernel one more read, of the tap the step drops, and
gives y = 0 (in the kernel's last step: no select op after it in the layer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.conv.step import conv_step
from laplace_jax.ops.gla.limits import MOSAIC_CONV_KERNEL
from laplace_jax.ops.gla.mosaic import mosaic_step_for
from laplace_jax.ops.gla.mosaic_step import LANES, row_block, whole_lane_tiles

Array = jax.Array
f32 = jnp.float32


def takes(batch: int, channels: int) -> bool:
    """Whether the Mosaic conv step runs this batch and channel count."""
    return whole_lane_tiles(batch) and channels % LANES == 0


def _kernel(*refs, width: int, first: int):
    """Grid step s reads cache tap t = s + first (x once t reaches W) and writes tap t - 1."""
    masked = first == 0
    if masked:
        live_ref, x_ref, tap_ref, kernel_ref, y_ref, out_ref, acc_ref, k_ref, prev_ref = refs
    else:
        x_ref, tap_ref, kernel_ref, y_ref, out_ref, acc_ref, k_ref = refs
    t = pl.program_id(1) + first

    def write(new):  # a padding row keeps the tap it had (the one read a step earlier)
        out_ref[...] = jnp.where(live_ref[...] > 0, new, prev_ref[...]) if masked else new
        if masked:
            prev_ref[...] = tap_ref[...]

    @pl.when(t == first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        k_ref[...] = kernel_ref[...].astype(f32)  # the taps' weights as stored (bf16 serving weights: no convert op)
        if masked:  # tap 0: only a padding row keeps it
            prev_ref[...] = tap_ref[...]

    @pl.when(jnp.logical_and(t >= 1, t < width))
    def _():
        tap = tap_ref[...]
        acc_ref[...] += tap.astype(f32) * k_ref[pl.ds(t - 1, 1), :]
        write(tap)

    @pl.when(t == width)
    def _():
        x = x_ref[...]
        y = acc_ref[...] + x.astype(f32) * k_ref[width - 1 :, :]
        y = y * jax.nn.sigmoid(y)
        if masked:
            y = jnp.where(live_ref[...] > 0, y, 0.0)
        y_ref[...] = jnp.transpose(y).astype(y_ref.dtype)
        write(x)


def block_rows(batch: int, two_cores: bool) -> int:
    """Rows per grid step (the lanes of y): one lane tile on a two-core chip (for a batch of whole
    tiles), else ``row_block``."""
    return LANES if two_cores and batch % LANES == 0 else row_block(batch)


def _call(
    x: Array, cache: Array, kernel: Array, live: Array | None, interpret: bool, two_cores: bool = False
) -> tuple[Array, Array]:
    """x [B, D], cache [B, W * D], kernel [W, D], live [B, 1] int32 or None -> (y [D, B], cache').
    Unmasked, the grid skips tap 0 (the step drops it); masked, it reads it for the padding rows."""
    B, D = x.shape
    W = kernel.shape[0]
    rows = block_rows(B, two_cores)
    first = 0 if live is not None else 1
    block = lambda index: pl.BlockSpec((rows, D), index)  # noqa: E731
    specs = [block(lambda b, s: (b, 0)), block(lambda b, s: (b, jnp.minimum(s + first, W - 1)))]  # x, tap
    args, scratch = [x, cache], [pltpu.VMEM((rows, D), f32), pltpu.VMEM((W, D), f32)]
    if live is not None:  # the row mask first; the tap read a step earlier kept for padding rows
        specs, args = [pl.BlockSpec((rows, 1), lambda b, s: (b, 0)), *specs], [live, *args]
        scratch.append(pltpu.VMEM((rows, D), cache.dtype))
    return pl.pallas_call(
        functools.partial(_kernel, width=W, first=first),
        grid=(B // rows, W + 1 - first),
        in_specs=[*specs, pl.BlockSpec((W, D), lambda b, s: (0, 0))],
        out_specs=[
            pl.BlockSpec((D, rows), lambda b, s: (0, b)),
            block(lambda b, s: (b, jnp.maximum(s + first - 1, 0))),
        ],
        out_shape=[jax.ShapeDtypeStruct((D, B), x.dtype), jax.ShapeDtypeStruct(cache.shape, cache.dtype)],
        scratch_shapes=scratch,
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=MOSAIC_CONV_KERNEL,
    )(*args, kernel)


def mosaic_conv_step(
    x: Array,
    cache: Array,
    kernel: Array,
    lengths: Array | None = None,
    *,
    interpret: bool = False,
    two_cores: bool = False,
) -> tuple[Array, Array]:
    """``conv_step`` as the Mosaic kernel: x [B, D], cache [B, W * D], kernel [W, D] -> (y [B, D],
    cache'); pass the cache donated (updated in place). ``two_cores``: the compile target has two
    TensorCores per chip (the row blocks; the numbers are the same either way)."""
    live = None if lengths is None else lengths.astype(jnp.int32)[:, None]
    y_DxB, new = _call(x, cache.astype(x.dtype), kernel, live, interpret, two_cores)
    return jnp.transpose(y_DxB), new


def short_conv_step(
    x: Array,
    cache: Array,
    kernel: Array,
    lengths: Array | None = None,
    *,
    impl: str = "chunk",
    two_cores: bool = False,
) -> tuple[Array, Array]:
    """The conv step with ``model.attn_impl``'s kernels: "mosaic" takes the Mosaic kernel where it
    runs (``takes``; interpreted on CPU), "auto" takes it in a program compiled for TPU and the XLA
    step elsewhere (``platform.per_platform``), everything else the XLA step. ``two_cores``: as
    ``mosaic_conv_step``'s."""
    if impl not in ("mosaic", "auto") or not takes(*x.shape):
        return conv_step(x, cache, kernel, lengths)
    mosaic = functools.partial(_mosaic, two_cores=two_cores)
    return mosaic_step_for(impl, mosaic, conv_step, x, cache, kernel, lengths)


def _mosaic(x, cache, kernel, lengths, *, interpret: bool, two_cores: bool):
    return mosaic_conv_step(x, cache, kernel, lengths, interpret=interpret, two_cores=two_cores)
