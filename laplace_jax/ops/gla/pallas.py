"""Chunkwise GLA as Pallas kernels (forward and backward), written for Pallas' Triton lowering on GPU.

Same recurrence, signature and numerics contract as ``chunk_gla`` (``ops/gla/chunk.py``); on CPU it runs
with ``interpret=True`` (tests), and ``model.attn_impl="auto"`` picks it only on GPU.

Why Triton and not Mosaic GPU: the Mosaic GPU lowering in jax 0.10 has no ``dot_general``,
``cumsum`` or transpose rule; matmuls go through ``wgmma`` with M a multiple of 64, so the
16-token sub-blocks the exact decay factoring needs cannot be expressed. The Triton lowering
has 2-D dots with M, N, K >= 16 and fp32 (``HIGHEST``) dots. It is deprecated from jax 0.11,
not removed (BENCHMARKS.md, "Pallas kernel: status").

Grid: one program per (batch, head, value tile of ``block_v`` columns). Each program walks the
sequence chunk by chunk with the fp32 state tile [K, block_v] carried in registers (a recurrence
cannot be a GPU grid axis: grid points run in parallel). Per chunk of C tokens it works on
16-token sub-blocks, so every dot is 2-D with all sides >= 16 and every block a power of two
(K and V are zero-padded to powers of two outside the kernel; a zero key column and a zero gate
leave the recurrence unchanged).

Exactness, as in the XLA kernel: every decay factor is exp of a *direct* sum of log-decays
(each <= 0). Inside a sub-block the sums are dots with 0/1 triangular masks (fp32, HIGHEST):
``head`` (block start .. r, inclusive) and ``tail`` (r exclusive .. block end); between
sub-blocks they are running sums of whole-block totals carried by the loops (``prefix``,
``gap``, ``suffix``); the diagonal sub-blocks take, per key column s, the pairwise sum over
s < t <= r as one masked dot. Nothing is a difference of cumulative sums.

Backward (``jax.custom_vjp``): the forward saves the chunk-start states [B, H, N, K, V] fp32
(tagged ``gla_states`` for ``model.remat="save_gla"``) and the inputs; the scores are
recomputed. One backward program per (batch, head, value tile) walks the chunks in reverse
with dS (the gradient on the chunk-end state) in registers and writes dv, dS0, and its value
tile's share of dq, dk and dg (summed over tiles outside the kernel).

The gate gradient is built from pair sums, with no difference of large terms (the same
derivation as ``gla_chunk``): a pair (r, s), s < r, adds P[r, s] = dA[r, s] s q_r k_s e^{b_r - b_s}
to every g_t with s < t <= r. Inside a sub-block the kernel writes the reverse sums over r of
q * dq (pairs whose key lies before the sub-block) and the forward sums over s of k * dk (pairs
whose query lies after it), both as 0/1 triangular dots; the diagonal pairs reach t through one
masked reverse sum per key row. What reaches a whole sub-block at once (a sub-block pair that
straddles it, a query after the chunk start's state, a key whose state reaches a later chunk,
and the chunk's own decay e^{b_C} rowsum(S * dS)) goes to a per-(chunk, sub-block) row, added
to the sub-block's 16 rows outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from laplace_jax.config import SUB_BLOCK
from laplace_jax.platform import on_gpu

Array = jax.Array

SUB = SUB_BLOCK  # sub-block rows: the smallest side a Triton dot accepts
f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _next_pow2(n: int, least: int = SUB) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _mm(a: Array, b: Array, contract: tuple[int, int] = (1, 0), dtype=f32) -> Array:
    """2-D dot with fp32 accumulation; operands cast to ``dtype`` (fp32 runs at HIGHEST: IEEE, no TF32)."""
    precision = HIGHEST if dtype == f32 else None
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=f32)


def _iota(axis: int) -> Array:
    return jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), axis)


def _head_tail(g: Array) -> tuple[Array, Array]:
    """e^{sum_{start <= t <= r} g_t} and e^{sum_{r < t <= end} g_t} of one sub-block g [16, K]."""
    r, t = _iota(0), _iota(1)
    head = jnp.exp(_mm(jnp.where(t <= r, 1.0, 0.0), g))
    tail = jnp.exp(_mm(jnp.where(t > r, 1.0, 0.0), g))
    return head, tail


def _pair_decay(g: Array, s) -> Array:
    """e^{sum_{s < t <= r} g_t} for key row s and every query row r of one sub-block [16, K]."""
    r, t = _iota(0), _iota(1)
    return jnp.exp(_mm(jnp.where((t > s) & (t <= r), 1.0, 0.0), g))


def _row(x: Array, s) -> Array:
    """Row s of a [16, D] block as [1, D] (a masked sum: no dynamic register indexing)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == s, x, 0.0), axis=0, keepdims=True)


