"""RMSNorm as Pallas TPU (Mosaic) kernels, forward and backward: same contract as ``naive.rms_norm``.

Why. The TPU compiler's cost model puts a lone RMSNorm far above its bytes: [256, 3072] bf16 in
and out (3 MiB, 1.1 us of v5p's HBM bandwidth) estimates at 8.9 us, 21 us from a [256, 1, 3072]
fp32 residual, and the 3B decode step's 48 norms at 0.73 ms of its 13.1 (the reduce, the rsqrt
and the scaling are separate fusions); in the 3B train step RMSNorm's backward alone is 7.5% of
the estimate. Here one grid step holds a block of whole rows in VMEM: the forward reads x once and
writes y once; the backward reads x and dy once, writes dx once, and one row of the gain's
gradient per block (XLA sums those).

    forward   s = rsqrt(mean(x^2) + eps),  y = x s g
    backward  u = dy g,  dx = s u - x s^3 mean(x u),  dg = sum over rows of dy x s

all in float32 whatever x's dtype. The grid is "parallel" over row blocks (a two-core chip's
cores take half each; ``row_block`` keeps their number even where it can).

With a gate (fla's FusedRMSNormGated with swish, GLA's output norm) y is further multiplied by
swish(z) = z sigmoid(z), and the backward also writes dz = dy x s g swish'(z) (dy above then
stands for dy swish(z)). A gain narrower than the rows (w dividing D: GLA's heads side by side)
normalises each run of w features on its own, by static lane slices of the block (a [.., H, w]
view of 192-wide heads would be a relayout that XLA writes out). ``residual_rms_norm`` is the
norm after a residual add, r = x + h: the forward writes r and y, the backward adds r's own
cotangent to dx in the same pass.

Where. ``takes``: rows that split into blocks of at most ``BLOCK_ELEMENTS`` (a multiple of 8 rows
each), or few enough to be one block. ``rms_norm`` runs the kernels in programs compiled for a TPU
(``platform.per_platform``) and ``naive`` on other backends, inside one custom VJP either way;
``layers.common.row_kernels`` decides where the model calls it (two-TensorCore TPUs).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.gla.limits import MOSAIC_NORM_KERNELS
from laplace_jax.ops.norm import naive
from laplace_jax.platform import per_platform

Array = jax.Array
LANES = 128
ROW_BLOCKS = (512, 256, 128, 64, 32, 16, 8)
BLOCK_ELEMENTS = 2**19  # a block's float32 temporaries (2 MiB each) and buffers stay inside ``VMEM_LIMIT``
VMEM_LIMIT = 32 * 2**20  # the backward of 256 x 3072 blocks needs 19.5 MiB, above the default 16


def row_block(rows: int, features: int) -> int | None:
    """Rows per grid step: the largest of ``ROW_BLOCKS`` that divides ``rows`` within
    ``BLOCK_ELEMENTS``, an even number of blocks preferred (two TensorCores); all the rows when
    they fit one block and no block divides them; None when neither holds."""
    fits = [b for b in ROW_BLOCKS if b * features <= BLOCK_ELEMENTS and rows % b == 0 and b <= rows]
    even = [b for b in fits if (rows // b) % 2 == 0]
    if even or fits:
        return (even or fits)[0]
    return rows if 0 < rows * features <= BLOCK_ELEMENTS else None


def takes(rows: int, features: int) -> bool:
    """Whether the kernels run x [rows, features] (a block's rows are whole, so any width: one
    that is not whole lane tiles, such as the 3B's 192-wide heads, leaves part of each unused)."""
    return row_block(rows, features) is not None


def swish(z: Array) -> tuple[Array, Array]:
    """(z sigmoid(z), its derivative), elementwise: the gate here and SwiGLU's silu (``ops.swiglu``)."""
    sig = jax.nn.sigmoid(z)
    return z * sig, sig * (1 + z * (1 - sig))


def _group_mean(a: Array, groups: int) -> Array:
    """Each row's mean over each of ``groups`` equal runs of its features, broadcast over the run
    ([b, 1] for one group). Static lane slices: a 192-wide head is not whole lane tiles, and
    splitting the lanes into [b, groups, width] would relayout the block."""
    if groups == 1:
        return jnp.mean(a, axis=-1, keepdims=True)
    b, w = a.shape[0], a.shape[1] // groups
    runs = (jnp.mean(a[:, j * w : (j + 1) * w], axis=-1, keepdims=True) for j in range(groups))
    return jnp.concatenate([jnp.broadcast_to(m, (b, w)) for m in runs], axis=-1)


def _tiled(g: Array, groups: int) -> Array:
    return g if groups == 1 else jnp.concatenate([g] * groups, axis=-1)


def _normalized(x: Array, g: Array, groups: int, eps: float) -> Array:
    """x [b, D] float32 normalised per run, times the gain tiled over the runs."""
    return x * jax.lax.rsqrt(_group_mean(x * x, groups) + eps) * _tiled(g, groups)


def _input_grads(x: Array, g: Array, dy: Array, groups: int, eps: float) -> tuple[Array, Array, Array]:
    """(dx, n = x s, dy) in float32 for y = n g (g tiled): dx = s u - n s^2 mean(x u), u = dy g."""
    s = jax.lax.rsqrt(_group_mean(x * x, groups) + eps)
    n, u = x * s, dy * g
    return s * u - n * (s * s) * _group_mean(x * u, groups), n, dy


def _gain_grad(dy: Array, n: Array, groups: int) -> Array:
    """This block's sum over rows of dy n, folded over the runs: [1, 1, w]."""
    dg = jnp.sum(dy * n, axis=0, keepdims=True)
    w = dg.shape[1] // groups
    return sum(dg[:, j * w : (j + 1) * w] for j in range(groups))[None]


def gain_rows(gain: Array) -> Array:
    """The gain [w] as the kernels take it: [w / 128, 128] where w is whole lane tiles, else [1, w].
    On a TPU the first is a bitcast of the parameter as stored (a [w] array's tiles are the
    [w / 128, 128] array's, bf16 and fp32), where a bf16 [1, w] is a relayout copy: one op per
    norm, 0.05 ms for the 49 D-wide norms of the 3B decode step at 256 rows on v5p."""
    w = gain.shape[-1]
    return gain.reshape(w // LANES, LANES) if w % LANES == 0 else gain.reshape(1, w)


def read_gain(g_ref) -> Array:
    """In a kernel: the gain [1, w] in float32 from ``gain_rows``' form, converted in VMEM from the
    dtype it is stored in (bf16 serving weights: no convert op); lane tiles are joined on chip."""
    g = g_ref[...].astype(jnp.float32)
    return g if g.shape[0] == 1 else jnp.concatenate([g[j : j + 1] for j in range(g.shape[0])], axis=-1)


def _forward_kernel(x_ref, g_ref, *refs, eps: float, gated: bool, groups: int):
    z_ref, y_ref = refs if gated else (None, *refs)
    y = _normalized(x_ref[...].astype(jnp.float32), read_gain(g_ref), groups, eps)
    if gated:
        y = y * swish(z_ref[...].astype(jnp.float32))[0]
    y_ref[...] = y.astype(y_ref.dtype)


def _backward_kernel(x_ref, g_ref, *refs, eps: float, gated: bool, groups: int):
    z_ref, dy_ref, dx_ref, dg_ref, dz_ref = refs if gated else (None, *refs, None)
    x, dy, g = x_ref[...].astype(jnp.float32), dy_ref[...].astype(jnp.float32), _tiled(read_gain(g_ref), groups)
    if gated:
        a, da = swish(z_ref[...].astype(jnp.float32))
        s = jax.lax.rsqrt(_group_mean(x * x, groups) + eps)
        dz_ref[...] = (dy * x * s * g * da).astype(dz_ref.dtype)
        dy = dy * a
    dx, n, dy = _input_grads(x, g, dy, groups, eps)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dg_ref[...] = _gain_grad(dy, n, groups)


def _residual_forward_kernel(x_ref, h_ref, g_ref, r_ref, y_ref, *, eps: float, groups: int):
    r = (x_ref[...].astype(jnp.float32) + h_ref[...].astype(jnp.float32)).astype(r_ref.dtype)
    r_ref[...] = r
    y_ref[...] = _normalized(r.astype(jnp.float32), read_gain(g_ref), groups, eps).astype(y_ref.dtype)


def _residual_backward_kernel(r_ref, g_ref, dy_ref, dr_ref, dx_ref, dg_ref, *, eps: float, groups: int):
    r, dy = r_ref[...].astype(jnp.float32), dy_ref[...].astype(jnp.float32)
    dx, n, dy = _input_grads(r, _tiled(read_gain(g_ref), groups), dy, groups, eps)
    dx_ref[...] = (dx + dr_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)
    dg_ref[...] = _gain_grad(dy, n, groups)


def compiler_params() -> Any:
    """A row kernel's grid is parallel (megacore chips split it), under ``VMEM_LIMIT``."""
    return pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT)


def _blocks(x: Array, g: Array) -> tuple:
    """(rows, D, w, the grid, the row block's spec, the gain's spec) of x [rows, D], the gain as
    ``gain_rows``."""
    (N, D), w = x.shape, g.size
    b = row_block(N, D)
    return N, D, w, (N // b,), pl.BlockSpec((b, D), lambda i: (i, 0)), pl.BlockSpec(g.shape, lambda i: (0, 0))


def _forward(x: Array, g: Array, z: Array | None, eps: float, out_dtype: Any, interpret: bool) -> Array:
    N, D, w, grid, rows, gain = _blocks(x, g)
    gated = z is not None
    return pl.pallas_call(
        functools.partial(_forward_kernel, eps=eps, gated=gated, groups=D // w),
        grid=grid,
        in_specs=[rows, gain, *([rows] if gated else [])],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((N, D), out_dtype),
        compiler_params=compiler_params(),
        interpret=interpret,
        name=MOSAIC_NORM_KERNELS[0],
    )(x, g, *([z] if gated else []))


def _backward(x: Array, g: Array, z: Array | None, dy: Array, eps: float, interpret: bool) -> tuple:
    N, D, w, grid, rows, gain = _blocks(x, g)
    gated = z is not None
    out = [jax.ShapeDtypeStruct((N, D), x.dtype), jax.ShapeDtypeStruct((grid[0], 1, w), jnp.float32)]
    out_specs = [rows, pl.BlockSpec((1, 1, w), lambda i: (i, 0, 0))]
    grads = pl.pallas_call(
        functools.partial(_backward_kernel, eps=eps, gated=gated, groups=D // w),
        grid=grid,
        in_specs=[rows, gain, *([rows] if gated else []), rows],
        out_specs=out_specs + ([rows] if gated else []),
        out_shape=out + ([jax.ShapeDtypeStruct((N, D), z.dtype)] if gated else []),
        compiler_params=compiler_params(),
        interpret=interpret,
        name=MOSAIC_NORM_KERNELS[1],
    )(x, g, *([z] if gated else []), dy)
    dx, dg, dz = (*grads, None) if not gated else grads
    return dx, dg.sum(axis=(0, 1)).reshape(g.shape).astype(g.dtype), dz


def on_tpu(kernel, naive, interpret: bool):
    """``kernel`` in the Pallas interpreter (``interpret``), else ``kernel`` in a program compiled
    for a TPU and ``naive`` for any other (``platform.per_platform``; also ``ops.swiglu``'s)."""
    if interpret:
        return kernel
    return lambda *a: per_platform(*a, default=naive, tpu=kernel)


# One custom VJP around the platform choice, so its residuals are x, the gain and the gate on
# every backend (a choice inside autodiff would keep every branch's residuals: the plain norm's
# float32 intermediates, as well as the kernels').
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x: Array, g: Array, z: Array | None, eps: float, out_dtype: Any, interpret: bool) -> Array:
    kernel = lambda x, g, z: _forward(x, g, z, eps, out_dtype, interpret)  # noqa: E731
    plain = lambda x, g, z: naive.rms_norm(x, g.reshape(-1), eps, out_dtype, z)  # noqa: E731
    return on_tpu(kernel, plain, interpret)(x, g, z)


def _norm_fwd(x, g, z, eps, out_dtype, interpret):
    return _norm(x, g, z, eps, out_dtype, interpret), (x, g, z)


def _norm_bwd(eps, out_dtype, interpret, res, dy):
    kernel = lambda x, g, z, dy: _backward(x, g, z, dy, eps, interpret)  # noqa: E731

    def plain(x, g, z, dy):
        grads = jax.vjp(lambda x, g, z: naive.rms_norm(x, g.reshape(-1), eps, out_dtype, z), x, g, z)[1](dy)
        return grads if z is not None else (*grads[:2], None)

    return on_tpu(kernel, plain, interpret)(*res, dy)


_norm.defvjp(_norm_fwd, _norm_bwd)


def _residual_forward(x: Array, h: Array, g: Array, eps: float, out_dtype: Any, interpret: bool) -> tuple:
    N, D, w, grid, rows, gain = _blocks(x, g)
    r, y = pl.pallas_call(
        functools.partial(_residual_forward_kernel, eps=eps, groups=D // w),
        grid=grid,
        in_specs=[rows, rows, gain],
        out_specs=[rows, rows],
        out_shape=[jax.ShapeDtypeStruct((N, D), x.dtype), jax.ShapeDtypeStruct((N, D), out_dtype)],
        compiler_params=compiler_params(),
        interpret=interpret,
        name=MOSAIC_NORM_KERNELS[2],
    )(x, h, g)
    return r, y


def _residual_backward(r: Array, g: Array, dy: Array, dr: Array, eps: float, interpret: bool) -> tuple:
    N, D, w, grid, rows, gain = _blocks(r, g)
    dx, dg = pl.pallas_call(
        functools.partial(_residual_backward_kernel, eps=eps, groups=D // w),
        grid=grid,
        in_specs=[rows, gain, rows, rows],
        out_specs=[rows, pl.BlockSpec((1, 1, w), lambda i: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((N, D), r.dtype), jax.ShapeDtypeStruct((grid[0], 1, w), jnp.float32)],
        compiler_params=compiler_params(),
        interpret=interpret,
        name=MOSAIC_NORM_KERNELS[3],
    )(r, g, dy, dr)
    return dx, dg.sum(axis=(0, 1)).reshape(g.shape).astype(g.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _residual_norm(x: Array, h: Array, g: Array, eps: float, out_dtype: Any, interpret: bool) -> tuple:
    kernel = lambda x, h, g: _residual_forward(x, h, g, eps, out_dtype, interpret)  # noqa: E731
    plain = lambda x, h, g: naive.residual_rms_norm(x, h, g.reshape(-1), eps, out_dtype)  # noqa: E731
    return on_tpu(kernel, plain, interpret)(x, h, g)


def _residual_norm_fwd(x, h, g, eps, out_dtype, interpret):
    r, y = _residual_norm(x, h, g, eps, out_dtype, interpret)
    return (r, y), (r, g)


def _residual_norm_bwd(eps, out_dtype, interpret, res, cotangents):
    r, g = res
    dr, dy = cotangents
    kernel = lambda r, g, dy, dr: _residual_backward(r, g, dy, dr, eps, interpret)  # noqa: E731

    def plain(r, g, dy, dr):
        dx, dg = jax.vjp(lambda r, g: naive.rms_norm(r, g.reshape(-1), eps, out_dtype), r, g)[1](dy)
        return (dx + dr).astype(r.dtype), dg

    dx, dg = on_tpu(kernel, plain, interpret)(r, g, dy, dr.astype(r.dtype))
    return dx, dx, dg


_residual_norm.defvjp(_residual_norm_fwd, _residual_norm_bwd)


def rms_norm(
    x: Array, gain: Array, eps: float, out_dtype: Any, gate: Array | None = None, interpret: bool = False
) -> Array:
    """``naive.rms_norm`` (x [.., D], gain [w] with w dividing D: each run of w features is
    normalised on its own; gate like x or None), forward and backward, as the Mosaic kernels in a
    program compiled for a TPU (``takes`` must hold for the rows of x) and as ``naive`` for any
    other; with ``interpret``, the kernels in the Pallas interpreter."""
    D = x.shape[-1]
    z = None if gate is None else gate.reshape(-1, D)
    g = gain_rows(gain)
    return _norm(x.reshape(-1, D), g, z, eps, jnp.dtype(out_dtype), interpret).reshape(x.shape)


def residual_rms_norm(
    x: Array, h: Array, gain: Array, eps: float, out_dtype: Any, interpret: bool = False
) -> tuple[Array, Array]:
    """(r, rms_norm(r)) with r = x + h in x's dtype: a pre-norm block's residual add and the next
    norm as one kernel (forward: x and h read once, r and y written once; backward: the norm's
    input gradient and r's own cotangent summed in the same pass). Kernels and backends as
    ``rms_norm``; the gain is as wide as x."""
    D = x.shape[-1]
    g = gain_rows(gain)
    h = h.astype(x.dtype).reshape(-1, D)
    r, y = _residual_norm(x.reshape(-1, D), h, g, eps, jnp.dtype(out_dtype), interpret)
    return r.reshape(x.shape), y.reshape(x.shape)
