"""One GLA token for decode: ``gla_step`` updates the fp32 state and reads the output from it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.limits import XLA_STEP_SCOPE

Array = jax.Array


def gla_step(
    q: Array, k: Array, v: Array, g: Array, state: Array, *, scale: float | None = None
) -> tuple[Array, Array]:
    """One token. q, k, g: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] fp32 -> (o [B, H, V], state)."""
    with jax.named_scope(XLA_STEP_SCOPE):  # what a compiled program ran, by name (hlo_stats.gla_kernels)
        return _step(q, k, v, g, state, q.shape[-1] ** -0.5 if scale is None else scale)


def state_update(k: Array, v: Array, g: Array, state: Array) -> Array:
    """The recurrence's state update for one token: k, g [B, H, K], v [B, H, V], state [B, H, K, V]
    -> diag(exp(g)) state + k v^T in float32 (a token with k = 0 and g = 0 leaves it bit for bit)."""
    f32 = jnp.float32
    return jnp.exp(g.astype(f32))[..., None] * state.astype(f32) + (
        k.astype(f32)[..., :, None] * v.astype(f32)[..., None, :]
    )


def _step(q: Array, k: Array, v: Array, g: Array, state: Array, scale: float) -> tuple[Array, Array]:
    f32 = jnp.float32
    state = state_update(k, v, g, state)
    # a product and a reduction over K, not a dot: it fuses with the update above, so the state is
    # read and written once in whatever layout it has (no transposed copy for a GEMM)
    o = jnp.sum((q.astype(f32) * scale)[..., :, None] * state, axis=-2)
    return o.astype(v.dtype), state