def _col(x: Array, s) -> Array:
    """Column s of a [16, 16] block as [16, 1]."""
    return jnp.sum(jnp.where(_iota(1) == s, x, 0.0), axis=1, keepdims=True)


def _diag_scores(q: Array, k: Array, g: Array, scale: float) -> Array:
    """Causal scores of one sub-block against itself [16, 16] fp32 (zero above the diagonal)."""

    def column(s, A):
        col = jnp.sum(q * _row(k, s) * _pair_decay(g, s), axis=1, keepdims=True)
        return jnp.where((_iota(1) == s) & (_iota(0) >= s), col, A)

    return scale * jax.lax.fori_loop(0, SUB, column, jnp.zeros((SUB, SUB), f32))


def _load(ref, start) -> Array:
    """Rows start .. start + 16 of a [T, D] ref, as fp32."""
    return ref[pl.ds(start, SUB), :].astype(f32)


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, s0_ref, o_ref, sT_ref, st_ref, *, scale, C, dtype):
    """One (batch, head, value tile): q, k, g [T, K], v [T, BV], s0 [K, BV] -> o, final and chunk-start states."""
    n_chunks, n = q_ref.shape[0] // C, C // SUB
    K = q_ref.shape[1]

    def chunk(ci, S):
        st_ref[ci] = S
        base = ci * C

        def rows(i, prefix):  # prefix: sum of the whole sub-blocks before i [1, K]
            r0 = base + i * SUB
            q_i, k_i, v_i, g_i = (_load(x, r0) for x in (q_ref, k_ref, v_ref, g_ref))
            head, _ = _head_tail(g_i)
            qh = q_i * head
            o_i = _mm(qh * (scale * jnp.exp(prefix)), S, dtype=dtype)

            def earlier(jj, carry):  # key sub-block j = i-1-jj, gap: the sub-blocks strictly between
                acc, gap = carry
                j0 = base + (i - 1 - jj) * SUB
                k_j, v_j, g_j = (_load(x, j0) for x in (k_ref, v_ref, g_ref))
                _, tail = _head_tail(g_j)
                A = scale * _mm(qh, k_j * tail * jnp.exp(gap), (1, 1))
                return acc + _mm(A, v_j, dtype=dtype), gap + jnp.sum(g_j, axis=0, keepdims=True)

            o_i, _ = jax.lax.fori_loop(0, i, earlier, (o_i, jnp.zeros((1, K), f32)))
            o_i = o_i + _mm(_diag_scores(q_i, k_i, g_i, scale), v_i, dtype=dtype)
            o_ref[pl.ds(r0, SUB), :] = o_i.astype(o_ref.dtype)
            return prefix + jnp.sum(g_i, axis=0, keepdims=True)

        total = jax.lax.fori_loop(0, n, rows, jnp.zeros((1, K), f32))

        def state_rows(ii, carry):  # sub-block i = n-1-ii, suffix: the sub-blocks after i
            acc, suffix = carry
            r0 = base + (n - 1 - ii) * SUB
            k_i, v_i, g_i = (_load(x, r0) for x in (k_ref, v_ref, g_ref))
            _, tail = _head_tail(g_i)
            acc = acc + _mm(k_i * tail * jnp.exp(suffix), v_i, (0, 0), dtype)
            return acc, suffix + jnp.sum(g_i, axis=0, keepdims=True)

        acc, _ = jax.lax.fori_loop(0, n, state_rows, (jnp.zeros_like(S), jnp.zeros((1, K), f32)))
        return jnp.exp(total).T * S + acc

    sT_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, s0_ref[...].astype(f32))


