"""On-device sampling with per-row parameters (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sample_rows(logits_WxV: Array, temperature_W: Array, top_k_W: Array, top_p_W: Array, keys_W: Array) -> Array:
    """One token per row. temperature <= 0: argmax; top_k 0: off; top_p 1: off. keys: typed PRNG keys [W]."""
    logits = logits_WxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature_W, 1e-6)[:, None]
    desc = -jnp.sort(-scaled, axis=-1)  # [W, V] descending
    V = logits.shape[-1]
    k = jnp.where(top_k_W > 0, jnp.minimum(top_k_W, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # k-th largest
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = before < top_p_W[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, desc, jnp.inf), axis=-1, keepdims=True)  # smallest kept logit
    masked = jnp.where((scaled >= kth) & (scaled >= cutoff), scaled, -jnp.inf)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_W, masked)
    return jnp.where(temperature_W <= 0, greedy, drawn).astype(jnp.int32)
