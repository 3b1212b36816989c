"""Chunkwise GLA: ``chunk_gla``, the public entry (any T, either kernel), and the XLA kernel with a
hand-written backward (``jax.custom_vjp``).

Per (batch, head), the sequence is cut into N chunks of C tokens. Inside a chunk, with b_r the
inclusive cumulative log-decay and s the scale:

    o_r    = s (q_r * e^{b_r})^T S_c  +  sum_{j <= r} A[r, j] v_j,   A[r, j] = s sum_k q_rk k_jk e^{b_rk - b_jk}
    S_c+1  = e^{b_C} * S_c  +  sum_j (k_j * e^{b_C - b_j}) v_j^T

Exactness: every decay factor is the exp of a *direct* sum of log-decays (each <= 0), never of a
difference of two cumulative sums, so nothing overflows and nothing cancels however strong the
decay. e^{b_r} and e^{b_C - b_j} are sums from the chunk's start and to its end; the scores'
pairwise factors e^{b_r - b_j} go through the chunk's dyadic levels (``levels.py``: one matmul
per level, each factor a product of two direct sums <= 0).

Forward: a loop over chunk indices (``lax.fori_loop``) carries the fp32 state; each step slices
its chunk of q, k, v, g straight from the [B, T, H, D] inputs, computes the chunk's scores,
output and next state, and writes the output, the state it started from and its scores in place.
Autodiff saves only the inputs, those chunk-start states [N, B, H, K, V] fp32 and the scores
[N, B, H, C, C] fp32 (fla's kernel keeps the scores too; recomputing the states would cost a
second pass). Backward: the same loop in reverse carries dS (the gradient on the state at the
end of the chunk) and writes each chunk's dq, dk, dv and dg in place.

Why this loop, on the TPU compiler's estimate (3B layer, v5e; ``docs/tpu.md``): a ``lax.scan``
over inputs first transposed to [N, B, H, C, D] makes XLA keep the chunk axis inside the
transposed copy's tiles, so every step's slice of g is a 1 x 128-tiled gather (20% of the
forward); slicing [B, T, H, D] along T keeps 8 x 128 tiles. The same loop written as
``lax.scan`` over ``arange(N)`` estimated 17% slower than ``fori_loop`` on the v5e forward.
The output and gradient buffers start as copies of inputs of their shape (every chunk is
overwritten), which the estimate prices below a zero fill. A scan over groups of chunks,
batched inside, is no faster for forward + backward, and its temporaries grow with the group.

The gate gradient, without cancellation. Over the whole sequence, o_r = s sum_{u <= r} (q_r *
k_u * e^{B_r - B_u}) . v_u (plus the initial state as a key before the sequence), and g_t enters
exactly the decay factors of the pairs (r, u) with u < t <= r. So, per key channel,

    dg_t = sum_{u < t <= r} P[r, u],    P[r, u] = s q_r k_u e^{B_r - B_u} (do_r . v_u)

fla (and this kernel before wave 3) evaluates it as reverse-cumsum_t(q * dq - k * dk): q_r dq_r
sums P[r, u] over all u <= r and k_u dk_u over all r >= u, so the difference keeps the pairs with
u < t <= r, but both sums also hold every pair with u >= t, the diagonal u = r (decay 1) among
them. Under strong decay those dominate both sums and cancel, leaving the wanted cross terms
(about e^{g} smaller) at fp32 rounding noise: 0.2 relative per element at -16 nats/token.

Here dg is a sum of wanted pairs only, grouped by where r and u sit relative to t:
- r in this chunk, u before it (through the chunk-start state): sum_{r >= t} q_r dq_r^state;
- u in this chunk, r after it (through the chunk-end state): sum_{u < t} k_u dk_u^state;
- u before and r after the chunk: e^{b_C} rowsum(S * dS), the same for every t in the chunk;
- both in the chunk: by level (``levels.py``), sum_{r >= t in t's upper half} (q dq_l)_r plus
  sum_{u < t in t's lower half} (k dk_l)_u.
Every term is a product of direct-sum decays, and the sums are of the wanted pairs only: dg
matches a float64 recurrence to ~3e-7 at every decay from -0.01 to -16 nats/token
(``benchmarks/bench_decay_sweep.py``). Cumulative sums along a chunk are products with 0/1
matrices at HIGHEST precision (``levels.sums``): the selected terms added as they are.

Matmuls between inputs and states take the input dtype with fp32 accumulation, as do the
scores' level matmuls; the scores, their gradients and every decay stay fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.levels import LAYOUTS, dot, level_matrices, scores, scores_bwd, sums
from laplace_jax.ops.gla.limits import chunk_size_problem
from laplace_jax.platform import SYSTOLIC, per_platform

Array = jax.Array

f32 = jnp.float32


def _chunk(x: Array, c, C: int) -> Array:
    """Chunk c of x [B, T, H, D] as [B, H, C, D]."""
    return jnp.swapaxes(jax.lax.dynamic_slice_in_dim(x, c * C, C, 1), 1, 2)


def _put(x: Array, x_c: Array, c, C: int) -> Array:
    """x [B, T, H, D] with chunk c replaced by x_c [B, H, C, D]."""
    return jax.lax.dynamic_update_slice_in_dim(x, jnp.swapaxes(x_c, 1, 2).astype(x.dtype), c * C, 1)


def _decays(g: Array) -> tuple[Array, Array, Array]:
    """One chunk's g [B, H, C, K] fp32 -> e^{b} (b the inclusive cumulative log-decay), e^{tail}
    (the reverse exclusive one) and e^{total} [B, H, K]: every exponent a direct sum."""
    m = level_matrices(g.shape[-2])
    b, tail = sums(m["incl"], "rt,...tk->...rk", g), sums(m["rev_excl"], "rt,...tk->...rk", g)
    return jnp.exp(b), jnp.exp(tail), jnp.exp(jnp.sum(g, axis=-2))


def _fwd_chunk(S, xs, scale, layout):
    """One chunk q, k, v, g [B, H, C, .] from state S [B, H, K, V]: (S_next, (o, S, scores))."""
    q, k, v, g = xs
    dtype = q.dtype
    qf, kf = q.astype(f32), k.astype(f32)
    e_b, e_tail, e_tot = _decays(g)
    A = scores(qf, kf, g, scale, dtype, layout)
    o = dot("bhrs,bhsv->bhrv", A, v, dtype) + dot("bhck,bhkv->bhcv", qf * (scale * e_b), S, dtype)
    S_next = e_tot[..., None] * S + dot("bhck,bhcv->bhkv", kf * e_tail, v, dtype)
    return S_next, (o.astype(v.dtype), S, A)


def _forward(q, k, v, g, s0, scale, C, layout):
    """(o [B, T, H, V], final state, chunk-start states [N, B, H, K, V], scores [N, B, H, C, C])."""
    B, T, H, _ = q.shape
    N = T // C
    step = functools.partial(_fwd_chunk, scale=scale, layout=layout)
    g = g.astype(f32)

    def body(c, carry):
        S, o, starts, A = carry
        S_next, (o_c, S_c, A_c) = step(S, tuple(_chunk(x, c, C) for x in (q, k, v, g)))
        o = _put(o, o_c, c, C)
        starts = jax.lax.dynamic_update_index_in_dim(starts, S_c, c, 0)
        A = jax.lax.dynamic_update_index_in_dim(A, A_c, c, 0)
        return S_next, o, starts, A

    # every chunk of o is overwritten: starting from v (o's shape) spares a zero fill
    buffers = (v, jnp.zeros((N, *s0.shape), f32), jnp.zeros((N, B, H, C, C), f32))
    init = (s0.astype(f32), *buffers)
    sT, o, starts, A = jax.lax.fori_loop(0, N, body, init)
    return o, sT, starts, A


def _per_layout(fn, layout: str, *args):
    """``fn(*args, layout=...)``; "auto": the layout of the platform the program is compiled for
    ("full" for TPU and Neuron, ``platform.SYSTOLIC``; ``platform.per_platform``). Called inside
    the custom VJP's rules, so autodiff never differentiates the per-platform branch (the compiled
    ops keep their sources)."""
    if layout != "auto":
        return fn(*args, layout=layout)
    full = functools.partial(fn, layout="full")
    return per_platform(*args, default=functools.partial(fn, layout="blocks"), **dict.fromkeys(SYSTOLIC, full))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def chunk_gla_padded(
    q: Array, k: Array, v: Array, g: Array, s0: Array, scale: float, C: int, layout: str
) -> tuple[Array, Array]:
    """GLA over T = N * C tokens (already padded): (o [B, T, H, V], final state [B, H, K, V] fp32)."""
    o, sT, _, _ = _per_layout(functools.partial(_forward, scale=scale, C=C), layout, q, k, v, g, s0)
    return o, sT


def _vjp_fwd(q, k, v, g, s0, scale, C, layout):
    o, sT, starts, scores = _per_layout(functools.partial(_forward, scale=scale, C=C), layout, q, k, v, g, s0)
    saved = tuple(checkpoint_name(x, "gla_states") for x in (starts, scores))  # model.remat="save_gla" keeps them
    return (o, sT), (q, k, v, g, s0, *saved)


def _bwd_chunk(dS, xs, scale, layout):
    """One chunk backwards, given dS (the gradient on the state at its end): (dS at its start, grads)."""
    q, k, v, g, do, S, A = xs
    dtype = q.dtype
    qf, kf = q.astype(f32), k.astype(f32)
    e_b, e_tail, e_tot = _decays(g)
    e_b = scale * e_b
    # through the state: o_inter = (s q e^b) S and S_next = e^{total} S + (k e^{tail})^T v
    dq = e_b * dot("bhcv,bhkv->bhck", do, S, dtype)
    dk = e_tail * dot("bhcv,bhkv->bhck", v, dS, dtype)
    dv = dot("bhck,bhkv->bhcv", kf * e_tail, dS, dtype) + dot("bhrs,bhrv->bhsv", A, do, dtype)
    dS_prev = e_tot[..., None] * dS + dot("bhck,bhcv->bhkv", qf * e_b, do, dtype)
    # the gate through the state, as pair sums: pairs (r in the chunk, s before it) reach g_t for
    # t <= r, pairs (r after, s in the chunk) for t > s, pairs straddling the chunk every t in it
    m = level_matrices(q.shape[-2])
    dg = sums(m["incl"], "rt,...rk->...tk", qf * dq) + sums(m["rev_excl"], "st,...sk->...tk", kf * dk)
    dg = dg + (e_tot * jnp.sum(S * dS, axis=-1))[..., None, :]
    # through the scores: dA's upper triangle is never read (each level pairs its lower rows with
    # its upper ones), so no tril
    dA = dot("bhrv,bhsv->bhrs", do, v, f32)
    dq_a, dk_a, dg_a = scores_bwd(qf, kf, g, dA, scale, dtype, layout)
    grads = (dq + dq_a, dk + dk_a, dv, dg + dg_a)
    return dS_prev, tuple(x.astype(d.dtype) for x, d in zip(grads, (q, k, v, g), strict=True))


def _vjp_bwd(scale, C, layout, res, cot):
    return _per_layout(functools.partial(_backward, scale=scale, C=C), layout, res, cot)


def _backward(res, cot, *, scale: float, C: int, layout: str):
    q, k, v, g, s0, starts, A = res
    do, dsT = cot
    N = q.shape[1] // C
    step = functools.partial(_bwd_chunk, scale=scale, layout=layout)
    gf = g.astype(f32)

    def body(i, carry):
        c = N - 1 - i
        dS, grads = carry
        xs = tuple(_chunk(x, c, C) for x in (q, k, v, gf, do))
        dS_prev, g_c = step(dS, (*xs, starts[c], A[c]))
        return dS_prev, tuple(_put(x, x_c, c, C) for x, x_c in zip(grads, g_c, strict=True))

    init = (dsT.astype(f32), (q, k, v, g))  # every chunk is overwritten: the inputs spare a zero fill
    ds0, grads = jax.lax.fori_loop(0, N, body, init)
    return (*grads, ds0.astype(s0.dtype))


chunk_gla_padded.defvjp(_vjp_fwd, _vjp_bwd)


def chunk_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 128,
    layout: str = "auto",
) -> tuple[Array, Array]:
    """Chunkwise-parallel GLA. Returns (o [B, T, H, V], final_state [B, H, K, V] fp32).

    Any T >= 1: the tail is padded with state-neutral positions (q = k = v = 0, g = 0).
    ``chunk_size``: a multiple of 16 or one of 1, 2, 4, 8. This is the "chunk" kernel of
    ``dispatch.gla``, which also runs the Pallas and the recurrent ones.
    ``layout``: the XLA kernel's intra-chunk layout (``levels.py``): "full" (full-width matmuls per
    level, for systolic arrays), "blocks" (per-level blocks, least work), or "auto", which follows
    the compile target ("full" in a program compiled for TPU or Neuron, "blocks" elsewhere:
    ``platform.per_platform``).
    """
    check_inputs(q, k, v, g, initial_state)
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"layout must be one of auto, {', '.join(LAYOUTS)}; got {layout!r}")
    if (problem := chunk_size_problem("chunk", chunk_size)) is not None:
        raise ValueError(problem)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
    pad = (-T) % chunk_size
    if pad:  # state-neutral tail: q = k = v = 0, g = 0
        q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
    o, final_state = chunk_gla_padded(q, k, v, g, s0, scale, chunk_size, layout)
    return o[:, :T], final_state
