"""One GLA decode token as a Pallas TPU (Mosaic) kernel: the state streamed once through VMEM.

Same contract as ``gla_step`` (``step.py``, the XLA form and this kernel's reference): q, k, g
[B, H, K], v [B, H, V], state [B, H, K, V] fp32 ->

    S' = diag(exp(g)) S + k v^T,      o = S'^T (scale * q)

The decode step is bound by the state: at the 3B config and 256 rows it is 302 MB per layer,
read once and written once, against 1.5 MB of everything else. XLA fuses the update and the
output into one pass already; its cost model puts that pass at 66% of v5p's HBM bandwidth,
below the 72% it gives a plain elementwise op. This kernel is the same single pass with the
DMA pipelined by Pallas (its time: ``tpu``'s Mosaic rule, docs/tpu.md).

Layout. On the TPU the 3B state of 256 rows is laid out batch-minor (the rows on the 128
lanes, V on the sublanes: no padding, where V = 192 on the lanes would pad to 256), so the
kernel takes the state as [H, K, V, B], which is then a bitcast of the caller's buffer, not a
copy; q, k, g as [H, K, B] and v as [H, V, B] (the short-conv step kernel writes q, k and v
that way; q and k stay in their dtype, g in fp32). One grid step is one head,
one block of ``BLOCK_ROWS`` rows and ``BLOCK_K`` rows of K: it reads [BLOCK_K, V, rows] of the
state, writes the update in place (the call aliases the state) and adds its share of the
output to an fp32 VMEM accumulator; groups of heads and row blocks are parallel (split over a
megacore chip's two TensorCores), a group's heads and the K axis sequential ("arbitrary").
The output leaves in v's dtype as rows, [B, H * V], the layout the gated output norm and o_proj
read: after a group's last step its accumulators are transposed on chip and written as one
[rows, P * V] block, P heads wide so the block is whole lane tiles (``heads_per_group``: two
192-wide heads). Written batch-minor instead, o cost a transposed copy per layer (3B decode step
at 256 rows on v5p: 0.12 ms of the compiler's estimate).

``takes`` says where the kernel runs: where that batch-minor layout is the TPU's own (a batch of
whole 128-lane tiles, V not a multiple of 128); elsewhere the XLA step runs. On CPU the kernel
runs in the Pallas interpreter (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.gla.limits import MOSAIC_STEP_KERNEL

Array = jax.Array
f32 = jnp.float32
LANES = 128
BLOCK_K = 8  # rows of K per grid step: one fp32 sublane tile
BLOCK_ROWS = 256  # batch rows per grid step (lanes): [8, V=192, 256] fp32 is 1.5 MB, x4 buffers in VMEM


def whole_lane_tiles(batch: int) -> bool:
    """Whether ``batch`` rows fill whole 128-lane tiles."""
    return batch > 0 and batch % LANES == 0


def row_block(batch: int) -> int:
    """Batch rows (lanes) per grid step of the Mosaic decode kernels: ``BLOCK_ROWS``, else one lane
    tile, else the whole batch (a kernel run by hand on a narrower one, as the tests do)."""
    return BLOCK_ROWS if batch % BLOCK_ROWS == 0 else LANES if batch % LANES == 0 else batch


def takes(batch: int, v_dim: int) -> bool:
    """Whether the Mosaic step kernel runs this state: where the TPU lays the state out
    batch-minor, so the kernel's [H, K, V, B] view is a bitcast. That is where the batch fills
    whole lane tiles and V does not (V on the lanes would pad: 192 -> 256); where V does (128,
    256: the 340M and 1.3B configs) the TPU keeps V minor, and the kernel's view would cost two
    transposed copies of the state, so the XLA step runs there (``tests/test_tpu.py`` checks
    both: no state-sized copy either way)."""
    return whole_lane_tiles(batch) and v_dim % LANES != 0


def heads_per_group(heads: int, v_dim: int) -> int:
    """Heads whose outputs share one block of o: the fewest (dividing ``heads``) that side by side
    are whole lane tiles (3B: two 192-wide heads, 384 lanes), so the kernel writes o straight into
    [B, H * V] rows; all of them where no fewer are (a block as wide as the array is allowed)."""
    return next((p for p in range(1, heads + 1) if heads % p == 0 and p * v_dim % LANES == 0), heads)


def _kernel(q_ref, k_ref, g_ref, v_ref, s_ref, o_ref, s_out_ref, acc_ref, *, scale: float):
    p, kb = pl.program_id(2), pl.program_id(3)  # the head within the step's group, the block of K
    decay = jnp.exp(g_ref[...])  # [BLOCK_K, rows]
    k, q = k_ref[...].astype(f32), q_ref[...].astype(f32) * scale
    s = s_ref[...] * decay[:, None, :] + k[:, None, :] * v_ref[...].astype(f32)[None]
    s_out_ref[...] = s
    part = jnp.sum(q[:, None, :] * s, axis=0)  # [V, rows]

    @pl.when(kb == 0)
    def _():
        acc_ref[p] = part

    @pl.when(kb > 0)
    def _():
        acc_ref[p] += part

    @pl.when(jnp.logical_and(p == pl.num_programs(2) - 1, kb == pl.num_programs(3) - 1))
    def _():  # the group's outputs as rows [rows, P * V]: transposed on chip, not copied in HBM
        P, V, rows = acc_ref.shape
        o_ref[...] = jnp.transpose(acc_ref[...].reshape(P * V, rows)).astype(o_ref.dtype)


def _call(q: Array, k: Array, g: Array, v: Array, s: Array, scale: float, interpret: bool) -> tuple[Array, Array]:
    """q, k [H, K, B] in their dtype; g [H, K, B] fp32; v [H, V, B]; s [H, K, V, B] fp32 -> (o [B, H * V], s').
    The grid: groups of P heads (parallel), row blocks (parallel), the group's heads, K blocks;
    o's block [rows, P * V] stays in VMEM over a group and is written once, after its last step."""
    H, K, B = q.shape
    V = v.shape[1]
    bk = BLOCK_K if K % BLOCK_K == 0 else K
    rows = row_block(B)
    P = heads_per_group(H, V)
    qkg = pl.BlockSpec((None, bk, rows), lambda h, b, p, c: (h * P + p, c, b))
    state = pl.BlockSpec((None, bk, V, rows), lambda h, b, p, c: (h * P + p, c, 0, b))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        grid=(H // P, B // rows, P, K // bk),
        in_specs=[qkg, qkg, qkg, pl.BlockSpec((None, V, rows), lambda h, b, p, c: (h * P + p, 0, b)), state],
        out_specs=[pl.BlockSpec((rows, P * V), lambda h, b, p, c: (b, h)), state],
        out_shape=[jax.ShapeDtypeStruct((B, H * V), v.dtype), jax.ShapeDtypeStruct(s.shape, f32)],
        scratch_shapes=[pltpu.VMEM((P, V, rows), f32)],
        input_output_aliases={4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name=MOSAIC_STEP_KERNEL,
    )(q, k, g, v, s)


def mosaic_gla_step(
    q: Array, k: Array, v: Array, g: Array, state: Array, *, scale: float, interpret: bool = False
) -> tuple[Array, Array]:
    """One token: q, k, g [B, H, K]; v [B, H, V]; state [B, H, K, V] fp32 -> (o [B, H, V] in v's
    dtype, state'). Pass the state donated: the kernel updates it in place. (o's [B, H, V] is a
    view of the kernel's [B, H * V] rows, which a caller reshaping back reads without a copy.)"""
    lanes_last = lambda x: jnp.moveaxis(x, 0, -1)  # noqa: E731  [B, ...] -> [..., B]
    q, k, g, v = (lanes_last(x) for x in (q, k, g.astype(f32), v))
    o, s = _call(q, k, g, v, lanes_last(state.astype(f32)), scale, interpret)
    return o.reshape(v.shape[-1], *v.shape[:2]), jnp.moveaxis(s, -1, 0)
