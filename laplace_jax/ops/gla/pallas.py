"""Chunkwise GLA as Pallas kernels (forward and backward), written for Pallas' Triton lowering on GPU.

Same recurrence, signature and numerics contract as ``chunk_gla`` (``ops/gla/chunk.py``); on CPU it runs
with ``interpret=True`` (tests), and ``model.attn_impl="auto"`` picks it only on GPU.

Why Triton and not Mosaic GPU: the Mosaic GPU lowering in jax 0.10 has no ``dot_general``,
``cumsum`` or transpose rule; matmuls go through ``wgmma`` with M a multiple of 64, so the
16-token sub-blocks the exact decay factoring needs cannot be expressed. The Triton lowering
has 2-D dots with M, N, K >= 16 and fp32 (``HIGHEST``) dots. It is deprecated from jax 0.11,
not removed (BENCHMARKS.md, "Pallas kernel: status").

Work split (as flash-linear-attention's chunk_gla): only the chunk-boundary states are a
sequential pass; everything inside a chunk runs in parallel over chunks.

- ``gla_states`` (grid batch*head x key tiles x value tiles): walks the chunks, writes each
  chunk's start state S_c [K, V] fp32 and the final state. A state tile is [BK, BV] fp32 in
  registers; the decay is diagonal in K, so key tiles are independent.
- ``gla_scores`` (grid chunks x batch*head x 16-row query sub-blocks): that row panel of the
  causal scores A [C, C], exact decays, stored in the input dtype (A is only a dot operand).
- ``gla_out`` (grid chunks x batch*head x value tiles): o = s (q e^{b_in}) S_c + A v, in blocks
  of 64 rows (wgmma-sized).
- backward: ``gla_dstates`` (the reverse state pass: dH_c, the gradient on the state at the end
  of chunk c, and d initial state), ``gla_scores`` again, ``gla_dscores`` (tril(do v^T), fp32:
  the gate gradient uses it elementwise), ``gla_dqkg`` (grid chunks x batch*head x key tiles:
  dq, dk and the gate gradient, all per key column) and ``gla_dv`` (per value tile:
  (k e^{b_out}) dH_c + A^T do).

Decays: per 16-row sub-block, the in-sub-block sums ``head`` (start .. r) and ``tail``
(r exclusive .. end) and the chunk-level ``b_in`` (chunk start .. r) and ``b_out`` (r exclusive
.. chunk end) are computed once by XLA as sums of whole sub-blocks and in-sub-block sums (all
terms <= 0: nothing cancels). In the kernels a query row r of sub-block i and a key row s of an
earlier sub-block j meet through e^{head_r} e^{tail_s + gap}, gap the sum of the whole
sub-blocks strictly between (a running sum in the loop); pairs inside one sub-block take the
pairwise sum over s < t <= r. Nothing is a difference of cumulative sums.

Dots: operands in the input dtype with fp32 accumulation (bf16 -> tensor cores) for every
product of inputs, decayed inputs, scores, score gradients and states; fp32 at ``HIGHEST``
(IEEE, CUDA cores) only for 0/1 triangular matrices that sum log-decays or gate-gradient terms
inside a sub-block (Triton has no reverse cumsum, and a bf16 sum would round the terms).

The gate gradient is built from pair sums (the same derivation as ``chunk.py``): a pair
(r, s), s < r, adds P[r, s] = dA[r, s] s q_r k_s e^{b_r - b_s} to every g_t with s < t <= r.
``gla_dqkg`` writes, per row, the reverse sums over its sub-block of q * dq (keys before the
sub-block) and the exclusive forward sums of k * dk (queries after it) plus the diagonal pairs;
what reaches a whole sub-block at once (a sub-block pair straddling it, a query whose key lies
before the chunk, a key whose query lies after it, and e^{b_C} rowsum(S_c * dH_c) for pairs
straddling the chunk) goes to one row per (chunk, sub-block), added to its 16 rows by XLA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from laplace_jax.ops.gla import pallas_blocks as blk
from laplace_jax.ops.gla.limits import chunk_size_problem
from laplace_jax.ops.gla.pallas_blocks import SUB, Tiling, f32, key_tiles, last_row, load, mm, value_tiles
from laplace_jax.ops.gla.sums import excl_cumsum, rev_excl_cumsum
from laplace_jax.platform import on_gpu

Array = jax.Array

# Triton launch options per kernel (tools.gpu_check reads them), chosen from the static report's
# sweep at the 3B layer (BENCHMARKS.md: "python -m laplace_jax.tools.gpu_check --shape 3b --sweep")
LAUNCH = {
    "gla_states": {"num_warps": 8, "num_stages": 2},  # the fewest registers of any setting without spills
    "gla_scores": {"num_warps": 4, "num_stages": 2},
    "gla_out": {"num_warps": 4, "num_stages": 2},
    "gla_dstates": {"num_warps": 8, "num_stages": 2},
    "gla_dscores": {"num_warps": 4, "num_stages": 2},
    "gla_dqkg": {"num_warps": 8, "num_stages": 1},  # 4 warps spill at 2 and 3 stages, sit at 255 registers at 1
    "gla_dv": {"num_warps": 4, "num_stages": 2},
}


def _next_pow2(n: int, least: int = SUB) -> int:
    return max(least, 1 << (n - 1).bit_length())


class Decays(NamedTuple):
    """Direct sums of log-decays, each [B, T, H, K] fp32 (see the module docstring)."""

    head: Array
    tail: Array
    b_in: Array
    b_out: Array


def decay_sums(g: Array, C: int) -> Decays:
    """The four decay sums of g [B, T, H, K] (T a multiple of C), from in-sub-block cumulative sums
    and sums of whole sub-blocks: every one a sum of terms <= 0."""
    B, T, H, K = g.shape
    gs = g.astype(f32).reshape(B, T // C, C // SUB, SUB, H, K)
    head = jnp.cumsum(gs, axis=3)
    tail = rev_excl_cumsum(gs, 3)
    whole = jnp.sum(gs, axis=3, keepdims=True)  # [B, N, n, 1, H, K]
    before, after = excl_cumsum(whole, 2), rev_excl_cumsum(whole, 2)
    return Decays(*(x.reshape(B, T, H, K) for x in (head, tail, head + before, tail + after)))


def _states_kernel(k_ref, v_ref, bout_ref, bin_ref, s0_ref, st_ref, sT_ref, *, t: Tiling):
    """One (batch*head, key tile, value tile): k, b_out, b_in [T, BK], v [T, BV], s0 [BK, BV] ->
    chunk-start states [N, BK, BV] and the final state [BK, BV], fp32."""
    C = t.C

    def chunk(c, S):
        st_ref[c] = S
        r0 = c * C
        kd = load(k_ref, r0, rows=C) * jnp.exp(load(bout_ref, r0, rows=C))  # decayed to the chunk end
        b_C = load(bin_ref, r0 + C - 1, rows=1)  # [1, BK]: the chunk's whole log-decay
        return jnp.exp(b_C).T * S + mm(kd, v_ref[pl.ds(r0, C), :], (0, 0), t.dtype)

    sT_ref[...] = jax.lax.fori_loop(0, k_ref.shape[0] // C, chunk, s0_ref[...].astype(f32))


def _dstates_kernel(q_ref, do_ref, bin_ref, dsT_ref, dst_ref, ds0_ref, *, t: Tiling):
    """The reverse state pass of one (batch*head, key tile, value tile): dH_c [N, BK, BV] (the
    gradient on the state at the end of chunk c) and d initial state [BK, BV], fp32."""
    C, N = t.C, q_ref.shape[0] // t.C

    def chunk(cc, dH):
        c = N - 1 - cc
        dst_ref[c] = dH
        r0 = c * C
        qb = load(q_ref, r0, rows=C) * (t.scale * jnp.exp(load(bin_ref, r0, rows=C)))
        b_C = load(bin_ref, r0 + C - 1, rows=1)
        return jnp.exp(b_C).T * dH + mm(qb, do_ref[pl.ds(r0, C), :], (0, 0), t.dtype)

    ds0_ref[...] = jax.lax.fori_loop(0, N, chunk, dsT_ref[...].astype(f32))


def _scores_kernel(q_ref, k_ref, g_ref, head_ref, tail_ref, a_ref, *, t: Tiling):
    """One (chunk, batch*head, query sub-block i): q, k, g and decays [C, K] -> row panel i of the
    causal scores, a [16, C] (zero right of the diagonal)."""
    i = pl.program_id(2)
    r0 = i * SUB
    q = key_tiles(q_ref, r0, t)
    qh = [a * jnp.exp(b) for a, b in zip(q, key_tiles(head_ref, r0, t), strict=True)]

    def blank(j, carry):
        a_ref[:, pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), a_ref.dtype)
        return carry

    def earlier(jj, gap):  # key sub-block j = i-1-jj; gap: the whole sub-blocks between j and i
        j0 = (i - 1 - jj) * SUB
        k, tail = key_tiles(k_ref, j0, t), key_tiles(tail_ref, j0, t)
        kd = [a * jnp.exp(b + c) for a, b, c in zip(k, tail, gap, strict=True)]
        a_ref[:, pl.ds(j0, SUB)] = blk.off_scores(qh, kd, t).astype(a_ref.dtype)
        return [a + b for a, b in zip(gap, last_row(head_ref, j0, t), strict=True)]

    jax.lax.fori_loop(i + 1, t.n, blank, 0)
    jax.lax.fori_loop(0, i, earlier, [jnp.zeros((1, t.BK), f32)] * t.nk)
    A = blk.diag_scores(q, key_tiles(k_ref, r0, t), key_tiles(g_ref, r0, t), t)
    a_ref[:, pl.ds(r0, SUB)] = A.astype(a_ref.dtype)


def _dscores_kernel(do_ref, v_ref, da_ref, *, t: Tiling):
    """One (chunk, batch*head, query sub-block i): do, v [C, V] -> row panel i of the score
    gradient tril(do v^T), da [16, C] fp32."""
    i = pl.program_id(2)
    r0 = i * SUB
    dA = sum(
        mm(a, v_ref[:, pl.ds(vt * t.BV, t.BV)], (1, 1), t.dtype) for vt, a in enumerate(value_tiles(do_ref, r0, t))
    )
    cols = jax.lax.broadcasted_iota(jnp.int32, dA.shape, 1)
    rows = jax.lax.broadcasted_iota(jnp.int32, dA.shape, 0) + r0
    da_ref[...] = jnp.where(cols <= rows, dA, 0.0)


def _out_kernel(q_ref, bin_ref, v_ref, st_ref, a_ref, o_ref, *, t: Tiling):
    """One (chunk, batch*head, value tile): q, b_in [C, K], v [C, BV], S_c [K, BV], scores [C, C]
    -> o = s (q e^{b_in}) S_c + A v [C, BV], in blocks of R rows."""
    R = t.R

    def rows(rb, carry):
        r0 = rb * R
        q, b_in = key_tiles(q_ref, r0, t, rows=R), key_tiles(bin_ref, r0, t, rows=R)
        o = sum(
            mm(a * (t.scale * jnp.exp(b)), st_ref[pl.ds(kt * t.BK, t.BK), :], dtype=t.dtype)
            for kt, (a, b) in enumerate(zip(q, b_in, strict=True))
        )

        def earlier(cb, o):
            c0 = cb * R
            return o + mm(a_ref[pl.ds(r0, R), pl.ds(c0, R)], v_ref[pl.ds(c0, R), :], dtype=t.dtype)

        o = jax.lax.fori_loop(0, rb + 1, earlier, o)
        o_ref[pl.ds(r0, R), :] = o.astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, t.C // R, rows, 0)


def _dv_kernel(k_ref, bout_ref, do_ref, ds_ref, a_ref, dv_ref, *, t: Tiling):
    """One (chunk, batch*head, value tile): k, b_out [C, K], do [C, BV], dH_c [K, BV], scores
    [C, C] -> dv = (k e^{b_out}) dH_c + A^T do [C, BV], in blocks of R rows."""
    R = t.R

    def cols(cb, carry):
        c0 = cb * R
        k, b_out = key_tiles(k_ref, c0, t, rows=R), key_tiles(bout_ref, c0, t, rows=R)
        dv = sum(
            mm(a * jnp.exp(b), ds_ref[pl.ds(kt * t.BK, t.BK), :], dtype=t.dtype)
            for kt, (a, b) in enumerate(zip(k, b_out, strict=True))
        )

        def later(rb, dv):
            r0 = rb * R
            return dv + mm(a_ref[pl.ds(r0, R), pl.ds(c0, R)], do_ref[pl.ds(r0, R), :], (0, 0), t.dtype)

        dv = jax.lax.fori_loop(cb, t.C // R, later, dv)
        dv_ref[pl.ds(c0, R), :] = dv.astype(dv_ref.dtype)
        return carry

    jax.lax.fori_loop(0, t.C // R, cols, 0)


def _dqkg_kernel(
    q_ref, k_ref, g_ref, head_ref, tail_ref, bin_ref, bout_ref, v_ref, do_ref, s_ref, ds_ref, da_ref,
    dq_ref, dk_ref, dg_ref, dgx_ref, *, t: Tiling,
):  # fmt: skip
    """One (chunk, batch*head, key tile): q, k, g and decays [C, BK], v, do [C, V], S_c and dH_c
    [BK, V], the score gradient [C, C] -> dq, dk and the gate gradient's per-row part [C, BK],
    and its per-sub-block part dgx [NP, BK] (one row per sub-block, added to the sub-block's 16
    rows outside), fp32."""
    m_rows = jax.lax.broadcasted_iota(jnp.int32, dgx_ref.shape, 0)  # [NP, BK]: sub-block index
    S, dH = ([ref[:, pl.ds(vt * t.BV, t.BV)] for vt in range(t.nv)] for ref in (s_ref, ds_ref))

    def block(m, dgx):
        r0 = m * SUB
        refs = (q_ref, k_ref, g_ref, head_ref, tail_ref, bin_ref, bout_ref)
        q, k, g, head, tail, b_in, b_out = (load(x, r0) for x in refs)
        do_m, v_m = value_tiles(do_ref, r0, t), value_tiles(v_ref, r0, t)
        dq_st = t.scale * jnp.exp(b_in) * sum(mm(a, b, (1, 1), t.dtype) for a, b in zip(do_m, S, strict=True))
        dk_st = jnp.exp(b_out) * sum(mm(a, b, (1, 1), t.dtype) for a, b in zip(v_m, dH, strict=True))
        qh = q * jnp.exp(head)

        def earlier(jj, carry):  # key sub-block j = m-1-jj: dq, and the pairs' totals on sub-blocks between
            acc, gap, dgx = carry
            j0 = (m - 1 - jj) * SUB
            kd = load(k_ref, j0) * jnp.exp(load(tail_ref, j0) + gap)
            part = mm(load(da_ref, r0, j0, SUB), kd, dtype=t.dtype)
            pairs = t.scale * jnp.sum(qh * part, axis=0, keepdims=True)
            dgx = dgx + jnp.where((m_rows > m - 1 - jj) & (m_rows < m), pairs, 0.0)
            return acc + part, gap + load(head_ref, j0 + SUB - 1, rows=1), dgx

        def later(ii, carry):  # query sub-block i = m+1+ii: dk
            acc, gap = carry
            i0 = (m + 1 + ii) * SUB
            qh_i = load(q_ref, i0) * jnp.exp(load(head_ref, i0))
            acc = acc + jnp.exp(gap) * mm(load(da_ref, i0, r0, SUB), qh_i, (0, 0), t.dtype)
            return acc, gap + load(head_ref, i0 + SUB - 1, rows=1)

        zero, zrow = jnp.zeros_like(q), jnp.zeros((1, t.BK), f32)
        acc_q, _, dgx = jax.lax.fori_loop(0, m, earlier, (zero, zrow, dgx))
        acc_k, _ = jax.lax.fori_loop(0, t.n - 1 - m, later, (zero, zrow))
        dq = dq_st + t.scale * jnp.exp(head) * acc_q
        dk = dk_st + t.scale * jnp.exp(tail) * acc_k
        dA_mm = load(da_ref, r0, r0, SUB)
        dq_d, dg_d = blk.diag_dq_dg(dA_mm, q, k, g)
        rows = pl.ds(r0, SUB)
        dq_ref[rows, :] = dq + t.scale * dq_d
        dk_ref[rows, :] = dk + t.scale * blk.diag_dk(dA_mm, q, g)
        dg_ref[rows, :] = blk.rev_sum(q * dq) + blk.excl_sum(k * dk) + t.scale * dg_d
        # pairs with the key before the chunk reach the whole sub-blocks before m; with the query after it, after m
        dgx = dgx + jnp.where(m_rows < m, jnp.sum(q * dq_st, axis=0, keepdims=True), 0.0)
        return dgx + jnp.where(m_rows > m, jnp.sum(k * dk_st, axis=0, keepdims=True), 0.0)

    dgx = jax.lax.fori_loop(0, t.n, block, jnp.zeros(dgx_ref.shape, f32))
    # pairs straddling the whole chunk: e^{b_C} rowsum(S_c * dH_c), on every row
    through = sum(jnp.sum(a * b, axis=1, keepdims=True) for a, b in zip(S, dH, strict=True))  # [BK, 1]
    dgx_ref[...] = dgx + jnp.exp(load(bin_ref, t.C - 1, rows=1)) * through.T


class _Specs:
    """BlockSpecs over [B, T, H, D] inputs, [B, H, N, K, V] states and [B, H, N, C, C] scores
    for the two grid kinds: sequential (batch*head, key tile, value tile) and per chunk (chunk,
    batch*head, i), with i a query sub-block, a value tile or a key tile."""

    def __init__(self, H: int, T: int, t: Tiling):
        sq, C, BK, BV, N = pl.squeezed, t.C, t.BK, t.BV, T // t.C
        Kp, Vp, NP = t.nk * BK, t.nv * BV, t.NP

        def spec(block, index):  # index(b, h, chunk or key tile, i or value tile)
            return pl.BlockSpec(block, lambda a, x, i: index(x // H, x % H, a, i))

        def seq(block, index):  # grid (batch*head, key tile, value tile)
            return pl.BlockSpec(block, lambda x, i, j: index(x // H, x % H, i, j))

        self.seq_keys = seq((sq, T, sq, BK), lambda b, h, i, j: (b, 0, h, i))
        self.seq_vals = seq((sq, T, sq, BV), lambda b, h, i, j: (b, 0, h, j))
        self.seq_state = seq((sq, sq, BK, BV), lambda b, h, i, j: (b, h, i, j))
        self.seq_states = seq((sq, sq, N, BK, BV), lambda b, h, i, j: (b, h, 0, i, j))
        self.keys = spec((sq, C, sq, Kp), lambda b, h, c, i: (b, c, h, 0))
        self.vals = spec((sq, C, sq, Vp), lambda b, h, c, i: (b, c, h, 0))
        self.score_rows = spec((sq, sq, sq, SUB, C), lambda b, h, c, i: (b, h, c, i, 0))
        self.scores = spec((sq, sq, sq, C, C), lambda b, h, c, i: (b, h, c, 0, 0))
        self.vtile_vals = spec((sq, C, sq, BV), lambda b, h, c, i: (b, c, h, i))
        self.vtile_state = spec((sq, sq, sq, Kp, BV), lambda b, h, c, i: (b, h, c, 0, i))
        self.ktile_keys = spec((sq, C, sq, BK), lambda b, h, c, i: (b, c, h, i))
        self.ktile_state = spec((sq, sq, sq, BK, Vp), lambda b, h, c, i: (b, h, c, i, 0))
        self.ktile_rows = spec((sq, sq, sq, NP, BK), lambda b, h, c, i: (b, h, c, 0, i))


def _call(kernel, name: str, t: Tiling, grid, in_specs, out_specs, out_shape, interpret: bool):
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu_triton  # GPU only; interpret mode never loads it

        compiler_params = plgpu_triton.CompilerParams(**LAUNCH[name])
    return pl.pallas_call(
        functools.partial(kernel, t=t),
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )


def _state_pass(kernel, name, x, y, b_in, s, sp: _Specs, t: Tiling, interpret: bool, b_out=None):
    """The sequential pass over chunks (forward: x = k, y = v, b_out; backward: x = q, y = do):
    (per-chunk states [B, H, N, K, V], last state [B, H, K, V]), fp32."""
    B, T, H, Kp = x.shape
    Vp = y.shape[-1]
    decays = [b_in] if b_out is None else [b_out, b_in]
    return _call(
        kernel, name, t, (B * H, t.nk, t.nv),
        [sp.seq_keys, sp.seq_vals, *[sp.seq_keys] * len(decays), sp.seq_state], (sp.seq_states, sp.seq_state),
        (jax.ShapeDtypeStruct((B, H, T // t.C, Kp, Vp), f32), jax.ShapeDtypeStruct((B, H, Kp, Vp), f32)), interpret,
    )(x, y, *decays, s)  # fmt: skip


def _scores(q, k, g, dec: Decays, sp: _Specs, t: Tiling, interpret: bool) -> Array:
    """Causal in-chunk scores [B, H, N, C, C] in the input dtype (they are only dot operands)."""
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, H, T // t.C, t.C, t.C), q.dtype)
    return _call(_scores_kernel, "gla_scores", t, (T // t.C, B * H, t.n), [sp.keys] * 5, sp.score_rows, out, interpret)(
        q, k, g, dec.head, dec.tail
    )


def _forward(q, k, v, g, s0, t: Tiling, interpret: bool):
    """(o [B, T, H, V], final state [B, H, K, V], chunk-start states [B, H, N, K, V] fp32); padded inputs."""
    B, T, H, _ = q.shape
    sp = _Specs(H, T, t)
    dec = decay_sums(g, t.C)
    states, sT = _state_pass(_states_kernel, "gla_states", k, v, dec.b_in, s0, sp, t, interpret, b_out=dec.b_out)
    A = _scores(q, k, g, dec, sp, t, interpret)
    o = _call(
        _out_kernel, "gla_out", t, (T // t.C, B * H, t.nv),
        [sp.keys, sp.keys, sp.vtile_vals, sp.vtile_state, sp.scores], sp.vtile_vals,
        jax.ShapeDtypeStruct(v.shape, v.dtype), interpret,
    )(q, dec.b_in, v, states, A)  # fmt: skip
    return o, sT, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gla_padded(q, k, v, g, s0, t: Tiling, interpret: bool):
    o, sT, _ = _forward(q, k, v, g, s0, t, interpret)
    return o, sT


def _vjp_fwd(q, k, v, g, s0, t, interpret):
    o, sT, states = _forward(q, k, v, g, s0, t, interpret)
    return (o, sT), (q, k, v, g, checkpoint_name(states, "gla_states"))


def _vjp_bwd(t, interpret, res, cot):
    q, k, v, g, states = res
    do, dsT = cot
    B, T, H, Kp = q.shape
    N, n = T // t.C, t.n
    sp = _Specs(H, T, t)
    dec = decay_sums(g, t.C)
    do = do.astype(v.dtype)
    dstates, ds0 = _state_pass(_dstates_kernel, "gla_dstates", q, do, dec.b_in, dsT.astype(f32), sp, t, interpret)
    A = _scores(q, k, g, dec, sp, t, interpret)
    dA = _call(
        _dscores_kernel, "gla_dscores", t, (N, B * H, n), [sp.vals, sp.vals], sp.score_rows,
        jax.ShapeDtypeStruct((B, H, N, t.C, t.C), f32), interpret,
    )(do, v)  # fmt: skip
    per_key = jax.ShapeDtypeStruct(q.shape, f32)
    dq, dk, dg, dgx = _call(
        _dqkg_kernel, "gla_dqkg", t, (N, B * H, t.nk),
        [*[sp.ktile_keys] * 7, sp.vals, sp.vals, sp.ktile_state, sp.ktile_state, sp.scores],
        (sp.ktile_keys, sp.ktile_keys, sp.ktile_keys, sp.ktile_rows),
        (per_key, per_key, per_key, jax.ShapeDtypeStruct((B, H, N, t.NP, Kp), f32)), interpret,
    )(q, k, g, dec.head, dec.tail, dec.b_in, dec.b_out, v, do, states, dstates, dA)  # fmt: skip
    dv = _call(
        _dv_kernel, "gla_dv", t, (N, B * H, t.nv),
        [sp.keys, sp.keys, sp.vtile_vals, sp.vtile_state, sp.scores], sp.vtile_vals,
        jax.ShapeDtypeStruct(v.shape, v.dtype), interpret,
    )(k, dec.b_out, do, dstates, A)  # fmt: skip
    whole = jnp.repeat(dgx[:, :, :, :n], SUB, axis=3).reshape(B, H, T, Kp).transpose(0, 2, 1, 3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv, (dg + whole).astype(g.dtype), ds0


_gla_padded.defvjp(_vjp_fwd, _vjp_bwd)


def pallas_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    s0: Array,
    *,
    scale: float,
    chunk_size: int = 128,
    block_k: int = 32,
    block_v: int = 64,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Pallas GLA, checked inputs (see ``chunk_gla``): (o [B, T, H, V], final state [B, H, K, V] fp32).

    Pads T to a multiple of ``chunk_size`` (a power of two >= 16), K to a multiple of the key tile
    and V to a multiple of the value tile (each a power of two >= 16, at most ``block_k`` /
    ``block_v``), all state-neutrally (zero q, k, v and log-decay).
    """
    if (problem := chunk_size_problem("pallas", chunk_size)) is not None:
        raise ValueError(problem)
    T, K, V = q.shape[1], q.shape[3], v.shape[3]
    BK, BV = min(_next_pow2(block_k), _next_pow2(K)), min(_next_pow2(block_v), _next_pow2(V))
    Kp, Vp = -(-K // BK) * BK, -(-V // BV) * BV
    Tp = -(-T // chunk_size) * chunk_size

    def pad(x, t, d):
        return jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0), (0, d - x.shape[3])))

    q, k, g = (pad(x, Tp, Kp) for x in (q, k, g))
    v = pad(v, Tp, Vp)
    s0 = jnp.pad(s0.astype(f32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    t = Tiling(chunk_size, BK, Kp // BK, BV, Vp // BV, float(scale), jnp.dtype(q.dtype))
    o, sT = _gla_padded(q, k, v, g.astype(f32), s0, t, interpret)
    return o[:, :T, :, :V], sT[:, :, :K, :V]


def pallas_interpret() -> bool:
    """Whether the Pallas kernel must run interpreted on this backend (CPU), or raise where it
    cannot run at all (it is written for Pallas' Triton lowering: GPU only)."""
    if on_gpu():
        return False
    backend = jax.default_backend()
    if backend == "cpu":
        return True
    raise ValueError(
        f"the Pallas GLA kernel lowers only on GPU (Triton); this backend is {backend!r}. "
        "Use model.attn_impl='chunk' (or 'auto', which picks it here)."
    )
