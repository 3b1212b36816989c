"""Gated Linear Attention kernels: chunkwise-parallel form, token recurrence, one decode step.

Layout: q, k, g are [B, T, H, K]; v is [B, T, H, V]; the recurrent state is [B, H, K, V] in
float32. ``g`` is the log forget gate (<= 0). Per head:

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,      o_t = S_t^T (scale * q_t)

``chunk_gla`` evaluates the same recurrence with matmuls over chunks of ``chunk_size`` tokens,
running a ``lax.scan`` over chunks for the state. Every exponent is a direct sum of log-decays
(<= 0), never the difference of two cumulative sums, so nothing overflows and nothing cancels
however strong the decay: inside a chunk, off-diagonal 16-token sub-blocks factor through the
boundary of the row's sub-block, and the diagonal sub-blocks use exact pairwise exponents.
``recurrent_gla`` is the token-by-token scan (the oracle, and the decode path through ``gla_step``).

All accumulation is float32; matmul operands take the dtype of ``q`` (bf16 inputs -> bf16
operands, fp32 accumulation). Outputs take the dtype of ``v``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

SUB_CHUNK = 16


def _check(q: Array, k: Array, v: Array, g: Array, initial_state: Array | None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, H, D] (rank 4); got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype; got {x.dtype}")
    if q.shape != k.shape or q.shape != g.shape:
        raise ValueError(
            "q, k and g must share one shape [B, T, H, K]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}; got {tuple(v.shape)}")
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [B, H, K, V] = {want}; got {tuple(initial_state.shape)}")


def _dot(spec: str, a: Array, b: Array, dtype: jnp.dtype) -> Array:
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def gla_step(
    q: Array, k: Array, v: Array, g: Array, state: Array, *, scale: float | None = None
) -> tuple[Array, Array]:
    """One token. q, k, g: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] fp32 -> (o [B, H, V], state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = jnp.float32
    state = jnp.exp(g.astype(f32))[..., None] * state.astype(f32) + (
        k.astype(f32)[..., :, None] * v.astype(f32)[..., None, :]
    )
    o = jnp.einsum("bhk,bhkv->bhv", q.astype(f32) * scale, state)
    return o.astype(v.dtype), state


def recurrent_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
) -> tuple[Array, Array]:
    """Token-by-token recurrence. Returns (o [B, T, H, V], final_state [B, H, K, V] fp32)."""
    _check(q, k, v, g, initial_state)
    B, _, H, K = q.shape
    V = v.shape[-1]
    state = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, xs):
        o, s = gla_step(*xs, s, scale=scale)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g))
    state, o_TxBxHxV = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o_TxBxHxV, 0, 1), state


def _rev_excl_cumsum(x: Array, axis: int) -> Array:
    """sum_{t > s} x_t along ``axis``, summed directly (no cancellation for same-sign x)."""
    incl = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
    zero = jnp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))
    return jnp.concatenate([jax.lax.slice_in_dim(incl, 1, None, axis=axis), zero], axis=axis)


