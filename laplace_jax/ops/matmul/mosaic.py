"""A product of a few rows with a weight, as a Pallas TPU (Mosaic) kernel: decode and short prefill.

Same contract as ``reference`` (``jnp.dot`` with ``out_dtype`` accumulation): x [M, I] @ w [I, O].

Why. A decode step multiplies a few hundred rows by every weight: at the 3B config and 256 rows
on v5p each MLP product is compute-bound (28 us of FLOPs against 18 us of weight bytes), and the
TPU compiler's dot estimates at 42.9 us (65% of the bf16 peak): it splits the 256 rows over the
chip's two TensorCores, so each core pushes only 128 rows past every weight tile it loads. This
kernel splits the weight's columns instead: the grid walks blocks of ``O`` ("parallel": a megacore
chip's cores take half the blocks each), every block reads the rows whole, its [I, block] slice of
the weight once, and contracts all of I in one MXU pass with fp32 accumulation. The compiler's
static schedule of it is 31.6 us for that product (89% of the peak; ``tpu``'s Mosaic rule counts
the larger of that and its bytes' DMA floor).

Where. ``takes``: at most ``MAX_ROWS`` rows (more rows keep the cores busy either way: at 512 rows
the two estimate within 7% of each other, and the train step's products are far larger), I and O
whole 128-lane tiles, one dtype. ``layers.common.matmul`` runs it in programs compiled for a TPU
with two TensorCores per chip (v4, v5p: ``platform.two_core_tpu``); on one-core chips (v5e, v6e)
the compiler's own dot estimates as fast or faster (it has no rows to split), and elsewhere it is
the XLA dot. The gradient is XLA's (``jax.custom_vjp``): nothing trains through it at these sizes.

Epilogues. Two more forms keep an elementwise op that follows a product inside its grid step, so
the product is never written out and the op is not a call of its own: ``residual_rows_matmul``
(r + x w: a block's residual add after the MLP's down projection) and ``gated_rows_matmul``
(silu(x w_gate) (x w_up): SwiGLU's hidden layer, both weights' column blocks in one step). In the
3B decode step at 256 rows on v5p the add and SwiGLU's gate kernel were 0.12 and 0.15 ms of the
estimate. Each rounds as the unfused ops do (the product to the output's dtype first).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.gla.limits import GATED, MOSAIC_MATMUL_KERNEL, MOSAIC_PROJECTIONS_KERNEL, PLAIN, RESIDUAL
from laplace_jax.ops.norm.mosaic import swish
from laplace_jax.ops.swiglu.naive import swiglu as swiglu_naive

Array = jax.Array
LANES = 128
MAX_ROWS = 512
VMEM_LIMIT = 64 * 2**20  # above the compiler's default scoped limit; under every TPU's VMEM (v5p: 95 MiB)


def reference(x: Array, w: Array, out_dtype: Any) -> Array:
    """x [.., I] @ w [I, O], accumulated (and returned) in ``out_dtype``: the XLA dot."""
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=out_dtype)


def takes(rows: int, in_features: int, out_features: int, dtype: Any, w_dtype: Any) -> bool:
    """Whether the kernel runs x [rows, in_features] @ w [in_features, out_features]."""
    lane_tiles = in_features % LANES == 0 and out_features % LANES == 0
    return 0 < rows <= MAX_ROWS and lane_tiles and jnp.dtype(dtype) == jnp.dtype(w_dtype)


def column_block(rows: int, in_features: int, out_features: int) -> int:
    """Columns of w per grid step: 256 where the rows are few (at most 256) or I is long, else 512
    (the compiler's static schedules on v5p: [256, 3072] x [3072, 3072] 13.0 us at 256 against
    13.3 at 512, [256, 8192] x [8192, 3072] 31.8 against 33.3; at 512 rows 512 is the faster,
    24.0 against 24.4 us for [3072, 3072]); the largest of that, 256 and 128 that divides O,
    keeping an even number of blocks for two cores where one does."""
    first = 256 if rows <= 256 or in_features > 4096 else 512
    fits = [b for b in (512, 256, 128) if b <= first and out_features % b == 0]
    even = [b for b in fits if (out_features // b) % 2 == 0]
    return (even or fits)[0]


def _kernel(x_ref, w_ref, *refs, form: int):
    """One column block: the product in fp32, rounded to the output's dtype as the XLA dot rounds
    it; ``RESIDUAL`` then adds r as the XLA add of two such arrays would, ``GATED`` rounds the
    second product too and applies SwiGLU's gate in fp32 as ``ops.swiglu`` does (one rounding)."""
    *extra, o_ref = refs
    dt = o_ref.dtype
    y = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(dt)
    if form == RESIDUAL:
        y = (y.astype(jnp.float32) + extra[0][...].astype(jnp.float32)).astype(dt)
    elif form == GATED:
        up = jnp.dot(x_ref[...], extra[0][...], preferred_element_type=jnp.float32).astype(dt)
        y = (swish(y.astype(jnp.float32))[0] * up.astype(jnp.float32)).astype(dt)
    o_ref[...] = y


