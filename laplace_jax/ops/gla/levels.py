"""The XLA kernel's intra-chunk scores by dyadic levels: every decay exponent a direct sum,
every score a matmul, in the layout each compiler wants.

A chunk of P = 2^L rows (a chunk of C <= P rows is padded to P with zero rows) is split in
halves, quarters, ... down to single rows. At level l (half-block size h = P / 2^(l+1)) each
block of 2h rows has a lower half [start, mid] and an upper half (mid, end]. Every pair (r, s)
with s < r lies in exactly one level: the one whose block holds both with s in its lower half
and r in its upper half (the highest bit in which r and s differ). For that pair

    b_r - b_s = head_l(r) + tail_l(s),   head_l(r) = sum_{mid < t <= r} g_t,   tail_l(s) = sum_{s < t <= mid} g_t,

two direct sums of log-decays (each <= 0), so e^{b_r - b_s} = e^{head_l(r)} e^{tail_l(s)} with
both factors <= 1: nothing overflows and nothing cancels, however strong the decay (a factor
that underflows to 0 is one whose pair decays below e^-87 anyway). The scores

    A[r, s] = scale * sum_k (q_rk e^{head_l(r)k}) (k_sk e^{tail_l(s)k})      (s < r, level l of (r, s))
    A[r, r] = scale * q_r . k_r

are one matmul per level: Q_l K_l^T with Q_l = q e^{head_l} and K_l = k e^{tail_l}. The gate
gradient stays a sum of wanted pairs: g_t enters head_l(r) for mid < t <= r and tail_l(s) for
s < t <= mid, so with dq_l, dk_l the level's gradients of q and k,

    dg_t = sum_l [ sum_{r >= t in t's upper half} (q dq_l)_r + sum_{s < t in t's lower half} (k dk_l)_s ],

each a sum of the pair terms P[r, s] = dA[r, s] A-factor that actually contain g_t (no
difference of two large sums, unlike reverse-cumsum(q dq - k dk)).

Two layouts of the same sums, chosen per compile target (``chunk._per_layout``: "full" for
``platform.SYSTOLIC``):
- ``full`` (TPU, Neuron: systolic arrays): each level is one full-width [P x K] x [K x P] matmul
  whose rows outside the level's halves are zero, kept where r and s share a block. Every array
  keeps a minor dimension of K or P (128): no 1-, 2- or 4-row tiles, which a 128 x 128 matrix
  unit and 8 x 128 vector registers would waste. A level's head sums live on its upper rows and
  its tail sums on its lower rows, so one 0/1 matrix (head + tail) gives both in one matmul and
  one exp, and the gate gradient's two per-level sums are one matmul too (on the TPU compiler's
  estimate this cut the forward from 9.41 to 7.48 ms and forward + backward from 25.7 to 19.7 ms
  at the 3B layer on v5e).
- ``blocks`` (CPU, GPU): each level's pairs as [P / 2h, h, h] blocks, no zero rows, no masks: the
  least arithmetic and memory, which XLA:CPU runs fastest.
Both return the same scores A [..., C, C] and gradients; the tests run both.

Direct sums along a chunk are products with 0/1 matrices at HIGHEST precision: each selected
term is added as it is (exact to fp32 rounding on every backend; on a TPU, HIGHEST is its fp32
emulation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.ops.gla.limits import XLA_SCORES_SCOPE

Array = jax.Array
f32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
LAYOUTS = ("full", "blocks")


def padded(C: int) -> int:
    """The smallest power of two >= C: the rows the levels work on."""
    return 1 << max(0, C - 1).bit_length()


@functools.cache
def level_matrices(C: int) -> dict[str, np.ndarray]:
    """0/1 matrices of a chunk of C rows (levels over ``padded(C)`` rows), float32:
    ``sides[l]`` [P, P] (``sides[l] @ g`` = head_l(r) on upper-half rows and tail_l(s) on
    lower-half rows: the two sets of rows are disjoint, so one matrix holds both), ``upper[l]``
    [P] (bool), ``block[l]`` [P, P] (r and s share a block of level l); ``incl`` and
    ``rev_excl`` [C, C], the chunk's inclusive cumulative sum and reverse exclusive one (for the
    state path)."""
    P = padded(C)
    r, t = np.arange(P)[:, None], np.arange(P)[None, :]
    head, tail, upper, block = [], [], [], []
    h = P // 2
    while h >= 1:
        same = r // (2 * h) == t // (2 * h)
        mid = (r // (2 * h)) * 2 * h + h - 1  # last row of the lower half of r's block
        up = (r % (2 * h)) >= h
        head.append(same & up & (t > mid) & (t <= r))
        tail.append(same & ~up & (t > r) & (t <= mid))
        upper.append(up[:, 0])
        block.append(same)
        h //= 2
    rc, tc = np.arange(C)[:, None], np.arange(C)[None, :]
    return {
        "sides": np.asarray(np.logical_or(head, tail), np.float32).reshape(-1, P, P),
        "upper": np.asarray(upper, bool).reshape(-1, P),
        "block": np.asarray(block, np.float32).reshape(-1, P, P),
        "incl": (tc <= rc).astype(np.float32),
        "rev_excl": (tc > rc).astype(np.float32),
    }


def sums(m: np.ndarray, spec: str, x: Array) -> Array:
    """Direct sums of the terms of ``x`` that the 0/1 matrix ``m`` selects (fp32, HIGHEST)."""
    return jnp.einsum(spec, jnp.asarray(m), x, precision=HIGHEST)


def dot(spec: str, a: Array, b: Array, dtype) -> Array:
    """einsum with both operands in ``dtype`` and fp32 accumulation."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=f32)


