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
axis index; slots it does not need read zeros and write to a scratch tail. The owners are
assigned with at most ceil(count_g / N) matrices of a group per rank, which makes k_g as small
as it can be. N = 1 is the same code without collectives.
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

Array = jax.Array
ROW = 256  # the exchange buffer's rows: two lane tiles, so a 16-bit payload's words (``as_wire``) are whole tiles


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

    x = jax.lax.fori_loop(0, steps, iteration, x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def ns_flops(m: int, n: int) -> float:
    """FLOPs of one NS iteration on an m x n matrix (wide orientation p <= q)."""
    p, q = min(m, n), max(m, n)
    return 4 * p * p * q + 2 * p**3


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static assignment of matrices to owner ranks and the all-to-all buffer layout.

    shapes[i]: (rows, cols) of matrix i, its split axis padded to a multiple of N; split[i]: 0 if
    ranks hold row blocks, 1 if column blocks; owner[i]: its rank;
    offset[i]: start of a rank's block of it (rows or columns, per split[i]) inside the owner's
    segment; segment: padded segment
    length S (elements, a multiple of ``ROW``) so every rank sends and receives an [N, S / ROW, ROW]
    buffer.
    """

    n_ranks: int
    shapes: tuple[tuple[int, int], ...]
    split: tuple[int, ...]
    owner: tuple[int, ...]
    offset: tuple[int, ...]
    segment: int
    flops: tuple[float, ...]  # per NS iteration

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
    offset = [0] * len(shapes)
    used = [0] * n_ranks
    for i, (m, n) in enumerate(padded):
        offset[i] = used[owner[i]]
        used[owner[i]] += m * n // n_ranks
    segment = -(-max([*used, 1]) // ROW) * ROW
    return Plan(n_ranks, padded, split, tuple(owner), tuple(offset), segment, flops)


def _pack(pieces_by_owner: dict[int, list[Array]], n_ranks: int, segment: int, wire: jnp.dtype) -> Array:
    """The [N, S / ROW, ROW] send buffer in ``wire``: row o holds the flattened pieces for rank o
    (already in ``wire``), zero-padded to S."""
    rows = []
    for o in range(n_ranks):
        flat = [p.reshape(-1) for p in pieces_by_owner.get(o, [])]
        row = jnp.concatenate(flat) if flat else jnp.zeros((0,), wire)
        rows.append(jnp.pad(row, (0, segment - row.shape[0])).reshape(-1, ROW))
    return jnp.stack(rows)


def _exchange(buf_NxRxL: Array, axis_name: str | None, n_ranks: int) -> Array:
    """One all-to-all of the buffer's ranks over ``axis_name`` (nothing with one rank), in its dtype."""
    if n_ranks == 1:
        return buf_NxRxL
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
    return as_wire(exchange, buf_NxRxL, pairs=True)


def _flat_rows(buf_NxRxL: Array) -> list[Array]:
    """Each rank's row of an exchange buffer, flat ([S]), taken apart one by one."""
    return [buf_NxRxL[r].reshape(-1) for r in range(buf_NxRxL.shape[0])]


def _block(row: Array, offset: Array | int, size: int, shape: tuple[int, ...]) -> Array:
    """The block of ``shape`` at ``offset`` of a flat row (offset -1: a slot with no matrix, at 0)."""
    return jax.lax.dynamic_slice_in_dim(row, jnp.maximum(offset, 0), size).reshape(shape)


def _owned_results(
    recv_NxRxL: Array, plan: Plan, me: Array | int, coeffs: Sequence[float], steps: int | Array, eps: float
) -> Array:
    """NS of the matrices rank ``me`` owns, from the received buffer (rank r's blocks at r), as the
    buffer to send back, both in the wire's dtype (NS itself in fp32). Each rank's row is sliced
    and written on its own, never as rows of one [N, S] array (which a TPU tiles N rows together:
    taking them apart again was a relayout). The same program on every rank: each shape group's
    slots read this rank's offsets from a static table (a -1 slot reads zeros and writes to a tail)."""
    N, S, wire = plan.n_ranks, plan.segment, recv_NxRxL.dtype
    rows = _flat_rows(recv_NxRxL)
    tail = max(m * n // N for m, n in plan.shapes)
    outs = [jnp.zeros((S + tail,), wire) for _ in range(N)]
    for (m, n, ax), per_rank in plan.slots().items():
        size, block = m * n // N, ((m // N, n) if ax == 0 else (m, n // N))  # ax: rank r's rows or columns
        table = np.asarray([[plan.offset[i] if i >= 0 else -1 for i in row] for row in per_rank], np.int32)
        offsets = jnp.asarray(table)[me]  # [k]: this rank's offsets in the group
        valid = offsets >= 0
        wholes = [jnp.concatenate([_block(row, o, size, block) for row in rows], ax) for o in offsets]
        x = jnp.where(valid[:, None, None], jnp.stack(wholes).astype(jnp.float32), 0.0)
        result = newton_schulz(x, coeffs, steps, eps).astype(wire)
        for res, o, ok in zip(result, offsets, valid, strict=True):
            at = jnp.where(ok, o, S)
            parts = jnp.split(res, N, axis=ax)
            outs = [
                jax.lax.dynamic_update_slice_in_dim(out, p.reshape(-1), at, 0)
                for out, p in zip(outs, parts, strict=True)
            ]
    return jnp.stack([out[:S].reshape(-1, ROW) for out in outs])


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
    N, S = plan.n_ranks, plan.segment
    f32 = jnp.float32
    wire = comm_dtype or f32

    # All-to-all #1: row o of the send buffer holds my blocks of the matrices rank o owns. Blocks
    # are cast to the wire's dtype first and back to fp32 last, so with a 16-bit wire every
    # flattening and slicing moves 2 bytes an element (the same values as casting at the wire).
    by_owner: dict[int, list[Array]] = {}
    for i, blk in enumerate(blocks):
        by_owner.setdefault(plan.owner[i], []).append(blk.astype(wire))
    received = _exchange(_pack(by_owner, N, S, wire), axis_name, N)  # row r: rank r's blocks of the matrices I own

    me = jax.lax.axis_index(axis_name) if N > 1 else 0
    results = _owned_results(received, plan, me, coeffs, steps, eps)
    # All-to-all #2: row o now holds my blocks of the results of the matrices rank o owns.
    returned = _exchange(results, axis_name, N)
    rows = _flat_rows(returned)
    return [_block(rows[plan.owner[i]], plan.offset[i], b.size, b.shape).astype(f32) for i, b in enumerate(blocks)]