def _ones(mask: Array) -> Array:
    return jnp.where(mask, 1.0, 0.0)


def _rev_sum(x: Array) -> Array:
    """sum_{r >= t} x[r] for each row t of a [16, D] block (a 0/1 dot: a direct sum)."""
    return _mm(_ones(_iota(1) >= _iota(0)), x)


def _excl_sum(x: Array) -> Array:
    """sum_{s < t} x[s] for each row t of a [16, D] block."""
    return _mm(_ones(_iota(1) < _iota(0)), x)


def _diag_dq_dg(dA: Array, q: Array, k: Array, g: Array) -> tuple[Array, Array]:
    """A diagonal sub-block's share of dq and dg (before ``scale``). dq row t sums dA[t, s] k[s]
    e^{b_t - b_s} over s <= t; dg row t sums the pair terms q[r] dA[r, s] k[s] e^{b_r - b_s} over
    s < t <= r. dA: [SUB, SUB] lower-triangular; q, k, g: [SUB, K]."""
    rows = jax.lax.broadcasted_iota(jnp.int32, q.shape, 0)

    def add(s, carry):
        dq, dg = carry
        part = _col(dA, s) * _row(k, s) * _pair_decay(g, s)
        return dq + part, dg + jnp.where(rows > s, _rev_sum(q * part), 0.0)

    zero = jnp.zeros(q.shape, f32)
    return jax.lax.fori_loop(0, SUB, add, (zero, zero))


def _diag_dk(dA: Array, q: Array, g: Array) -> Array:
    """A diagonal sub-block's share of dk (before ``scale``): row s sums dA[t, s] q[t] e^{b_t - b_s}
    over t >= s. dA: [SUB, SUB] lower-triangular; q, g: [SUB, K]."""

    def add(s, dk):
        row = jnp.sum(_col(dA, s) * q * _pair_decay(g, s), axis=0, keepdims=True)
        return dk + jnp.where(jax.lax.broadcasted_iota(jnp.int32, dk.shape, 0) == s, row, 0.0)

    return jax.lax.fori_loop(0, SUB, add, jnp.zeros(q.shape, f32))


def _from_earlier(refs, base, i, do_i, qh, dgx, scale):
    """Query sub-block i against the earlier key sub-blocks j < i of its chunk (starting at row
    ``base``): (sum_j dA_ij (k_j e^{to start of i}) [16, K], ``dgx`` plus each pair of
    sub-blocks' total on the whole sub-blocks strictly between them)."""
    k_ref, v_ref, g_ref = refs
    block_rows = jax.lax.broadcasted_iota(jnp.int32, dgx.shape, 0)

    def earlier(jj, carry):
        acc, gap, dgx = carry
        j = i - 1 - jj
        k_j, v_j, g_j = (_load(x, base + j * SUB) for x in (k_ref, v_ref, g_ref))
        _, tail = _head_tail(g_j)
        part = _mm(_mm(do_i, v_j, (1, 1)), k_j * tail * jnp.exp(gap))
        pairs = scale * jnp.sum(qh * part, axis=0, keepdims=True)  # [1, K]: all pairs (i, j)
        dgx = dgx + jnp.where((block_rows > j) & (block_rows < i), pairs, 0.0)
        return acc + part, gap + jnp.sum(g_j, axis=0, keepdims=True), dgx

    zero = jnp.zeros((1, qh.shape[1]), f32)
    acc, _, dgx = jax.lax.fori_loop(0, i, earlier, (jnp.zeros(qh.shape, f32), zero, dgx))
    return acc, dgx