def _pad(x: Array, P: int) -> Array:
    """[..., C, D] -> [..., P, D] with zero rows."""
    C = x.shape[-2]
    return x if P == C else jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, P - C), (0, 0)])


def _diag(q: Array, k: Array, scale: float) -> Array:
    """A's diagonal as a matrix: scale * q_r . k_r on [..., C, C]."""
    C = q.shape[-2]
    return scale * jnp.eye(C, dtype=f32) * jnp.sum(q * k, axis=-1)[..., None, :]


# ----- full layout ------------------------------------------------------------------------------
def _full_factors(g: Array) -> tuple[dict, Array, Array]:
    """(matrices, e^{head} on upper rows, e^{tail} on lower rows), [L, ..., P, K], 0 elsewhere."""
    m = level_matrices(g.shape[-2])
    gp = _pad(g, padded(g.shape[-2]))
    upper = jnp.asarray(m["upper"]).reshape(-1, *([1] * (g.ndim - 2)), gp.shape[-2], 1)
    e = jnp.exp(sums(m["sides"], "lrt,...tk->l...rk", gp))
    return m, jnp.where(upper, e, 0.0), jnp.where(upper, 0.0, e)


def _block_mask(m: dict, ndim: int) -> Array:
    return jnp.asarray(m["block"]).reshape(-1, *([1] * (ndim - 2)), *m["block"].shape[1:]) > 0


def scores_full(q: Array, k: Array, g: Array, scale: float, dtype) -> Array:
    """A [..., C, C] fp32 from q, k, g [..., C, K] fp32: one full-width matmul per level."""
    C, P = q.shape[-2], padded(q.shape[-2])
    m, e_head, e_tail = _full_factors(g)
    a = dot("l...rk,l...sk->l...rs", _pad(q, P)[None] * e_head, _pad(k, P)[None] * e_tail, dtype)
    A = jnp.sum(jnp.where(_block_mask(m, q.ndim), a, 0.0), axis=0)[..., :C, :C]
    return scale * A + _diag(q, k, scale)


def scores_bwd_full(q: Array, k: Array, g: Array, dA: Array, scale: float, dtype) -> tuple[Array, Array, Array]:
    """(dq, dk, dg) [..., C, K] fp32 of ``scores_full`` given dA [..., C, C] (only its lower
    triangle and diagonal are read)."""
    C, P = q.shape[-2], padded(q.shape[-2])
    m, e_head, e_tail = _full_factors(g)
    qp, kp = _pad(q, P), _pad(k, P)
    dAp = jnp.pad(dA, [(0, 0)] * (dA.ndim - 2) + [(0, P - C), (0, P - C)])
    dAl = jnp.where(_block_mask(m, q.ndim), dAp[None], 0.0)
    dq_l = scale * e_head * dot("l...rs,l...sk->l...rk", dAl, kp[None] * e_tail, dtype)
    dk_l = scale * e_tail * dot("l...rs,l...rk->l...sk", dAl, qp[None] * e_head, dtype)
    # dq_l lives on upper rows, dk_l on lower ones: one sum per level for both
    dg = sums(m["sides"], "lrt,l...rk->...tk", qp[None] * dq_l + kp[None] * dk_l)
    d = scale * jnp.diagonal(dA, axis1=-2, axis2=-1)[..., None]
    return jnp.sum(dq_l, 0)[..., :C, :] + d * k, jnp.sum(dk_l, 0)[..., :C, :] + d * q, dg[..., :C, :]


