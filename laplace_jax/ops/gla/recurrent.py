"""The token-by-token GLA recurrence (``lax.scan`` of ``gla_step``): the in-JAX oracle of the
chunk kernels, and the path ``model.attn_impl="recurrent"`` takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.step import gla_step

Array = jax.Array


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
    check_inputs(q, k, v, g, initial_state)
    B, _, H, K = q.shape
    V = v.shape[-1]
    state = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, xs):
        o, s = gla_step(*xs, s, scale=scale)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g))
    state, o_TxBxHxV = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o_TxBxHxV, 0, 1), state