def _from_later(refs, j0, count, k_j, v_j, tail, dk, dv, scale, dtype):
    """Key sub-block j (rows j0 ..) against the ``count`` query sub-blocks after it in its chunk:
    dk and dv plus their shares."""
    q_ref, g_ref, do_ref = refs

    def later(ii, carry):  # query sub-block i = j+1+ii
        dk, dv, gap = carry
        q_i, g_i, do_i = (_load(x, j0 + (1 + ii) * SUB) for x in (q_ref, g_ref, do_ref))
        head, _ = _head_tail(g_i)
        qh = q_i * head
        kt = tail * jnp.exp(gap)
        A = scale * _mm(qh, k_j * kt, (1, 1))
        dk = dk + scale * kt * _mm(_mm(do_i, v_j, (1, 1)), qh, (0, 0))
        dv = dv + _mm(A, do_i, (0, 0), dtype)
        return dk, dv, gap + jnp.sum(g_i, axis=0, keepdims=True)

    dk, dv, _ = jax.lax.fori_loop(0, count, later, (dk, dv, jnp.zeros((1, k_j.shape[1]), f32)))
    return dk, dv


def _bwd_kernel(
    q_ref, k_ref, v_ref, g_ref, st_ref, do_ref, dsT_ref,
    dq_ref, dk_ref, dgq_ref, dgk_ref, dgx_ref, dv_ref, ds0_ref, *, scale, C, dtype,
):  # fmt: skip
    """One (batch, head, value tile), chunks in reverse: dv, dS0 and this tile's share of dq, dk
    and dg (dgq: query-side sums inside each sub-block, dgk: key-side ones, dgx: one row per
    sub-block for what reaches the whole sub-block)."""
    n_chunks, n = q_ref.shape[0] // C, C // SUB
    K = q_ref.shape[1]
    block_rows = jax.lax.broadcasted_iota(jnp.int32, dgx_ref.shape[1:], 0)  # [NP, K]: sub-block index m

    def chunk(cc, dS):  # dS: gradient on the state at the end of chunk ci
        ci = n_chunks - 1 - cc
        S = st_ref[ci]
        base = ci * C

        def rows(i, carry):  # dq of sub-block i, the q-side of dS_prev and of dg
            prefix, dS_acc, dgx = carry
            r0 = base + i * SUB
            q_i, k_i, v_i, g_i, do_i = (_load(x, r0) for x in (q_ref, k_ref, v_ref, g_ref, do_ref))
            head, _ = _head_tail(g_i)
            qh = q_i * head
            e_b = head * jnp.exp(prefix)
            dq_i = scale * e_b * _mm(do_i, S, (1, 1), dtype)
            dS_acc = dS_acc + _mm(q_i * (scale * e_b), do_i, (0, 0), dtype)
            # pairs (r in i, s before the chunk) reach the whole sub-blocks m < i
            dgx = dgx + jnp.where(block_rows < i, jnp.sum(q_i * dq_i, axis=0, keepdims=True), 0.0)

            acc, dgx = _from_earlier((k_ref, v_ref, g_ref), base, i, do_i, qh, dgx, scale)
            dq_i = dq_i + scale * head * acc
            dA = jnp.where(_iota(1) <= _iota(0), _mm(do_i, v_i, (1, 1)), 0.0)
            dq_d, dg_d = _diag_dq_dg(dA, q_i, k_i, g_i)
            dgq_ref[pl.ds(r0, SUB), :] = _rev_sum(q_i * dq_i) + scale * dg_d
            dq_ref[pl.ds(r0, SUB), :] = dq_i + scale * dq_d
            return prefix + jnp.sum(g_i, axis=0, keepdims=True), dS_acc, dgx

        zero = jnp.zeros((1, K), f32)
        total, dS_acc, dgx = jax.lax.fori_loop(0, n, rows, (zero, jnp.zeros_like(dS), jnp.zeros(block_rows.shape, f32)))

        def cols(jj, carry):  # dk, dv of key sub-block j = n-1-jj, and the k-side of dg
            suffix, dgx = carry
            j = n - 1 - jj
            j0 = base + j * SUB
            q_j, k_j, v_j, g_j, do_j = (_load(x, j0) for x in (q_ref, k_ref, v_ref, g_ref, do_ref))
            _, tail = _head_tail(g_j)
            to_end = tail * jnp.exp(suffix)  # e^{b_C - b_s}
            dk_j = to_end * _mm(v_j, dS, (1, 1), dtype)
            # pairs (r after the chunk, s in j) reach the whole sub-blocks m > j
            dgx = dgx + jnp.where(block_rows > j, jnp.sum(k_j * dk_j, axis=0, keepdims=True), 0.0)
            dv_j = _mm(k_j * to_end, dS, dtype=dtype)

            dk_j, dv_j = _from_later((q_ref, g_ref, do_ref), j0, jj, k_j, v_j, tail, dk_j, dv_j, scale, dtype)
            dgk_ref[pl.ds(j0, SUB), :] = _excl_sum(k_j * dk_j)
            A = _diag_scores(q_j, k_j, g_j, scale)
            dv_j = dv_j + _mm(A, do_j, (0, 0), dtype)
            dA = jnp.where(_iota(1) <= _iota(0), _mm(do_j, v_j, (1, 1)), 0.0)

            dk_j = dk_j + scale * _diag_dk(dA, q_j, g_j)
            dk_ref[pl.ds(j0, SUB), :] = dk_j
            dv_ref[pl.ds(j0, SUB), :] = dv_j.astype(dv_ref.dtype)
            return suffix + jnp.sum(g_j, axis=0, keepdims=True), dgx

        _, dgx = jax.lax.fori_loop(0, n, cols, (zero, dgx))
        # pairs straddling the whole chunk (s before it, r after it): e^{b_C} rowsum(S * dS)
        dgx_ref[ci] = dgx + jnp.exp(total) * jnp.sum(S * dS, axis=1, keepdims=True).T
        return jnp.exp(total).T * dS + dS_acc

    ds0_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, dsT_ref[...].astype(f32))