# ----- blocks layout ----------------------------------------------------------------------------
def _halves(x: Array, h: int) -> tuple[Array, Array]:
    """[..., P, D] -> (lower, upper) halves of every 2h-row block, each [..., P / 2h, h, D]."""
    y = x.reshape(*x.shape[:-2], x.shape[-2] // (2 * h), 2, h, x.shape[-1])
    return y[..., 0, :, :], y[..., 1, :, :]


def _join(lower: Array | None, upper: Array | None) -> Array:
    """Inverse of ``_halves``; a missing half is zeros."""
    ref = lower if lower is not None else upper
    y = jnp.stack([jnp.zeros_like(ref) if x is None else x for x in (lower, upper)], axis=-3)
    return y.reshape(*y.shape[:-4], -1, y.shape[-1])


def _levels_blocks(q: Array, k: Array, g: Array):
    """Per level, coarsest first: (h, q and k of the upper / lower halves, e^{head}, e^{tail})."""
    P = padded(q.shape[-2])
    q, k, g = (_pad(x, P) for x in (q, k, g))
    h = P // 2
    while h >= 1:
        m = level_matrices(h)  # head: inclusive sums within an upper half; tail: reverse exclusive in a lower
        g_lo, g_up = _halves(g, h)
        e_head = jnp.exp(sums(m["incl"], "rt,...tk->...rk", g_up))
        e_tail = jnp.exp(sums(m["rev_excl"], "rt,...tk->...rk", g_lo))
        yield h, _halves(q, h)[1], _halves(k, h)[0], e_head, e_tail
        h //= 2


def _embed(X: Array, h: int) -> Array:
    """Level blocks X [..., n, h, h] into a [..., 2hn, 2hn] matrix (block n's upper rows x lower columns)."""
    n = X.shape[-3]
    on_diag = X[..., :, :, None, :] * jnp.eye(n, dtype=X.dtype)[:, None, :, None]  # [..., n, h, n, h]
    z = jnp.zeros_like(on_diag)
    y = jnp.stack([jnp.stack([z, z], -2), jnp.stack([on_diag, z], -2)], -5)  # [..., n, 2, h, n, 2, h]
    return y.reshape(*X.shape[:-3], 2 * h * n, 2 * h * n)


def _extract(dA: Array, h: int) -> Array:
    """The level blocks [..., n, h, h] of a [..., 2hn, 2hn] matrix (inverse of ``_embed``)."""
    n = dA.shape[-1] // (2 * h)
    y = dA.reshape(*dA.shape[:-2], n, 2, h, n, 2, h)[..., :, 1, :, :, 0, :]  # [..., n, h, n, h]
    return jnp.moveaxis(jnp.diagonal(y, axis1=-4, axis2=-2), -1, -3)


def scores_blocks(q: Array, k: Array, g: Array, scale: float, dtype) -> Array:
    """A [..., C, C] fp32 from q, k, g [..., C, K] fp32: each level's pairs as [n, h, h] blocks."""
    C, P = q.shape[-2], padded(q.shape[-2])
    A = jnp.zeros((*q.shape[:-2], P, P), f32)
    for h, qu, kl, eh, et in _levels_blocks(q, k, g):
        A = A + _embed(dot("...nrk,...nsk->...nrs", qu * eh, kl * et, dtype), h)
    return scale * A[..., :C, :C] + _diag(q, k, scale)


def scores_bwd_blocks(q: Array, k: Array, g: Array, dA: Array, scale: float, dtype) -> tuple[Array, Array, Array]:
    """(dq, dk, dg) [..., C, K] fp32 of ``scores_blocks`` given dA [..., C, C] (only its lower
    triangle and diagonal are read)."""
    C, P = q.shape[-2], padded(q.shape[-2])
    dAp = jnp.pad(dA, [(0, 0)] * (dA.ndim - 2) + [(0, P - C), (0, P - C)])
    dq = dk = dg = jnp.zeros((*q.shape[:-2], P, q.shape[-1]), f32)
    for h, qu, kl, eh, et in _levels_blocks(q, k, g):
        m = level_matrices(h)
        dX = _extract(dAp, h)
        dq_up = scale * eh * dot("...nrs,...nsk->...nrk", dX, kl * et, dtype)
        dk_lo = scale * et * dot("...nrs,...nrk->...nsk", dX, qu * eh, dtype)
        dg_up = sums(m["incl"], "rt,...rk->...tk", qu * dq_up)
        dg_lo = sums(m["rev_excl"], "st,...sk->...tk", kl * dk_lo)
        dq, dk, dg = dq + _join(None, dq_up), dk + _join(dk_lo, None), dg + _join(dg_lo, dg_up)
    d = scale * jnp.diagonal(dA, axis1=-2, axis2=-1)[..., None]
    return dq[..., :C, :] + d * k, dk[..., :C, :] + d * q, dg[..., :C, :]


# ----- per layout ------------------------------------------------------------------------------
def scores(q: Array, k: Array, g: Array, scale: float, dtype, layout: str) -> Array:
    """A [..., C, C] fp32 (zero above the diagonal) in ``layout`` ("full" or "blocks")."""
    fn = scores_full if layout == "full" else scores_blocks
    with jax.named_scope(XLA_SCORES_SCOPE.format(layout=layout)):  # what a compiled program ran, by name
        return fn(q, k, g, scale, dtype)


def scores_bwd(q: Array, k: Array, g: Array, dA: Array, scale: float, dtype, layout: str):
    """(dq, dk, dg) of ``scores`` in ``layout`` ("full" or "blocks")."""
    fn = scores_bwd_full if layout == "full" else scores_bwd_blocks
    with jax.named_scope(XLA_SCORES_SCOPE.format(layout=f"bwd_{layout}")):
        return fn(q, k, g, dA, scale, dtype)
