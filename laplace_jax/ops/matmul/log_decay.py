"""GLA's log-decay gate of a few rows as one Pallas TPU (Mosaic) kernel: decode and short prefill.

Same contract as ``reference``: x [M, D], w0 [D, r], w1 [r, N], bias [N] ->

    gk = max(log_sigmoid((x w0) w1 + bias) / normalizer, clamp)     [M, N] fp32

with x w0 rounded to x's dtype, the second product and everything after it in fp32 (fla's
``gk_proj``, a low-rank pair of projections, then GLA's gate); with a row mask ``valid`` [M], 0
in the rows it marks false (padding positions: a log-decay of 0 leaves the state as it was).

Why. In the 3B decode step at 256 rows on v5p the gate was the largest XLA work left beside the
Mosaic calls: the two products (the first only 16 wide) and the log-sigmoid after them were 8.7
us a layer of the compiler's estimate (0.21 ms in all), for 0.1 MB of weights. Here one grid step
holds the rows, both weights and the bias in VMEM and writes its block of gk once: the first product
is recomputed by each step (16 columns: a few hundred cycles), the second is an fp32 product of
the bf16-rounded first (exact products, as the XLA dot of bf16 operands; a bf16 product 16 deep
does not lower), and the block leaves transposed, [N, M]: the GLA decode kernel reads gk
batch-minor ([H, K, B], ``ops.gla.mosaic_step``), so ``log_decay`` hands back a transposed view
that the compiler folds into that kernel's input instead of copying.

The bias arrives as [N / 128, 128], a bitcast of the [N] parameter (a [1, N] row is a relayout
copy for bf16; ``ops.norm.mosaic.gain_rows``), and is joined into one row on chip.

Where. ``takes``: at most ``MAX_ROWS`` rows, D and N whole lane tiles and N split into two
column blocks of whole lane tiles (a megacore chip's two TensorCores take one each).
``layers.common.log_decay`` runs it where ``matmul`` runs the few-row product kernel; elsewhere
the XLA form. No gradient: nothing trains through it at these sizes (a custom VJP gives the
reference's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.gla.limits import MOSAIC_GATE_KERNEL
from laplace_jax.ops.matmul.mosaic import LANES, MAX_ROWS
from laplace_jax.ops.matmul.mosaic import reference as matmul_reference
from laplace_jax.ops.norm.mosaic import gain_rows, read_gain

Array = jax.Array
f32 = jnp.float32
BLOCKS = 2  # column blocks of gk: one per TensorCore of a megacore chip


def gate(g: Array, normalizer: float, clamp: float | None) -> Array:
    """GLA's log-decay from the gate's logits g (fp32): max(log_sigmoid(g) / normalizer, clamp)."""
    d = jax.nn.log_sigmoid(g) / normalizer
    return d if clamp is None else jnp.maximum(d, clamp)


def reference(
    x: Array, w0: Array, w1: Array, bias: Array, normalizer: float, clamp: float | None, valid: Array | None = None
) -> Array:
    """gk [.., N] fp32 of x [.., D]: the XLA dots (the first in x's dtype, the second in fp32), the
    bias in fp32, then the gate; 0 where ``valid`` [..] is false."""
    g = matmul_reference(matmul_reference(x, w0, x.dtype), w1, f32) + bias.astype(f32)
    d = gate(g, normalizer, clamp)
    return d if valid is None else jnp.where(valid[..., None], d, 0.0)


def takes(rows: int, features: int, rank: int, out_features: int) -> bool:
    """Whether the kernel runs x [rows, features] through the gate to [rows, out_features]."""
    return 0 < rows <= MAX_ROWS and features % LANES == 0 and out_features % (BLOCKS * LANES) == 0 and 0 < rank <= LANES


def _kernel(x_ref, w0_ref, w1_ref, b_ref, *refs, normalizer: float, clamp: float | None):
    """One column block of gk, transposed: [N / BLOCKS, M]; rows (lanes) not live are 0."""
    live_ref, o_ref = refs if len(refs) == 2 else (None, *refs)
    nt = (((1,), (1,)), ((), ()))  # x [M, D] against w0 as [r, D]
    h = jax.lax.dot_general(x_ref[...], w0_ref[...], nt, preferred_element_type=f32).astype(x_ref.dtype)
    g = jnp.dot(h.astype(f32), w1_ref[...].astype(f32), preferred_element_type=f32)
    bias = read_gain(b_ref)  # [1, N] fp32
    width = g.shape[1]
    for j in range(BLOCKS):  # the block's lanes of the bias: static slices, one branch per block

        @pl.when(pl.program_id(0) == j)
        def _(j=j):
            d = jnp.transpose(gate(g + bias[:, j * width : (j + 1) * width], normalizer, clamp))
            o_ref[...] = d if live_ref is None else jnp.where(live_ref[...] > 0, d, 0.0)


def _call(
    x: Array,
    w0: Array,
    w1: Array,
    bias: Array,
    live: Array | None,
    normalizer: float,
    clamp: float | None,
    interpret: bool,
) -> Array:
    """gk transposed, [N, M] fp32; ``live`` [1, M] int32 or None."""
    M, (r, N) = x.shape[0], w1.shape
    width = N // BLOCKS
    b = gain_rows(bias)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731
    masks = [] if live is None else [live]
    return pl.pallas_call(
        functools.partial(_kernel, normalizer=normalizer, clamp=clamp),
        grid=(BLOCKS,),
        in_specs=[whole(x), whole(w0.T), pl.BlockSpec((r, width), lambda j: (0, j)), whole(b), *map(whole, masks)],
        out_specs=pl.BlockSpec((width, M), lambda j: (j, 0)),
        out_shape=jax.ShapeDtypeStruct((N, M), f32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=MOSAIC_GATE_KERNEL,
    )(x, w0.T, w1, b, *masks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def rows_log_decay(
    x: Array,
    w0: Array,
    w1: Array,
    bias: Array,
    valid: Array | None,
    normalizer: float,
    clamp: float | None,
    interpret: bool = False,
) -> Array:
    """``reference`` of x [M, D] (``valid`` [M] or None) as the Mosaic kernel (``takes`` must
    hold): gk [M, N] fp32, a transposed view of the kernel's [N, M]; compiled for TPU, or in the
    Pallas interpreter with ``interpret``. The gradient is ``reference``'s."""
    live = None if valid is None else valid.astype(jnp.int32).reshape(1, -1)
    return _call(x, w0, w1, bias, live, normalizer, clamp, interpret).T


def _fwd(x, w0, w1, bias, valid, normalizer, clamp, interpret):
    return rows_log_decay(x, w0, w1, bias, valid, normalizer, clamp, interpret), (x, w0, w1, bias, valid)


def _bwd(normalizer, clamp, interpret, res, dy):
    *arrays, valid = res
    grads = jax.vjp(lambda *a: reference(*a, normalizer, clamp, valid), *arrays)[1](dy)
    return (*grads, None)


rows_log_decay.defvjp(_fwd, _bwd)
