"""Chunkwise GLA: ``chunk_gla``, the public entry (any T, either kernel), and the XLA kernel with a
hand-written backward (``jax.custom_vjp``).

Per (batch, head), the sequence is cut into chunks of C tokens and each chunk into n sub-blocks
of c = 16 tokens. Inside a chunk, with b_r the inclusive cumulative log-decay and s the scale:

    o_r    = s (q_r * e^{b_r})^T S  +  sum_{j <= r} A[r, j] v_j,   A[r, j] = s sum_k q_rk k_jk e^{b_rk - b_jk}
    S_next = e^{b_C} * S  +  sum_j (k_j * e^{b_C - b_j}) v_j^T

Exactness: every decay factor is the exp of a *direct* sum of log-decays (each <= 0), never of a
difference of two cumulative sums, so nothing overflows and nothing cancels however strong the
decay. Off-diagonal sub-blocks (i > j) factor e^{b_r - b_s} through the sub-blocks between:
e^{head_r} e^{gap_ij} e^{tail_s}; diagonal sub-blocks build the pairwise factor one diagonal
d = r - s at a time, as a product of d factors <= 1.

Forward: a ``lax.scan`` over chunks carries the fp32 state; each step computes its chunk's
scores, output and next state, and emits the state it started from and its scores. Autodiff
saves only the inputs, those chunk-start states [N, B, H, K, V] fp32 and the scores
[N, B, H, C, C] fp32 (fla's kernel keeps the scores too; recomputing the states would cost a
second scan). Backward: a reverse ``lax.scan`` carries dS (the gradient on the state at the end
of the chunk) and, per chunk, returns dq, dk, dv and dg.

The gate gradient, without cancellation. Over the whole sequence, o_r = s sum_{u <= r} (q_r *
k_u * e^{B_r - B_u}) . v_u (plus the initial state as a key before the sequence), and g_t enters
exactly the decay factors of the pairs (r, u) with u < t <= r. So, per key channel,

    dg_t = sum_{u < t <= r} P[r, u],    P[r, u] = s q_r k_u e^{B_r - B_u} (do_r . v_u)

fla (and this kernel before) evaluates it as reverse-cumsum_t(q * dq - k * dk): q_r dq_r sums
P[r, u] over all u <= r and k_u dk_u over all r >= u, so the difference keeps the pairs with
u < t <= r, but both sums also hold every pair with u >= t, the diagonal u = r (decay 1) among
them. Under strong decay those dominate both sums and cancel, leaving the wanted cross terms
(about e^{g} smaller) at fp32 rounding noise: 0.2 relative per element at -16 nats/token.

Here dg is a sum of wanted pairs only, grouped by where r and u sit relative to t:
- r in this chunk, u before it (through the chunk-start state): sum_{r >= t} q_r dq_r^state;
- u in this chunk, r after it (through the chunk-end state): sum_{u < t} k_u dk_u^state;
- u before and r after the chunk: e^{b_C} rowsum(S * dS), the same for every t in the chunk;
- both in the chunk, in sub-blocks i > j: for t in i, sum_{r >= t in i} q_r dq_r^{<i} (keys
  from earlier sub-blocks); for t in j, sum_{u < t in j} k_u dk_u^{>j} (queries from later
  ones); for t in a whole sub-block m with j < m < i, the sub-block pair's total
  sum_{r in i, u in j} P[r, u];
- both in one sub-block, u = r - d (d >= 1): P[r, r - d] reaches t = r - e for e < d, so with
  W_e = sum_{d > e} P[., . - d] (summed walking d down), dg_t += sum_e W_e[t + e].
Every term is a product of direct-sum decays (no difference of cumulative sums), and the sums
are of the wanted pairs only: dg matches a float64 recurrence to ~3e-7 at every decay from
-0.01 to -16 nats/token (``benchmarks/bench_decay_sweep.py``).

Matmuls between inputs and states take the input dtype with fp32 accumulation; scores, their
gradients and every decay stay fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.config import SUB_BLOCK, pallas_chunk_ok
from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.pallas import pallas_gla, pallas_interpret
from laplace_jax.ops.gla.sums import excl_cumsum, rev_excl_cumsum, rev_incl_cumsum, shift_down, shift_up

Array = jax.Array

f32 = jnp.float32


def _dot(spec: str, a: Array, b: Array, dtype: jnp.dtype) -> Array:
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=f32)


class _Decays:
    """Decay factors of one chunk, split in sub-blocks: x [..., C, K] -> [..., n, c, K]."""

    def __init__(self, g_CxK: Array):
        *lead, C, K = g_CxK.shape
        self.c = min(SUB_BLOCK, C)
        self.n = C // self.c
        gs = g_CxK.reshape(*lead, self.n, self.c, K)
        self.step = jnp.exp(gs)  # e^{g_r}
        self.head = jnp.exp(jnp.cumsum(gs, axis=-2))  # sub-block start .. r (inclusive)
        self.tail = jnp.exp(rev_excl_cumsum(gs, axis=-2))  # s (exclusive) .. sub-block end
        self.block = jnp.sum(gs, axis=-2)  # [..., n, K], whole sub-block

    def split(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-2], self.n, self.c, x.shape[-1])

    def gaps(self, i: int) -> Array:
        """e^{sum of whole sub-blocks strictly between j and i}, for j < i: [..., i, K]."""
        return jnp.exp(rev_excl_cumsum(self.block[..., :i, :], axis=-2))

    def diagonals(self):
        """(d, decay_d) for d = 0..c-1: decay_d[r] = prod_{r-d < t <= r} e^{g_t} inside a sub-block."""
        decay = jnp.ones_like(self.step)
        for d in range(self.c):
            if d:
                decay = decay * shift_down(self.step, d - 1, axis=-2)
            yield d, decay


def _panel(kt: Array, w: Array) -> Array:
    """Keys of sub-blocks j < i scaled to the start of sub-block i: [..., i, c, K] x [..., i, K] -> [..., i*c, K]."""
    x = kt * w[..., None, :]
    return x.reshape(*x.shape[:-3], -1, x.shape[-1])


def _scores(q: Array, k: Array, dec: _Decays, scale: float) -> Array:
    """Causal scores A [..., C, C] fp32 (zero above the diagonal) from q, k [..., C, K].

    Row panel i: sub-block i against all earlier keys in one matmul (q scaled from the start of
    i, keys scaled to it), then its own diagonal sub-block built diagonal by diagonal."""
    n, c = dec.n, dec.c
    qs, ks = dec.split(q.astype(f32)), dec.split(k.astype(f32))
    qh, kt = qs * dec.head, ks * dec.tail
    # one reduction over K for all diagonals (not one per diagonal): XLA then reduces in the same
    # order compiled and op-by-op, which keeps --exact runs bit-identical to jax.disable_jit
    terms = jnp.stack([qs * decay * shift_down(ks, d, -2) for d, decay in dec.diagonals()], -3)
    by_diag = jnp.sum(terms, axis=-1)  # [..., n, c(d), c(r)]
    r, s = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    diag = by_diag[..., jnp.maximum(r - s, 0), r] * (s <= r)  # [..., n, c(r), c(s)]
    lead = qs.shape[:-3]
    rows = []
    for i in range(n):
        parts = (
            [jnp.einsum("...rk,...sk->...rs", qh[..., i, :, :], _panel(kt[..., :i, :, :], dec.gaps(i)))] if i else []
        )
        parts += [diag[..., i, :, :], jnp.zeros((*lead, c, (n - 1 - i) * c), f32)]
        rows.append(jnp.concatenate(parts, axis=-1))
    return scale * jnp.concatenate(rows, axis=-2)


def _straddle_mask(n: int) -> Array:
    """[n(m), n(i), n(j), 1] float: 1 where sub-block m lies strictly between j < m < i."""
    m, i, j = (jnp.arange(n).reshape(shape) for shape in ((n, 1, 1), (1, n, 1), (1, 1, n)))
    return ((j < m) & (m < i)).astype(f32)[..., None]


def _scores_bwd(q: Array, k: Array, dec: _Decays, dA: Array, scale: float) -> tuple[Array, Array, Array]:
    """Gradients of ``_scores`` wrt q, k and the log-decays g, all [..., C, K] fp32, given dA
    [..., C, C] (lower triangle).

    dg comes from pair sums: a pair (r, s), s < r, contributes P[r, s] = dA[r, s] s q_r k_s
    e^{b_r - b_s} to every g_t with s < t <= r. By where r and s sit (sub-blocks i >= j):
    t in i's sub-block (reverse sum over r of q * dq from earlier sub-blocks), t in j's (forward
    sum over s of k * dk from later sub-blocks), t in a whole sub-block strictly between (the
    sub-block pair's total), and, for i = j, the diagonal d = r - s terms summed over the window."""
    n, c = dec.n, dec.c
    qs, ks = dec.split(q.astype(f32)), dec.split(k.astype(f32))
    qh, kt = qs * dec.head, ks * dec.tail
    lead = qs.shape[:-3]
    zero = jnp.zeros_like(qs[..., 0, :, :])
    dq_rows, dk_parts = [zero], [[zero] for _ in range(n)]  # dk_parts[j]: contributions to key sub-block j
    pair_totals = jnp.zeros((*lead, n, n, qs.shape[-1]), f32)  # [..., i, j, K]: sum of P over sub-blocks i x j
    for i in range(1, n):
        w = dec.gaps(i)
        dA_i = dA[..., i * c : (i + 1) * c, : i * c]  # [..., c(r), i*c]
        dq_rows.append(jnp.einsum("...rs,...sk->...rk", dA_i, _panel(kt[..., :i, :, :], w)))
        dkt = jnp.einsum("...rs,...rk->...sk", dA_i, qh[..., i, :, :]).reshape(*lead, i, c, -1) * w[..., None, :]
        pair_totals = pair_totals.at[..., i, :i, :].set(jnp.sum(dkt * kt[..., :i, :, :], axis=-2))
        for j in range(i):
            dk_parts[j].append(dkt[..., j, :, :])
    dq = jnp.stack(dq_rows, axis=-3) * dec.head
    dk = jnp.stack([sum(parts) for parts in dk_parts], axis=-3) * dec.tail
    between = jnp.sum(pair_totals[..., None, :, :, :] * _straddle_mask(n), axis=(-3, -2))  # [..., n(m), K]
    dg = rev_incl_cumsum(qs * dq, -2) + excl_cumsum(ks * dk, -2) + between[..., None, :]
    dA4 = dA.reshape(*dA.shape[:-2], n, c, n, c)
    own = jnp.moveaxis(jnp.diagonal(dA4, axis1=-4, axis2=-2), -1, -3)  # [..., n, c(r), c(s)]
    d_idx, r_idx = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    coefs = own[..., r_idx, jnp.maximum(r_idx - d_idx, 0)] * (r_idx >= d_idx)  # [..., n, c(d), c(r)]: dA[r, r-d]
    window = jnp.zeros_like(qs)  # sum over d' >= d of the pair terms P[r, r - d'], d walking down
    for d, decay in reversed(list(dec.diagonals())):
        term = coefs[..., d, :, None] * decay
        k_d = shift_down(ks, d, -2)
        dq = dq + term * k_d
        dk = dk + shift_up(term * qs, d, -2)
        if d:  # the pair (r, r - d) reaches g_t for r - d < t <= r: t = r - e with e < d
            window = window + term * qs * k_d
            dg = dg + shift_up(window, d - 1, -2)
    shape = q.shape
    return scale * dq.reshape(shape), scale * dk.reshape(shape), scale * dg.reshape(shape)


def _fwd_chunk(q, k, v, g, S, scale, dtype):
    """One chunk: q, k, g [B, H, C, K], v [B, H, C, V], S [B, H, K, V] fp32 -> (o fp32, S_next, A)."""
    dec = _Decays(g)
    b = jnp.cumsum(g, axis=-2)
    A = _scores(q, k, dec, scale)
    o = _dot("bhrs,bhsv->bhrv", A, v, dtype) + _dot("bhck,bhkv->bhcv", q.astype(f32) * (scale * jnp.exp(b)), S, dtype)
    k_state = k.astype(f32) * jnp.exp(rev_excl_cumsum(g, axis=-2))  # decay from s to the chunk end
    S_next = jnp.exp(jnp.sum(g, axis=-2))[..., None] * S + _dot("bhck,bhcv->bhkv", k_state, v, dtype)
    return o, S_next, A


def _bwd_chunk(q, k, v, g, S, A, do, dS, scale, dtype):
    """Gradients of ``_fwd_chunk`` given its scores A, do [B, H, C, V] and dS (on S_next):
    (dq, dk, dv, dg, dS_prev)."""
    dec = _Decays(g)
    e_b = jnp.exp(jnp.cumsum(g, axis=-2))
    e_tail = jnp.exp(rev_excl_cumsum(g, axis=-2))
    e_C = jnp.exp(jnp.sum(g, axis=-2))  # [B, H, K]
    qf, kf = q.astype(f32), k.astype(f32)
    # through the state: o_inter = (s q e^b)^T S and S_next = e^C S + (k e^tail)^T v
    dq = scale * e_b * _dot("bhcv,bhkv->bhck", do, S, dtype)
    dk_state = e_tail * _dot("bhcv,bhkv->bhck", v, dS, dtype)
    dv = _dot("bhck,bhkv->bhcv", kf * e_tail, dS, dtype)
    dS_prev = e_C[..., None] * dS + _dot("bhck,bhcv->bhkv", qf * (scale * e_b), do, dtype)
    # through the scores
    dA = jnp.tril(_dot("bhrv,bhsv->bhrs", do, v, f32))
    dv = dv + _dot("bhrs,bhrv->bhsv", A, do, dtype)
    dq_a, dk_a, dg = _scores_bwd(q, k, dec, dA, scale)
    # the gate through the state, as pair sums: pairs (r in the chunk, s before it) reach g_t for
    # t <= r, pairs (r after, s in the chunk) for t > s, pairs straddling the chunk every t in it
    dg = dg + rev_incl_cumsum(qf * dq, -2) + excl_cumsum(kf * dk_state, -2)
    dg = dg + (e_C * jnp.sum(S * dS, axis=-1))[..., None, :]
    dq, dk = dq + dq_a, dk_state + dk_a
    return dq, dk, dv, dg, dS_prev


def _to_chunks(x: Array, C: int) -> Array:
    """[B, T, H, D] (T a multiple of C) -> [N, B, H, C, D]."""
    B, T, H, D = x.shape
    return x.reshape(B, T // C, C, H, D).transpose(1, 0, 3, 2, 4)


def _from_chunks(x: Array) -> Array:
    """[N, B, H, C, D] -> [B, N * C, H, D]."""
    N, B, H, C, D = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, D)


def _forward(q, k, v, g, s0, scale, C):
    """(o [B, T, H, V], final state, chunk-start states [N, B, H, K, V], scores [N, B, H, C, C])."""
    dtype = q.dtype

    def step(S, xs):
        q_n, k_n, v_n, g_n = xs
        o_n, S_next, A_n = _fwd_chunk(q_n, k_n, v_n, g_n.astype(f32), S, scale, dtype)
        return S_next, (o_n.astype(v.dtype), S, A_n)

    xs = tuple(_to_chunks(x, C) for x in (q, k, v, g))
    sT, (o, starts, scores) = jax.lax.scan(step, s0.astype(f32), xs)
    return _from_chunks(o), sT, starts, scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def chunk_gla_padded(q: Array, k: Array, v: Array, g: Array, s0: Array, scale: float, C: int) -> tuple[Array, Array]:
    """GLA over T = N * C tokens (already padded): (o [B, T, H, V], final state [B, H, K, V] fp32)."""
    o, sT, _, _ = _forward(q, k, v, g, s0, scale, C)
    return o, sT


def _vjp_fwd(q, k, v, g, s0, scale, C):
    o, sT, starts, scores = _forward(q, k, v, g, s0, scale, C)
    saved = tuple(checkpoint_name(x, "gla_states") for x in (starts, scores))  # model.remat="save_gla" keeps them
    return (o, sT), (q, k, v, g, s0, *saved)


def _vjp_bwd(scale, C, res, cot):
    q, k, v, g, s0, starts, scores = res
    do, dsT = cot
    dtype = q.dtype

    def step(dS, xs):
        q_n, k_n, v_n, g_n, S_n, A_n, do_n = xs
        dq, dk, dv, dg, dS_prev = _bwd_chunk(q_n, k_n, v_n, g_n.astype(f32), S_n, A_n, do_n, dS, scale, dtype)
        return dS_prev, (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype))

    xs = (*(_to_chunks(x, C) for x in (q, k, v, g)), starts, scores, _to_chunks(do, C))
    ds0, grads = jax.lax.scan(step, dsT.astype(f32), xs, reverse=True)
    dq, dk, dv, dg = (_from_chunks(x) for x in grads)
    return dq, dk, dv, dg, ds0.astype(s0.dtype)


