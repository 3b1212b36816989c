"""Newton-Schulz orthogonalisation and its distribution over a mesh axis by two all-to-alls.

Every Muon matrix of every layer goes into one flat list. Each matrix gets an owner rank
(greedy longest-processing-time on NS FLOPs). Ranks hold 1/N of every matrix: a block of rows
or of columns, whichever axis the parameter is sharded on. All-to-all #1 sends every rank's
block of each matrix to its owner, owners run NS on whole matrices, all-to-all #2 returns each
rank its block of every result.

Every rank runs the same program, with no branch on the rank (Neuron has no ``lax.cond`` or
``switch``): matrices are grouped by shape, and for each group every rank works through the
same number of slots, k_g = the most matrices of that group any rank owns. A rank's slots
pick its own matrices from the received buffer through a static offset table indexed by the
axis index; slots it does not need (where a group's count is not a multiple of N) read zeros
and write past each segment. The owners are assigned with at most ceil(count_g / N) matrices
of a group per rank, which makes k_g as small as it can be. N = 1 is the same code without
collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.parallel import as_wire
from laplace_jax.platform import per_platform

Array = jax.Array
LANES = (256, 128, 64, 32, 16, 8, 4, 2)  # the exchange buffer's row widths, widest first (see ``lane_width``)
PADDING = 1.25  # the most a row width may grow the payload by (its blocks' columns padded to whole rows)
ALIGN = 16  # at 128 lanes or more, each block starts at a multiple of this many rows (a 16-bit tile's)


def newton_schulz(x: Array, coeffs: Sequence[float], steps: int | Array, eps: float) -> Array:
    """Approximate U V^T of x [..., m, n] (whole matrices; fp32 in, fp32 out).

    Works on the wide orientation, normalises each matrix by its Frobenius norm, then runs
    ``steps`` quintic iterations X <- a X + (b A + c A A) X with A = X X^T.
    """
    a, b, c = coeffs
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + eps)

    def iteration(_, x):
        gram = x @ jnp.swapaxes(x, -1, -2)
        return a * x + (b * gram + c * gram @ gram) @ x

    # A TPU runs a static count unrolled: around the loop it copied the carried matrices every
    # iteration (2.2 ms of the 340M train step on v5e:2x2, compiler estimate); XLA:CPU runs the
    # loop faster than the unrolled steps.
    loop = functools.partial(jax.lax.fori_loop, 0, steps, iteration)
    x = per_platform(x, default=loop, tpu=functools.partial(loop, unroll=True)) if isinstance(steps, int) else loop(x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def ns_flops(m: int, n: int) -> float:
    """FLOPs of one NS iteration on an m x n matrix (wide orientation p <= q)."""
    p, q = min(m, n), max(m, n)
    return 4 * p * p * q + 2 * p**3


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static assignment of matrices to owner ranks and the all-to-all buffer layout.

    shapes[i]: (rows, cols) of matrix i, its split axis padded to a multiple of N; split[i]: 0 if
    ranks hold row blocks, 1 if column blocks (which travel transposed, as row blocks of the
    transpose: the owner runs NS on the transpose, NS(X^T) = NS(X)^T, so no block is narrower
    than its matrix); owner[i]: its rank. Every rank sends and receives an [N * S, L] buffer:
    ``lanes`` L wide, a ``segment`` of S rows per rank, each owner's matrices group after group
    (``layout``). A rank's block of matrix i lies in the owner's segment from row offset[i], as
    its columns cut into L-wide slabs (the last one zero-padded) stacked one under the other
    (``_slabs``): slicing and joining whole lane tiles, never a reshape that regroups elements,
    which on a TPU is a relayout of every element (splitting the leading axis into N segments of
    aligned rows is not one).
    """

    n_ranks: int
    shapes: tuple[tuple[int, int], ...]
    split: tuple[int, ...]
    owner: tuple[int, ...]
    offset: tuple[int, ...]
    segment: int
    lanes: int
    flops: tuple[float, ...]  # per NS iteration

    def layout(self) -> list[tuple[tuple[int, int], int, list[list[int]]]]:
        """Every segment's layout, group after group (``slots()``' order): a rank's block shape (a
        column block travels transposed, as rows of the transpose), its rows in the buffer
        (``_rows``), and per rank the matrices of its slots."""
        out = []
        for (m, n, ax), per_rank in self.slots().items():
            block = _block_shape((m, n), ax, self.n_ranks)
            out.append((block, _rows(block, self.lanes), per_rank))
        return out

    def matrices_of(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o == rank]

    def rank_flops(self) -> list[float]:
        """NS FLOPs (per iteration) of the matrices each rank owns."""
        out = [0.0] * self.n_ranks
        for i, o in enumerate(self.owner):
            out[o] += self.flops[i]
        return out

    def slots(self) -> dict[tuple[int, int, int], list[list[int]]]:
        """(rows, cols, split) -> per rank, the matrices it owns in that group, padded with -1 to
        the group's slot count (the most any rank owns)."""
        groups: dict[tuple[int, int, int], list[list[int]]] = {}
        for i, ((m, n), ax, o) in enumerate(zip(self.shapes, self.split, self.owner, strict=True)):
            groups.setdefault((m, n, ax), [[] for _ in range(self.n_ranks)])[o].append(i)
        for per_rank in groups.values():
            k = max(len(x) for x in per_rank)
            for x in per_rank:
                x += [-1] * (k - len(x))
        return groups

    def executed_flops(self) -> float:
        """NS FLOPs (per iteration) every rank runs: each group's slots, padding included."""
        return sum(len(per_rank[0]) * ns_flops(*shape[:2]) for shape, per_rank in self.slots().items())