def _specs(T: int, K: int, BV: int, n_chunks: int):
    """BlockSpecs over grid (B, H, V // BV) for [B, T, H, K], [B, T, H, V] and [B, H, (N,) K, V] arrays."""
    sq = pl.squeezed
    keys = pl.BlockSpec((sq, T, sq, K), lambda b, h, j: (b, 0, h, 0))
    vals = pl.BlockSpec((sq, T, sq, BV), lambda b, h, j: (b, 0, h, j))
    state = pl.BlockSpec((sq, sq, K, BV), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((sq, sq, n_chunks, K, BV), lambda b, h, j: (b, h, 0, 0, j))
    part = pl.BlockSpec((sq, sq, T, sq, K), lambda b, h, j: (j, b, 0, h, 0))
    return keys, vals, state, states, part


LAUNCH = {"num_warps": 4, "num_stages": 2}  # Triton launch options of both kernels (tools.gpu_check reads them)


def _compiler_params(interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu_triton  # GPU only; interpret mode never loads it

    return plgpu_triton.CompilerParams(**LAUNCH)


def _forward(q, k, v, g, s0, scale, C, BV, interpret):
    B, T, H, K = q.shape
    V, N = v.shape[-1], T // C
    keys, vals, state, states, _ = _specs(T, K, BV, N)
    kernel = functools.partial(_fwd_kernel, scale=scale, C=C, dtype=q.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((B, H, K, V), f32),
            jax.ShapeDtypeStruct((B, H, N, K, V), f32),
        ),
        grid=(B, H, V // BV),
        in_specs=[keys, keys, vals, keys, state],
        out_specs=(vals, state, states),
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="gla_fwd",
    )(q, k, v, g, s0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gla_padded(q, k, v, g, s0, scale: float, C: int, BV: int, interpret: bool):
    o, sT, _ = _forward(q, k, v, g, s0, scale, C, BV, interpret)
    return o, sT


def _vjp_fwd(q, k, v, g, s0, scale, C, BV, interpret):
    o, sT, starts = _forward(q, k, v, g, s0, scale, C, BV, interpret)
    return (o, sT), (q, k, v, g, checkpoint_name(starts, "gla_states"))


def _vjp_bwd(scale, C, BV, interpret, res, cot):
    q, k, v, g, starts = res
    do, dsT = cot
    B, T, H, K = q.shape
    V, N, n = v.shape[-1], T // C, C // SUB
    NP = _next_pow2(n)  # one row per sub-block, padded to a power of two
    keys, vals, state, states, part = _specs(T, K, BV, N)
    n_tiles = V // BV
    rows = pl.BlockSpec((pl.squeezed,) * 3 + (N, NP, K), lambda b, h, j: (j, b, h, 0, 0, 0))
    kernel = functools.partial(_bwd_kernel, scale=scale, C=C, dtype=q.dtype)
    per_tile = jax.ShapeDtypeStruct((n_tiles, B, T, H, K), f32)
    dq, dk, dgq, dgk, dgx, dv, ds0 = pl.pallas_call(
        kernel,
        out_shape=(
            per_tile,
            per_tile,
            per_tile,
            per_tile,
            jax.ShapeDtypeStruct((n_tiles, B, H, N, NP, K), f32),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((B, H, K, V), f32),
        ),
        grid=(B, H, n_tiles),
        in_specs=[keys, keys, vals, keys, states, vals, state],
        out_specs=(part, part, part, part, rows, vals, state),
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="gla_bwd",
    )(q, k, v, g, starts, do.astype(v.dtype), dsT.astype(f32))
    dq, dk, dgq, dgk, dgx = (jnp.sum(x, axis=0) for x in (dq, dk, dgq, dgk, dgx))
    whole = jnp.repeat(dgx[:, :, :, :n], SUB, axis=3).reshape(B, H, T, K).transpose(0, 2, 1, 3)
    dg = dgq + dgk + whole
    return dq.astype(q.dtype), dk.astype(k.dtype), dv, dg.astype(g.dtype), ds0


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
    block_v: int = 64,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """Pallas GLA, checked inputs (see ``chunk_gla``): (o [B, T, H, V], final state [B, H, K, V] fp32).

    Pads T to a multiple of ``chunk_size`` (a multiple of 16), K to a power of two >= 16 and V to
    a multiple of the value tile (a power of two, at most ``block_v``), all state-neutrally.
    """
    if chunk_size % SUB:
        raise ValueError(f"the Pallas kernel needs chunk_size to be a multiple of {SUB}; got {chunk_size}")
    T, K, V = q.shape[1], q.shape[3], v.shape[3]
    Kp, BV = _next_pow2(K), min(_next_pow2(block_v), _next_pow2(V))
    Vp = -(-V // BV) * BV
    Tp = -(-T // chunk_size) * chunk_size

    def pad(x, t, d):
        return jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0), (0, d - x.shape[3])))

    q, k, g = (pad(x, Tp, Kp) for x in (q, k, g))
    v = pad(v, Tp, Vp)
    s0 = jnp.pad(s0.astype(f32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    o, sT = _gla_padded(q, k, v, g.astype(f32), s0, float(scale), chunk_size, BV, interpret)
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
