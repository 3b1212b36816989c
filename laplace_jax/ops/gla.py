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


def _shift_down(x: Array, d: int, axis: int) -> Array:
    """x[r - d] along ``axis`` (zeros where r < d)."""
    if d == 0:
        return x
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (d, 0)
    return jax.lax.slice_in_dim(jnp.pad(x, pad), 0, n, axis=axis)


def _intra_chunk(q: Array, k: Array, g: Array, scale: float, dtype: jnp.dtype) -> Array:
    """Causal intra-chunk scores A[..., r, s] = scale * sum_k q_r k_s exp(sum_{s<t<=r} g_t), s <= r.

    q, k, g: [..., C, K] (g fp32) -> A [..., C, C] fp32. Every decay factor is an exp of a direct
    sum of log-decays (<= 0) or a product of such factors, never an exp of a difference of two
    cumulative sums, so it is exact to a few ulps even when the decay spans thousands of nats.
    """
    *lead, C, K = q.shape
    c = min(SUB_CHUNK, C)
    n = C // c
    f32 = jnp.float32
    qs, ks, gs = (x.reshape(*lead, n, c, K) for x in (q.astype(f32), k.astype(f32), g))
    # Off-diagonal sub-blocks (i > j): exp(sum_{s<t<=r} g) = exp(head of row r in block i)
    # * exp(whole blocks strictly between j and i) * exp(tail of column s in block j); each <= 1.
    q_head = qs * jnp.exp(jnp.cumsum(gs, axis=-2))  # [..., n, c, K]
    k_tail = ks * jnp.exp(_rev_excl_cumsum(gs, axis=-2))  # [..., n, c, K]
    i, j, m = jnp.arange(n)[:, None, None], jnp.arange(n)[None, :, None], jnp.arange(n)[None, None, :]
    between = ((j < m) & (m < i)).astype(f32)  # [n(i), n(j), n(m)]
    gap = jnp.einsum("...mk,ijm->...ijk", jnp.sum(gs, axis=-2), between)  # [..., n, n, K]
    below = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None]
    w_gap = jnp.where(below, jnp.exp(gap), 0.0)  # [..., n(i), n(j), K]
    q_gap = q_head[..., :, None, :, :] * w_gap[..., :, :, None, :]  # [..., n(i), n(j), c, K]
    a_off = _dot("...ijrk,...jsk->...irjs", q_gap, k_tail, dtype)  # [..., n, c, n, c]
    # Diagonal sub-blocks, one diagonal d = r - s at a time: the decay prod_{r-d<t<=r} exp(g_t)
    # gains one factor <= 1 per diagonal (a product of d terms: relative error <= d ulps).
    step_decay = jnp.exp(gs)
    decay = jnp.ones_like(gs)
    diags = []
    for d in range(c):
        if d:
            decay = decay * _shift_down(step_decay, d - 1, axis=-2)
        diags.append(jnp.sum(qs * decay * _shift_down(ks, d, axis=-2), axis=-1))  # [..., n, c(r)]
    by_diag = jnp.stack(diags, axis=-2)  # [..., n, c(d), c(r)]
    r_idx, s_idx = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    a_diag = by_diag[..., jnp.maximum(r_idx - s_idx, 0), r_idx] * (s_idx <= r_idx)  # [..., n, c, c]
    a_diag = jnp.einsum("...irs,ij->...irjs", a_diag, jnp.eye(n, dtype=f32))
    return scale * (a_off + a_diag).reshape(*lead, C, C)


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
    # Inter-chunk part: the scan carries the state; each step reads one chunk (chunk-major).
    to_n = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B, H, N, ...] -> [N, B, H, ...]
    q_inter = to_n(qc.astype(f32) * (scale * jnp.exp(jnp.cumsum(gc, axis=-2))))  # decay from chunk start to r
    k_state = to_n(kc.astype(f32) * jnp.exp(_rev_excl_cumsum(gc, axis=-2)))  # decay from s to chunk end
    decay = to_n(jnp.exp(jnp.sum(gc, axis=-2)))[..., None]  # [N, B, H, K, 1]

    def step(s, xs):
        q_n, k_n, v_n, decay_n = xs
        o_n = _dot("bhck,bhkv->bhcv", q_n, s, dtype)
        return decay_n * s + _dot("bhck,bhcv->bhkv", k_n, v_n, dtype), o_n

    s0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    final_state, o_inter = jax.lax.scan(step, s0, (q_inter, k_state, to_n(vc), decay))  # o_inter: [N, B, H, C, V]
    o_inter = jnp.moveaxis(o_inter, 0, 2)
    o = (o_inter + o_intra).transpose(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.astype(v.dtype), final_state
