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

from laplace_jax.ops.gla_chunk import SUB_CHUNK, chunk_gla_padded
from laplace_jax.ops.gla_pallas import pallas_gla
from laplace_jax.platform import on_gpu

Array = jax.Array

KERNELS = ("xla", "pallas")


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


def gla_step(
    q: Array, k: Array, v: Array, g: Array, state: Array, *, scale: float | None = None
) -> tuple[Array, Array]:
    """One token. q, k, g: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] fp32 -> (o [B, H, V], state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = jnp.float32
    state = jnp.exp(g.astype(f32))[..., None] * state.astype(f32) + (
        k.astype(f32)[..., :, None] * v.astype(f32)[..., None, :]
    )
    # a product and a reduction over K, not a dot: it fuses with the update above, so the state is
    # read and written once in whatever layout it has (no transposed copy for a GEMM)
    o = jnp.sum((q.astype(f32) * scale)[..., :, None] * state, axis=-2)
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
    ``chunk_size`` must be a multiple of 16 (or, for the XLA kernel, one of 1, 2, 4, 8).
    ``kernel``: "xla" (``gla_chunk``: lax.scan, any backend) or "pallas" (``gla_pallas``: a
    Triton-lowered GPU kernel). ``interpret`` runs the Pallas kernel in the Pallas interpreter;
    None means "on CPU only". Both kernels have the same numerics contract and gradients.
    """
    _check(q, k, v, g, initial_state)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if chunk_size <= 0 or (chunk_size % SUB_CHUNK and (kernel == "pallas" or SUB_CHUNK % chunk_size)):
        raise ValueError(
            f"chunk_size must be a positive multiple of {SUB_CHUNK} (the XLA kernel also takes 1, 2, 4, 8); "
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


def resolve_attn_impl(attn_impl: str) -> str:
    """'auto' -> 'pallas' on GPU, 'chunk' elsewhere; other names unchanged."""
    if attn_impl != "auto":
        return attn_impl
    return "pallas" if on_gpu() else "chunk"