def _call(x: Array, w: Array, extra: Array | None, form: int, out_dtype: Any, interpret: bool) -> Array:
    """The grid over column blocks; ``extra``: r [M, O] (``RESIDUAL``) or u [I, O] (``GATED``)."""
    (M, I), O = x.shape, w.shape[1]
    block = column_block(M, I, O)
    columns = pl.BlockSpec((I, block), lambda j: (0, j))
    out = pl.BlockSpec((M, block), lambda j: (0, j))
    extra_specs = {PLAIN: [], RESIDUAL: [out], GATED: [columns]}[form]
    return pl.pallas_call(
        functools.partial(_kernel, form=form),
        grid=(O // block,),
        in_specs=[pl.BlockSpec((M, I), lambda j: (0, 0)), columns, *extra_specs],
        out_specs=out,
        out_shape=jax.ShapeDtypeStruct((M, O), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=MOSAIC_MATMUL_KERNEL,
    )(x, w, *([] if extra is None else [extra]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rows_matmul(x: Array, w: Array, out_dtype: Any, interpret: bool = False) -> Array:
    """x [M, I] @ w [I, O] in ``out_dtype`` as the Mosaic kernel (``takes`` must hold); compiled
    for TPU, or run in the Pallas interpreter with ``interpret``."""
    return _call(x, w, None, PLAIN, jnp.dtype(out_dtype), interpret)


def _fwd(x, w, out_dtype, interpret):
    return rows_matmul(x, w, out_dtype, interpret), (x, w)


def _bwd(out_dtype, interpret, res, dy):
    x, w = res
    dx = jnp.dot(dy, w.T.astype(dy.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(x.T.astype(dy.dtype), dy, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


rows_matmul.defvjp(_fwd, _bwd)


def residual_reference(x: Array, w: Array, r: Array) -> Array:
    """r + x [M, I] @ w [I, O], the product rounded to r's dtype first: the XLA dot and add."""
    return r + reference(x, w, r.dtype)


def gated_reference(x: Array, w_gate: Array, w_up: Array) -> Array:
    """SwiGLU's hidden layer, silu(x w_gate) (x w_up), each product in x's dtype: the XLA dots and
    ``ops.swiglu``'s gate (plain JAX: rounded after the silu and after the product)."""
    return swiglu_naive(reference(x, w_gate, x.dtype), reference(x, w_up, x.dtype))


def _epilogue_kernel(form: int, reference: Any) -> Any:
    """The kernel in ``form`` on (x, w, extra, interpret), its gradient ``reference``'s (custom VJP)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def fused(x: Array, w: Array, extra: Array, interpret: bool) -> Array:
        return _call(x, w, extra, form, (extra if form == RESIDUAL else x).dtype, interpret)

    def fwd(x, w, extra, interpret):
        return fused(x, w, extra, interpret), (x, w, extra)

    def bwd(interpret, res, dy):
        return jax.vjp(reference, *res)[1](dy)

    fused.defvjp(fwd, bwd)
    return fused


_residual = _epilogue_kernel(RESIDUAL, residual_reference)
_gated = _epilogue_kernel(GATED, gated_reference)


def residual_rows_matmul(x: Array, w: Array, r: Array, interpret: bool = False) -> Array:
    """r + x [M, I] @ w [I, O] in r's dtype (a block's residual add after its last projection) as
    the Mosaic kernel, the add in the product's epilogue; the gradient is ``residual_reference``'s."""
    return _residual(x, w, r, interpret)


def gated_rows_matmul(x: Array, w_gate: Array, w_up: Array, interpret: bool = False) -> Array:
    """silu(x w_gate) (x w_up) in x's dtype (SwiGLU's hidden layer) as the Mosaic kernel: both
    products of a column block and the gate in one grid step, so neither product is written out;
    the gate in fp32 as ``ops.swiglu.mosaic``; the gradient is ``gated_reference``'s."""
    return _gated(x, w_gate, w_up, interpret)


def projection_steps(out_features: tuple[int, ...]) -> int:
    """Grid steps of ``rows_projections``: as many as split every weight into column blocks of
    whole lane tiles (the 3B's q, k, v, g: 12 steps of 128, 128, 256, 256 columns, 35.2 us of
    static schedule on v5p at 256 rows, against 35.9 at 6 steps); 0 where that count is odd or
    one (no even split over two cores)."""
    steps = math.gcd(*out_features) // LANES
    return steps if steps >= 2 and steps % 2 == 0 else 0


def projections_take(rows: int, in_features: int, out_features: tuple[int, ...], dtype: Any, w_dtype: Any) -> bool:
    """Whether ``rows_projections`` runs x [rows, in_features] against weights [in_features, O_i]."""
    widths_ok = all(takes(rows, in_features, o, dtype, w_dtype) for o in out_features)
    return len(out_features) > 1 and widths_ok and projection_steps(out_features) > 0


def _projections_kernel(x_ref, *refs):
    """One column block of every weight: each product in fp32, rounded to its output's dtype."""
    x, n = x_ref[...], len(refs) // 2
    for w_ref, o_ref in zip(refs[:n], refs[n:], strict=True):
        o_ref[...] = jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)


def _projections_call(x: Array, ws: tuple[Array, ...], interpret: bool) -> list[Array]:
    (M, I), steps = x.shape, projection_steps(tuple(w.shape[1] for w in ws))
    columns = [pl.BlockSpec((I, w.shape[1] // steps), lambda j: (0, j)) for w in ws]
    return pl.pallas_call(
        _projections_kernel,
        grid=(steps,),
        in_specs=[pl.BlockSpec((M, I), lambda j: (0, 0)), *columns],
        out_specs=[pl.BlockSpec((M, w.shape[1] // steps), lambda j: (0, j)) for w in ws],
        out_shape=[jax.ShapeDtypeStruct((M, w.shape[1]), x.dtype) for w in ws],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=MOSAIC_PROJECTIONS_KERNEL,
    )(x, *ws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_projections(x: Array, ws: tuple[Array, ...], interpret: bool = False) -> tuple[Array, ...]:
    """(x [M, I] @ w for w in ws), each in x's dtype, as one Mosaic call (``projections_take`` must
    hold): every grid step takes one column block of each weight, so the rows are read once and
    the call's fixed costs are paid once, not per projection. In the 3B decode step at 256 rows on
    v5p, GLA's q, k, v and g products estimate at 35.2 us together against 40.7 as four calls. The
    gradient is the XLA dots'."""
    return tuple(_projections_call(x, ws, interpret))


def _projections_fwd(x, ws, interpret):
    return rows_projections(x, ws, interpret), (x, ws)


def _projections_bwd(interpret, res, dys):
    x, ws = res
    return jax.vjp(lambda x, ws: tuple(reference(x, w, x.dtype) for w in ws), x, ws)[1](tuple(dys))


rows_projections.defvjp(_projections_fwd, _projections_bwd)
