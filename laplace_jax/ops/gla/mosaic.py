"""Chunkwise GLA as Pallas TPU (Mosaic) kernels, forward and backward: each chunk stays in VMEM,
every score is a matmul on the 128 x 128 systolic array, every decay factor the exp of a direct sum.

Same recurrence, signature and numerics contract as ``chunk_gla`` (``chunk.py``); on CPU it runs in
the Pallas interpreter (tests), and ``model.attn_impl="mosaic"`` picks it.

Grid and layout. One grid step is one chunk of one (batch row, head): grid (B, H, N), the chunk
axis sequential ("arbitrary") with the fp32 state [K, V] in a VMEM scratch, batch rows and heads
parallel (split over a megacore chip's two TensorCores). The kernels take [B, H, T, D]: a chunk of
one head is then one [C, D] block. The public [B, T, H, D] layout is transposed around the call
(in a model, XLA writes the producers' outputs in the layout the call wants). Inside the kernel
each row block is copied into a VMEM scratch of whole 128-lane tiles whose lanes past D stay zero
(``_wide``), so every matmul contracts over whole lanes; HBM holds D as it is (TPU arrays are
tiled by 128 lanes, so D = 96 occupies 128 there already), and a contraction of 96 or 128 is one
pass either way.

The scores inside a chunk (``levels.py`` derives them; here one operand per level). A chunk of
C = 2^L rows splits in halves, quarters, ... For a pair s < r, let m be the highest bit in which r
and s differ (r has it set): r and s share a block of 2^(m+1) rows, s in its lower half, r in its
upper half, and

    b_r - b_s = sides_m(r) + sides_m(s),
    sides_m(r) = sum_{r's half-block start <= t <= r} g_t          (r in an upper half: bit m of r set)
    sides_m(s) = sum_{s < t <= end of s's half-block} g_t          (s in a lower half: bit m clear)

both direct sums <= 0. With X_m[r] = (q_r if bit m of r is set else k_r) * e^{sides_m(r)}, every
pair of level m is one entry of X_m X_m^T, so

    A = scale * (sum_m mask_m * (X_m X_m^T) + diag(q . k)),   mask_m[r, s] = (s < r and (r ^ s) >> m == 1)

L full [C, C] matmuls of [C, D] operands and an iota mask per level: no 16-row tiles, no
per-pair exps.

Sums on the vector unit, by doubling (``block_sums``). sides_m for every m, the chunk's inclusive
sum b_r and its reverse exclusive sum (for the state) come from L steps over the [C, K] decays:
step j knows each aligned block of 2^j rows' total and each row's sums within its block, and the
totals of a block's two halves give the next block size's (a roll by 1, 2 or 4 rows inside a
vreg's 8 rows, then whole-vreg halves, which move no data). Every value is a sum of whole blocks'
sums of same-sign terms, never a difference: each carries a relative error of at most L fp32
roundings (L u, u = 2^-24), at any decay. (These sums were a product M g with a fixed
[(L + 2) C, C] 0/1 matrix on the MXU, in three exact bf16 pieces of g: 3 (L + 2) C rows of MXU
passes per chunk, more than the scores. By the compiler's static schedule the doubling takes a
v5e grid step at the 3B layer from 1,872 to 1,200 cycles forward and 4,449 to 2,732 backward.)

Backward (chunks in reverse, dS the gradient on the chunk's end state in a VMEM scratch). With
dA = tril(do v^T), the state path as in ``chunk.py``; the levels:

    dX_m = scale * (D_m + D_m^T) X_m,   D_m = mask_m * dA
    dq += dX_m * e^{sides_m} on rows with bit m set, dk += the same on rows with it clear,
    d sides_m = dX_m * X_m

with dX_m one matmul: D_m and D_m^T hold disjoint pairs (below and above the diagonal), so
D_m + D_m^T is (dA + dA^T) masked to the level's pairs in either order, exactly (2,732 -> 2,662
cycles per backward grid step against a matmul for each);

and the gate gradient is the transpose of the forward's sums (``block_sums_T``),

    dg = sum_m sides_m^T d sides_m + incl^T (q dq_state) + rev^T (k dk_state) + e^{b_C} rowsum(S * dS),

within-block suffix and prefix sums of fp32 terms, all levels in one doubling pass (Horner's
rule), so dg_t sums the pairs whose decay contains g_t (the pair-sum argument of ``chunk.py``):
nothing is a difference of large sums, at any decay; each output adds its terms in O(L) fp32
additions (the tests hold it within 4 L roundings of the sum of the terms' magnitudes). Scores
are recomputed, not stored: L matmuls per chunk against an fp32 [C, C] write and read.

Three libtpu 0.0.42 workarounds, each checked on the compiler: a bf16 operand computed in the
kernel must contract over a multiple of 128 (96 aborts in LLO: hence the widening, and chunks of
128 or more on TPU); padding a value in the kernel (``jnp.pad``) is seen through, so the widening
goes through a VMEM scratch; and a matmul operand masked by ``where`` is masked by a
multiplication instead (the compiler folds a select before a dot into a masked matmul whose
operand types its own static analysis rejects).

Time: the TPU compiler's static schedule of these kernels (``tpu.mosaic_cycles``), the only
estimate it gives a Mosaic kernel; it counts no HBM transfer time, so ``tpu`` sets it beside a
hand-counted DMA floor.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from laplace_jax.ops.gla.limits import MOSAIC_KERNELS, chunk_size_problem
from laplace_jax.platform import per_platform, refused_when_lowered

Array = jax.Array
f32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # a @ b^T: contract the minor dims of both
TN = (((0,), (0,)), ((), ()))  # a^T @ b: contract the major dims of both


def _shift(x: Array, by: int) -> Array:
    """Rows of ``x`` moved down by ``by`` (wrapping): row r of the result is row r - by."""
    return pltpu.roll(x, by % x.shape[0], 0)


def _upper(C: int, j: int) -> Array:
    """[C, 1]: rows with bit j set (the upper half of their block of 2^(j + 1) rows)."""
    return ((jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) >> j) & 1) == 1


def _halves(x: Array, h: int) -> tuple[Array, Array]:
    """[C, D] -> the lower and upper halves of every block of 2h rows, each [C / 2h, h, D] (h a
    multiple of 8: whole vregs, so no data moves)."""
    y = x.reshape(x.shape[0] // (2 * h), 2, h, x.shape[1])
    return y[:, 0], y[:, 1]


def _join(lower: Array, upper: Array) -> Array:
    """Inverse of ``_halves``."""
    y = jnp.stack([lower, upper], 1)
    return y.reshape(-1, y.shape[-1])


def block_sums(g: Array) -> tuple[list[Array], Array, Array, Array]:
    """g [C, D] fp32 -> (sides per level, coarsest first; inclusive sums from the chunk start;
    reverse exclusive sums to its end; the chunk's total on every row), by doubling on the vector
    unit: after step j, ``tot`` holds each block of 2^(j + 1) rows' total, ``incl`` (``rev``) the
    sum from a row's block start to it (after it to the block end). Each is a sum of whole
    blocks' sums, never a difference."""
    C = g.shape[0]
    tot, incl, rev, sides = g, g, jnp.zeros_like(g), []
    for j in range(C.bit_length() - 1):
        h = 1 << j
        if h % 8:  # halves inside a vreg's 8 rows: rolls and selects
            up = _upper(C, j)
            sides.append(jnp.where(up, incl, rev))
            below, above = _shift(tot, h), _shift(tot, C - h)
            incl = incl + jnp.where(up, below, 0.0)
            rev = rev + jnp.where(up, 0.0, above)
            tot = tot + jnp.where(up, below, above)
            continue
        (t_lo, t_hi), (i_lo, i_hi), (r_lo, r_hi) = (_halves(x, h) for x in (tot, incl, rev))
        sides.append(_join(r_lo, i_hi))
        t = t_lo + t_hi
        incl, rev, tot = _join(i_lo, i_hi + t_lo), _join(r_lo + t_hi, r_hi), _join(t, t)
    return sides[::-1], incl, rev, tot


def block_sums_T(ys: list[Array], y_incl: Array, y_rev: Array) -> Array:
    """The transpose of ``block_sums``: sum_l sides_l^T ys[l] + incl^T y_incl + rev^T y_rev, each
    [C, D] fp32. Level j's sides^T is a within-block suffix sum (rows with bit j set) or prefix
    sum (rows with it clear) over the levels below j; the levels' sums share one pass by Horner's
    rule on the block doublings (they act on different bits, so they commute)."""
    C = y_incl.shape[0]
    L = C.bit_length() - 1
    a, c = [], []  # a_j summed from a row on (rows with bit j set), c_j before it (bit j clear)
    for j, y in enumerate(ys[::-1]):
        if (1 << j) % 8:
            up = _upper(C, j)
            a.append(jnp.where(up, y, 0.0))
            c.append(jnp.where(up, 0.0, y))
        else:
            lo, hi = _halves(y, 1 << j)
            a.append(_join(jnp.zeros_like(hi), hi))
            c.append(_join(lo, jnp.zeros_like(lo)))
    a.append(y_incl)
    c.append(y_rev)
    above, below = a[L], c[L]  # the sums of a_j and of c_j for j > i (above ends as the sum of every a_j)
    acc = None
    for i in range(L - 1, -1, -1):
        h = 1 << i
        if h % 8:
            up = _upper(C, i)
            z = jnp.where(up, _shift(below, h), _shift(above, C - h))
            if acc is not None:
                z = z + acc + jnp.where(up, _shift(acc, h), _shift(acc, C - h))
        else:
            z = _join(_halves(above, h)[1], _halves(below, h)[0])
            if acc is not None:
                lo, hi = _halves(acc, h)
                both = lo + hi
                z = z + _join(both, both)
        acc, above, below = z, above + a[i], below + c[i]
    return above + acc


def lanes(d: int) -> int:
    """``d`` rounded up to whole 128-lane tiles."""
    return -(-d // 128) * 128


def _zero(*scratch) -> None:
    """Zero VMEM scratch (at each batch row and head's first chunk: lanes past an operand's width
    are never written again)."""
    for ref in scratch:
        ref[...] = jnp.zeros(ref.shape, ref.dtype)


def _wide(ref, scratch) -> Array:
    """The block of ``ref`` [rows, d], widened to the scratch's whole lanes (zeros past d,
    ``_zero``); the block itself where d is whole lanes already."""
    if ref.shape == scratch.shape:
        return ref[...]
    scratch[:, : ref.shape[-1]] = ref[...]
    return scratch[...]


class _Chunk:
    """One chunk's decays and per-level operands, from its rows q, k [C, K], g [C, K] fp32."""

    def __init__(self, q: Array, k: Array, g: Array):
        C = q.shape[0]
        self.L = C.bit_length() - 1
        self.C = C
        self.r = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
        self.s = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
        self.q, self.k = q, k
        self.qf, self.kf = q.astype(f32), k.astype(f32)
        sides, incl, rev, tot = block_sums(g)
        self.e_levels = [jnp.exp(x) for x in sides]
        self.e_b = jnp.exp(incl)  # e^{b_r}: from the chunk start
        self.e_tail = jnp.exp(rev)  # e^{b_C - b_r}: to the chunk end
        self.e_tot = jnp.exp(tot[:1])  # [1, K]: the whole chunk

    def upper(self, l: int) -> Array:
        """[C, 1]: rows in an upper half at level l (bit L - 1 - l set)."""
        return _upper(self.C, self.L - 1 - l)

    def level(self, l: int) -> Array:
        """[C, C]: pairs of level l in either order (r and s differ first in bit L - 1 - l)."""
        return ((self.r ^ self.s) >> (self.L - 1 - l)) == 1

    def pairs(self, l: int) -> Array:
        """[C, C]: pairs (r, s), s < r, of level l."""
        return (self.s < self.r) & self.level(l)

    def X(self, l: int) -> Array:
        """Level l's operand (fp32): q on upper rows, k on lower rows, times e^{sides}."""
        return jnp.where(self.upper(l), self.qf, self.kf) * self.e_levels[l]

    def scores(self, Xs: list[Array], scale: float) -> Array:
        """A [C, C] fp32 (zero above the diagonal)."""
        dt = self.q.dtype
        A = jnp.where(self.r == self.s, jax.lax.dot_general(self.q, self.k, NT, preferred_element_type=f32), 0.0)
        for l, X in enumerate(Xs):
            Xd = X.astype(dt)
            A = A + jnp.where(self.pairs(l), jax.lax.dot_general(Xd, Xd, NT, preferred_element_type=f32), 0.0)
        return scale * A


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, s0_ref, o_ref, starts_ref, sT_ref, S_ref, *wide, scale):
    c = pl.program_id(2)
    K, V = s0_ref.shape

    @pl.when(c == 0)
    def _():
        _zero(S_ref, *wide)
        S_ref[:K, :V] = s0_ref[...]

    S = S_ref[...]
    starts_ref[...] = S[:K, :V]
    q, k, v, g = (_wide(ref, w) for ref, w in zip((q_ref, k_ref, v_ref, g_ref), wide, strict=True))
    dt = v.dtype
    ch = _Chunk(q, k, g)
    A = ch.scores([ch.X(l) for l in range(ch.L)], scale)
    o = jnp.dot(A.astype(dt), v, preferred_element_type=f32)
    o = o + jnp.dot((ch.qf * (scale * ch.e_b)).astype(dt), S.astype(dt), preferred_element_type=f32)
    o_ref[...] = o[:, :V].astype(o_ref.dtype)
    kv = jax.lax.dot_general((ch.kf * ch.e_tail).astype(dt), v, TN, preferred_element_type=f32)
    S_next = jnp.transpose(ch.e_tot) * S + kv
    S_ref[...] = S_next

    @pl.when(c == pl.num_programs(2) - 1)
    def _():
        sT_ref[...] = S_next[:K, :V]


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, S_in, dsT_ref, *refs, scale):
    dq_ref, dk_ref, dv_ref, dg_ref, ds0_ref, dS_ref, S_ref, *wide = refs
    i = pl.program_id(2)
    K, V = dsT_ref.shape

    @pl.when(i == 0)
    def _():
        _zero(dS_ref, S_ref, *wide)
        dS_ref[:K, :V] = dsT_ref[...]

    S_ref[:K, :V] = S_in[...]
    dS, S = dS_ref[...], S_ref[...]
    refs = (q_ref, k_ref, v_ref, g_ref, do_ref)
    q, k, v, g, do = (_wide(ref, w) for ref, w in zip(refs, wide, strict=True))
    dt = v.dtype
    ch = _Chunk(q, k, g)
    qf, kf = ch.qf, ch.kf
    Xs = [ch.X(l) for l in range(ch.L)]
    A = ch.scores(Xs, scale)
    e_bs = scale * ch.e_b
    Sd, dSd = S.astype(dt), dS.astype(dt)
    # through the state: o_inter = (s q e^b) S, S_next = e^{total} S + (k e^{tail})^T v
    dq_state = e_bs * jax.lax.dot_general(do, Sd, NT, preferred_element_type=f32)
    dk_state = ch.e_tail * jax.lax.dot_general(v, dSd, NT, preferred_element_type=f32)
    dv = jnp.dot((kf * ch.e_tail).astype(dt), dSd, preferred_element_type=f32)
    dv = dv + jax.lax.dot_general(A.astype(dt), do, TN, preferred_element_type=f32)
    qe_do = jax.lax.dot_general((qf * e_bs).astype(dt), do, TN, preferred_element_type=f32)
    dS_prev = jnp.transpose(ch.e_tot) * dS + qe_do
    dS_ref[...] = dS_prev
    # through the scores, level by level (masks as 0/1 factors: the module docstring's second workaround)
    dA = jnp.where(ch.s <= ch.r, jax.lax.dot_general(do, v, NT, preferred_element_type=f32), 0.0)
    dA_both = dA + jnp.transpose(dA)  # off the diagonal each entry is one of the two: D_m + D_m^T below is exact
    dq, dk, terms = dq_state, dk_state, []
    for l, X in enumerate(Xs):
        D = (dA_both * ch.level(l).astype(f32)).astype(dt)  # D_m + D_m^T, one matmul
        dX = scale * jnp.dot(D, X.astype(dt), preferred_element_type=f32)
        dy = dX * ch.e_levels[l]
        up = ch.upper(l)
        dq, dk = dq + jnp.where(up, dy, 0.0), dk + jnp.where(up, 0.0, dy)
        terms.append(dX * X)
    # the gate: level pairs, then the state's (r in the chunk, s before it; s in the chunk, r after it)
    dg = block_sums_T(terms, qf * dq_state, kf * dk_state)
    dg = dg + ch.e_tot * jnp.transpose(jnp.sum(S * dS, axis=1, keepdims=True))
    d = scale * jnp.sum(jnp.where(ch.r == ch.s, dA, 0.0), axis=1, keepdims=True)  # the diagonal pairs
    dq_ref[...] = (dq + d * kf)[:, :K].astype(dq_ref.dtype)
    dk_ref[...] = (dk + d * qf)[:, :K].astype(dk_ref.dtype)
    dv_ref[...] = dv[:, :V].astype(dv_ref.dtype)
    dg_ref[...] = dg[:, :K].astype(dg_ref.dtype)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        ds0_ref[...] = dS_prev[:K, :V]