def _intra_chunk(q: Array, k: Array, g: Array, scale: float, dtype: jnp.dtype) -> Array:
    """Causal intra-chunk scores A[..., r, s] = scale * sum_k q_r k_s exp(sum_{s<t<=r} g_t), s <= r.

    q, k, g: [..., C, K] (g fp32) -> A [..., C, C] fp32. Every exponent is a direct sum of
    log-decays (all <= 0), never a difference of two cumulative sums, so it is exact to a few
    ulps of itself even when the decay inside the chunk spans thousands of nats.
    """
    *lead, C, K = q.shape
    c = min(SUB_CHUNK, C)
    n = C // c
    f32 = jnp.float32
    qs, ks, gs = (x.reshape(*lead, n, c, K) for x in (q.astype(f32), k.astype(f32), g))
    # Off-diagonal sub-blocks (i > j): exp(sum_{s<t<=r} g) factors into
    # exp(local cumsum of row r in block i) * exp(range sum from s to the end of block i-1).
    local = jnp.cumsum(gs, axis=-2)  # [..., n, c, K]: sum from the start of the sub-block to r
    tail = _rev_excl_cumsum(gs, axis=-2)  # [..., n, c, K]: sum from s (excl.) to the end of its sub-block
    totals = jnp.sum(gs, axis=-2)  # [..., n, K]
    i, j, m = jnp.arange(n)[:, None, None], jnp.arange(n)[None, :, None], jnp.arange(n)[None, None, :]
    between = ((j < m) & (m < i)).astype(f32)  # [n(i), n(j), n(m)]: whole sub-blocks strictly between
    gap = jnp.einsum("...mk,ijm->...ijk", totals, between)  # [..., n, n, K]
    below = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None, None]  # j < i
    expo = jnp.where(below, gap[..., :, :, None, :] + tail[..., None, :, :, :], -jnp.inf)
    k_ref = ks[..., None, :, :, :] * jnp.exp(expo)  # [..., n(i), n(j), c, K]
    q_ref = qs * jnp.exp(local)
    a_off = _dot("...ick,...ijsk->...icjs", q_ref, k_ref, dtype).reshape(*lead, C, C)
    # Diagonal sub-blocks: exact pairwise exponents, each a direct masked sum.
    r_, s_, t_ = jnp.arange(c)[:, None, None], jnp.arange(c)[None, :, None], jnp.arange(c)[None, None, :]
    window = ((s_ < t_) & (t_ <= r_)).astype(f32)  # [c(r), c(s), c(t)]
    pair = jnp.einsum("...itk,rst->...irsk", gs, window)
    tri = jnp.tril(jnp.ones((c, c), f32))
    a_diag = jnp.einsum("...irk,...isk,...irsk,rs->...irs", qs, ks, jnp.exp(pair), tri)
    a_diag = jnp.einsum("...irs,ij->...irjs", a_diag, jnp.eye(n, dtype=f32)).reshape(*lead, C, C)
    return scale * (a_off + a_diag)


def chunk_gla(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 128,
) -> tuple[Array, Array]:
    """Chunkwise-parallel GLA. Returns (o [B, T, H, V], final_state [B, H, K, V] fp32).

    Any T >= 1: the tail is padded with state-neutral positions (q = k = v = 0, g = 0).
    ``chunk_size`` must be a multiple of 16 (or one of 1, 2, 4, 8).
    """
    _check(q, k, v, g, initial_state)
    if chunk_size <= 0 or (chunk_size % SUB_CHUNK and SUB_CHUNK % chunk_size):
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_CHUNK} (or divide it); got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = q.dtype
    f32 = jnp.float32
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: Array) -> Array:  # [B, T, H, D] -> [B, H, N, C, D]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(B, N, C, H, x.shape[-1]).transpose(0, 3, 1, 2, 4)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    gc = chunks(g).astype(f32)  # [B, H, N, C, K], <= 0

    o_intra = _dot("bhnrs,bhnsv->bhnrv", _intra_chunk(qc, kc, gc, scale, dtype), vc, dtype)
    q_inter = qc.astype(f32) * (scale * jnp.exp(jnp.cumsum(gc, axis=-2)))  # decay from chunk start to r
    k_state = kc.astype(f32) * jnp.exp(_rev_excl_cumsum(gc, axis=-2))  # decay from s to chunk end
    kv = _dot("bhnck,bhncv->nbhkv", k_state, vc, dtype)  # [N, B, H, K, V]
    decay = jnp.exp(jnp.sum(gc, axis=-2)).transpose(2, 0, 1, 3)[..., None]  # [N, B, H, K, 1]

    def step(s, xs):
        decay_n, kv_n = xs
        return decay_n * s + kv_n, s

    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    final_state, s_prev = jax.lax.scan(step, s0, (decay, kv))  # s_prev: [N, B, H, K, V]
    o_inter = _dot("bhnck,nbhkv->bhncv", q_inter, s_prev, dtype)
    o = (o_inter + o_intra).transpose(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.astype(v.dtype), final_state