def make_plan(shapes: Sequence[tuple[int, int]], n_ranks: int, split: Sequence[int] | None = None) -> Plan:
    """Greedy LPT: matrices by decreasing NS FLOPs, each to the currently least-loaded rank that
    holds fewer than ceil(count / N) of its shape group (so no group needs more slots than that)."""
    split = tuple(split) if split is not None else (0,) * len(shapes)
    up = lambda d: math.ceil(d / n_ranks) * n_ranks  # noqa: E731
    padded = tuple((up(m), n) if ax == 0 else (m, up(n)) for (m, n), ax in zip(shapes, split, strict=True))
    flops = tuple(ns_flops(m, n) for m, n in shapes)
    group = [(*p, ax) for p, ax in zip(padded, split, strict=True)]
    cap = {g: math.ceil(group.count(g) / n_ranks) for g in set(group)}
    held = {g: [0] * n_ranks for g in cap}
    load = [0.0] * n_ranks
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-flops[i], i)):
        g = group[i]
        r = min((r for r in range(n_ranks) if held[g][r] < cap[g]), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += flops[i]
        held[g][r] += 1
    lanes = lane_width([_block_shape(p, ax, n_ranks) for p, ax in zip(padded, split, strict=True)])
    plan = Plan(n_ranks, padded, split, tuple(owner), (), 0, lanes, flops)
    offset, used = [0] * len(shapes), [0] * n_ranks
    for _, rows, per_rank in plan.layout():  # an owner's segment: its matrices group after group
        for o, mine in enumerate(per_rank):
            for i in (i for i in mine if i >= 0):
                offset[i], used[o] = used[o], used[o] + rows
    return dataclasses.replace(plan, offset=tuple(offset), segment=max([*used, 1]))


def lane_width(blocks: Sequence[tuple[int, int]]) -> int:
    """The widest of ``LANES`` at which padding every block's columns to whole rows grows the
    payload by at most ``PADDING`` (256 for the configs' matrices: 2 or 4 lane tiles; a tiny
    test model's narrow blocks get a narrower row). Even, so ``as_wire`` can pair its halves."""
    elements = sum(a * b for a, b in blocks) or 1
    fits = [w for w in LANES if sum(_rows(blk, w) * w for blk in blocks) <= PADDING * elements]
    return fits[0] if fits else LANES[-1]


def _block_shape(shape: tuple[int, int], ax: int, n_ranks: int) -> tuple[int, int]:
    """One rank's block of a matrix as it travels: its rows, or (``ax`` 1) rows of its transpose."""
    m, n = shape
    return (m // n_ranks, n) if ax == 0 else (n // n_ranks, m)


def _align(rows: int, lanes: int) -> int:
    step = ALIGN if lanes >= 128 else 1
    return -(-rows // step) * step


def _rows(shape: tuple[int, int], lanes: int) -> int:
    a, b = shape
    return _align(a * -(-b // lanes), lanes)


def _slabs(block_AxB: Array, lanes: int) -> Array:
    """[.., block_rows, lanes]: the block's columns in L-wide slabs (the last zero-padded), stacked
    (leading axes, one block each, kept)."""
    a, b = block_AxB.shape[-2:]
    k = -(-b // lanes)
    lead = [(0, 0)] * (block_AxB.ndim - 2)
    x = jnp.pad(block_AxB, (*lead, (0, 0), (0, k * lanes - b)))
    x = jnp.concatenate([x[..., j * lanes : (j + 1) * lanes] for j in range(k)], axis=-2)
    return jnp.pad(x, (*lead, (0, _rows((a, b), lanes) - k * a), (0, 0)))


def _block(buf_RxL: Array, row: Array | int, shape: tuple[int, int]) -> Array:
    """The block of ``shape`` whose slabs start at ``row`` of an exchange buffer [.., R, L] (leading
    axes kept: [N, S, L] gives every rank's block at the same row of its segment)."""
    a, b = shape
    L = buf_RxL.shape[-1]
    k = -(-b // L)
    x = jax.lax.dynamic_slice_in_dim(buf_RxL, row, k * a, axis=buf_RxL.ndim - 2)
    return jnp.concatenate([x[..., j * a : (j + 1) * a, :] for j in range(k)], axis=-1)[..., :b]


def _pack(plan: Plan, blocks: Sequence[Array]) -> Array:
    """The [N * S, L] send buffer: segment o holds the slabs of this rank's blocks of the
    matrices rank o owns (already in the wire's dtype), at their offsets, zero-padded. One
    concatenation of whole tiles: no stack of per-rank rows (a TPU pads and merges each)."""
    pieces = []
    for o in range(plan.n_ranks):
        mine = [_slabs(blocks[i], plan.lanes) for _, i in sorted((plan.offset[i], i) for i in plan.matrices_of(o))]
        rows = sum(x.shape[0] for x in mine)
        pieces += [*mine, jnp.zeros((plan.segment - rows, plan.lanes), blocks[0].dtype)]
    return jnp.concatenate(pieces)


def _exchange(buf_RxL: Array, axis_name: str | None, n_ranks: int) -> Array:
    """One all-to-all of the buffer's N segments over ``axis_name`` (nothing with one rank), in its
    dtype: a 16-bit float as itself where the program is compiled for a TPU, elsewhere as pairs of
    its bits in uint32 words (``as_wire``: XLA:CPU widens 16-bit float collectives)."""
    if n_ranks == 1:
        return buf_RxL
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
    return per_platform(buf_RxL, default=lambda x: as_wire(exchange, x, pairs=True), tpu=exchange)


def _owned_results(
    recv_RxL: Array, plan: Plan, me: Array | int, coeffs: Sequence[float], steps: int | Array, eps: float
) -> Array:
    """NS of the matrices rank ``me`` owns, from the received buffer (rank r's blocks in segment
    r), as the buffer to send back (rank r's blocks of the results in segment r), both in the
    wire's dtype (NS itself in fp32). The same program on every rank: each shape group's slots
    read this rank's offsets from a static table; a slot it does not fill (-1) reads zeros and
    writes to a tail past each segment, which exists only where some group has such a slot."""
    N, S, L = plan.n_ranks, plan.segment, plan.lanes
    layout = plan.layout()
    tail = max([rows for _, rows, per_rank in layout if min(min(x) for x in per_rank) < 0], default=0)
    # [N, S, L]: segment r is rank r's (splitting the leading axis at whole aligned rows moves
    # nothing), so one slice reads a slot's block from every rank and one update writes them back:
    # per slot a handful of ops, not N of each (at 64 ranks those cost the 3B's 32k plan 2.3 GB of
    # the TPU compiler's host memory).
    recv = recv_RxL.reshape(N, S, L)
    out = jnp.zeros((N, S + tail, L), recv_RxL.dtype)
    for (a, b), _, per_rank in layout:
        table = np.asarray([[plan.offset[i] if i >= 0 else -1 for i in row] for row in per_rank], np.int32)
        offsets = jnp.asarray(table)[me]  # [k]: this rank's offsets in the group
        valid = offsets >= 0
        at = jnp.maximum(offsets, 0)
        wholes = [_block(recv, o, (a, b)).reshape(N * a, b) for o in at]
        x = jnp.where(valid[:, None, None], jnp.stack(wholes).astype(jnp.float32), 0.0)
        result = newton_schulz(x, coeffs, steps, eps).astype(recv_RxL.dtype)
        for res, o, ok in zip(result, at, valid, strict=True):
            slabs = _slabs(res.reshape(N, a, b), L)  # rank r's block of the result in row r
            out = jax.lax.dynamic_update_slice_in_dim(out, slabs, jnp.where(ok, o, S), axis=1)
    return out[:, :S].reshape(N * S, L)


def distributed_newton_schulz(
    blocks: list[Array],
    plan: Plan,
    *,
    axis_name: str | None,
    coeffs: Sequence[float],
    steps: int | Array,
    eps: float,
    comm_dtype: jnp.dtype | None = None,
) -> list[Array]:
    """Orthogonalise matrices held as blocks over ranks. Runs inside ``shard_map`` when N > 1.

    blocks[i]: this rank's block of matrix i (fp32): [rows / N, cols] or [rows, cols / N] as
    ``plan.split[i]`` says. Returns the matching blocks of NS(matrix i). With N == 1 the blocks
    are the whole matrices and no collective runs.
    """
    N = plan.n_ranks
    f32 = jnp.float32
    wire = comm_dtype or f32

    # All-to-all #1: segment o of the send buffer holds my blocks of the matrices rank o owns.
    # Blocks are cast to the wire's dtype first and back to fp32 last, so with a 16-bit wire
    # every slab and slice moves 2 bytes an element (the same values as casting at the wire).
    sent = [b.astype(wire) if ax == 0 else b.astype(wire).T for b, ax in zip(blocks, plan.split, strict=True)]
    received = _exchange(_pack(plan, sent), axis_name, N)  # segment r: rank r's blocks

    me = jax.lax.axis_index(axis_name) if N > 1 else 0
    results = _owned_results(received, plan, me, coeffs, steps, eps)
    # All-to-all #2: segment o now holds my blocks of the results of the matrices rank o owns.
    returned = _exchange(results, axis_name, N)
    S = plan.segment
    mine = [_block(returned, plan.owner[i] * S + plan.offset[i], b.shape) for i, b in enumerate(sent)]
    return [(b if ax == 0 else b.T).astype(f32) for b, ax in zip(mine, plan.split, strict=True)]