def _params() -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _vmem(C: int, K: int, V: int, xs: tuple[Array, ...]) -> list:
    """VMEM scratch: the fp32 state (or its gradient) at whole lanes, then one widening buffer
    per row operand in ``xs`` (``_wide``)."""
    return [pltpu.VMEM((lanes(K), lanes(V)), f32)] + [pltpu.VMEM((C, lanes(x.shape[-1])), x.dtype) for x in xs]


def _forward(q, k, v, g, s0, scale: float, C: int, interpret: bool):
    """[B, H, T, D] -> (o, chunk-start states [B, H, N, K, V], final state)."""
    B, H, T, K = q.shape
    V, N = v.shape[-1], T // C
    rows = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, c: (b, h, c, 0))  # noqa: E731
    state = pl.BlockSpec((None, None, K, V), lambda b, h, c: (b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale),
        grid=(B, H, N),
        in_specs=[rows(K), rows(K), rows(V), rows(K), state],
        out_specs=[rows(V), pl.BlockSpec((None, None, None, K, V), lambda b, h, c: (b, h, c, 0, 0)), state],
        out_shape=[
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((B, H, N, K, V), f32),
            jax.ShapeDtypeStruct((B, H, K, V), f32),
        ],
        scratch_shapes=_vmem(C, K, V, (q, k, v, g)),
        compiler_params=_params(),
        interpret=interpret,
        name=MOSAIC_KERNELS[0],
    )(q, k, v, g, s0)