chunk_gla_padded.defvjp(_vjp_fwd, _vjp_bwd)


KERNELS = ("xla", "pallas")  # the XLA kernel below, or the Pallas one (ops/gla/pallas.py)


def chunk_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 128,
    kernel: str = "xla",
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """Chunkwise-parallel GLA. Returns (o [B, T, H, V], final_state [B, H, K, V] fp32).

    Any T >= 1: the tail is padded with state-neutral positions (q = k = v = 0, g = 0).
    ``chunk_size``: for the XLA kernel a multiple of 16 or one of 1, 2, 4, 8; for the Pallas kernel a
    power of two >= 16.
    ``kernel``: "xla" (the kernel above: lax.scan, any backend) or "pallas" (``ops/gla/pallas.py``: a
    Triton-lowered GPU kernel). ``interpret`` runs the Pallas kernel in the Pallas interpreter;
    None means "on CPU only". Both kernels have the same numerics contract and gradients.
    """
    check_inputs(q, k, v, g, initial_state)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if kernel == "pallas" and not pallas_chunk_ok(chunk_size):
        raise ValueError(f"the Pallas kernel needs chunk_size a power of two, at least {SUB_BLOCK}; got {chunk_size}")
    if chunk_size <= 0 or (chunk_size % SUB_BLOCK and SUB_BLOCK % chunk_size):
        raise ValueError(
            f"chunk_size must be a positive multiple of {SUB_BLOCK} (the XLA kernel also takes 1, 2, 4, 8); "
            f"got {chunk_size}"
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
    if kernel == "pallas":
        interpret = pallas_interpret() if interpret is None else interpret
        return pallas_gla(q, k, v, g, s0, scale=scale, chunk_size=chunk_size, interpret=interpret)
    pad = (-T) % chunk_size
    if pad:  # state-neutral tail: q = k = v = 0, g = 0
        q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
    o, final_state = chunk_gla_padded(q, k, v, g, s0, scale, chunk_size)
    return o[:, :T], final_state
