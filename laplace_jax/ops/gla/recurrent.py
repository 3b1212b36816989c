"""The token-by-token GLA recurrence (``lax.scan`` of ``gla_step``): the in-JAX oracle of the
chunk kernels, and the path ``model.attn_impl="recurrent"`` takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.inputs import check_inputs
from laplace_jax.ops.gla.step import gla_step, state_update

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


def gla_states(q: Array, k: Array, v: Array, g: Array, initial_state: Array, *, scale: float | None = None):
    """The token recurrence keeping every position's state: (o [B, T, H, V], states [B, T, H, K, V]
    fp32, states[:, t] the state after position t). A speculative verify's per-position states
    (``models.gla_lm.verify``): T + 1 times the state's memory per row."""
    check_inputs(q, k, v, g, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def step(s, xs):
        s = state_update(*xs, s)
        return s, s

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (k, v, g))
    _, states_TxBxHxKxV = jax.lax.scan(step, initial_state.astype(jnp.float32), xs)
    states = jnp.moveaxis(states_TxBxHxKxV, 0, 1)
    o = jnp.sum((q.astype(jnp.float32) * scale)[..., :, None] * states, axis=-2)
    return o.astype(v.dtype), states


def gla_replay(k: Array, v: Array, g: Array, state: Array, lengths_B: Array) -> Array:
    """The state after the first lengths[b] positions of k, v, g [B, T, ..] from ``state``: the
    recurrence's own update (``state_update``), unrolled over the T positions (a verify's few, so
    the compiler fuses them into one pass over the state, no weights read); a later position
    enters as k = 0, g = 0, which leaves the state bit for bit."""
    s = state.astype(jnp.float32)
    for t in range(k.shape[1]):
        on = (t < lengths_B)[:, None, None]
        s = state_update(jnp.where(on, k[:, t], 0), v[:, t], jnp.where(on, g[:, t], 0), s)
    return s