def _backward(q, k, v, g, do, starts, dsT, scale: float, C: int, interpret: bool):
    """(dq, dk, dv, dg, d initial state), chunks walked from the last."""
    B, H, T, K = q.shape
    V, N = v.shape[-1], T // C
    rows = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, i: (b, h, N - 1 - i, 0))  # noqa: E731
    state = pl.BlockSpec((None, None, K, V), lambda b, h, i: (b, h, 0, 0))
    start = pl.BlockSpec((None, None, None, K, V), lambda b, h, i: (b, h, N - 1 - i, 0, 0))
    scratch = _vmem(C, K, V, (q, k, v, g, do))
    return pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale),
        grid=(B, H, N),
        in_specs=[rows(K), rows(K), rows(V), rows(K), rows(V), start, state],
        out_specs=[rows(K), rows(K), rows(V), rows(K), state],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g)]
        + [jax.ShapeDtypeStruct((B, H, K, V), f32)],
        scratch_shapes=[scratch[0], pltpu.VMEM((lanes(K), lanes(V)), f32), *scratch[1:]],  # dS, S, widened rows
        compiler_params=_params(),
        interpret=interpret,
        name=MOSAIC_KERNELS[1],
    )(q, k, v, g, do, starts, dsT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _gla(q, k, v, g, s0, scale: float, C: int, interpret: bool):
    o, _, sT = _forward(q, k, v, g, s0, scale, C, interpret)
    return o, sT


def _gla_fwd(q, k, v, g, s0, scale, C, interpret):
    o, starts, sT = _forward(q, k, v, g, s0, scale, C, interpret)
    return (o, sT), (q, k, v, g, checkpoint_name(starts, "gla_states"))  # model.remat="save_gla" keeps them


def _gla_bwd(scale, C, interpret, res, cot):
    q, k, v, g, starts = res
    do, dsT = cot
    return _backward(q, k, v, g, do.astype(v.dtype), starts, dsT.astype(f32), scale, C, interpret)


_gla.defvjp(_gla_fwd, _gla_bwd)


def mosaic_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    s0: Array,
    *,
    scale: float,
    chunk_size: int = 128,
    interpret: bool = False,
) -> tuple[Array, Array]:
    """GLA over q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] (log-decays <= 0) from state s0
    [B, H, K, V]: (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32). Any T >= 1 (the
    tail is padded with state-neutral positions); ``chunk_size`` a power of two >= 16, and a
    multiple of 128 where the kernel compiles (TPU)."""
    if (problem := chunk_size_problem("mosaic", chunk_size)) is not None:
        raise ValueError(problem)
    if not interpret and (refusal := chunk_refusal(chunk_size)) is not None:
        raise ValueError(refusal)
    T = q.shape[1]
    Tp = -(-T // chunk_size) * chunk_size

    def heads_major(x):  # [B, T, H, d] -> [B, H, Tp, d] (state-neutral zeros after T)
        return jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))

    o, sT = _gla(
        heads_major(q), heads_major(k), heads_major(v), heads_major(g.astype(f32)), s0.astype(f32),
        scale, chunk_size, interpret,
    )  # fmt: skip
    return jnp.swapaxes(o[:, :, :T], 1, 2), sT


