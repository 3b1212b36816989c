"""On-device sampling with per-row parameters (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


CANDIDATES = 1024  # top-k and top-p act on this many most likely tokens per row (at most the vocabulary)


def sample_rows(logits_WxV: Array, temperature_W: Array, top_k_W: Array, top_p_W: Array, keys_W: Array) -> Array:
    """One token per row. temperature <= 0: argmax; top_k 0: off; top_p 1: off. keys: typed PRNG keys [W].

    No sort of the vocabulary (Neuron supports only plain comparators, and a sort of every row
    cost 9% of a 3B decode step's bytes): ``lax.top_k`` takes the ``CANDIDATES`` most likely
    tokens, whose k-th value and whose top-p cutoff (mass from the full softmax) give a logit
    threshold, and the draw is over every token at or above it. Rows with neither limit draw
    from the whole vocabulary. Exact whenever top_k <= CANDIDATES (the server checks) and the
    candidates hold at least top_p of the mass; a nucleus wider than that is cut at CANDIDATES.
    """
    logits = logits_WxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature_W, 1e-6)[:, None]
    top, _ = jax.lax.top_k(scaled, min(CANDIDATES, logits.shape[-1]))  # [W, K] descending
    k = jnp.where(top_k_W > 0, jnp.minimum(top_k_W, top.shape[-1]), top.shape[-1])
    kth = jnp.take_along_axis(top, (k - 1)[:, None], axis=-1)  # k-th largest
    probs = jnp.exp(top - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    cutoff = jnp.min(jnp.where(before < top_p_W[:, None], top, jnp.inf), axis=-1, keepdims=True)  # smallest kept
    limited = (top_k_W > 0) | (top_p_W < 1.0)
    threshold = jnp.where(limited[:, None], jnp.maximum(kth, cutoff), -jnp.inf)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_W, masked)
    return jnp.where(temperature_W <= 0, greedy, drawn).astype(jnp.int32)