def compiled_on_tpu(fn, *args, refusal: str | None = None):
    """``fn(*args, interpret=...)`` for a Mosaic kernel ``fn``: compiled in a program compiled for
    TPU (a deviceless TPU compile from this host included), run in the Pallas interpreter in one
    compiled for CPU (``platform.per_platform``). Raises on a backend where it cannot run at all.
    ``refusal``: why the TPU compiler rejects these shapes; they run interpreted on CPU, and a
    program lowered for TPU raises it."""
    backend = jax.default_backend()
    if backend not in ("cpu", "tpu"):
        raise ValueError(
            f"the Mosaic GLA kernels lower only on TPU; this backend is {backend!r}. "
            "Use model.attn_impl='auto', which picks the kernel for the backend."
        )
    interpreted = functools.partial(fn, interpret=True)
    if refusal is None:
        return per_platform(*args, default=interpreted, tpu=functools.partial(fn, interpret=False))
    if backend == "tpu":
        raise ValueError(refusal)
    return per_platform(*args, default=interpreted, tpu=lambda *a: refused_when_lowered(refusal, interpreted(*a)))


def chunk_refusal(chunk_size: int) -> str | None:
    """Why the TPU compiler rejects the Mosaic chunk kernel at ``chunk_size``, or None."""
    if chunk_size % 128 == 0:
        return None
    return (
        f"the Mosaic GLA kernel compiles for TPU with chunk_size a multiple of 128 (got {chunk_size}): "
        "libtpu rejects narrower contractions of operands computed in the kernel. Use model.chunk_size=128."
    )


def mosaic_step_for(impl: str, fn, xla, *args, interpret: bool | None = None):
    """A decode-step Mosaic kernel ``fn`` (one whose shapes it takes) under ``model.attn_impl``:
    "auto" runs it in a program compiled for TPU and ``xla`` elsewhere; "mosaic" runs it compiled
    for TPU and interpreted for CPU (``compiled_on_tpu``), or as ``interpret`` says."""
    if impl == "auto":
        return per_platform(*args, default=xla, tpu=functools.partial(fn, interpret=False))
    if interpret is None:
        return compiled_on_tpu(fn, *args)
    return fn(*args, interpret=interpret)
