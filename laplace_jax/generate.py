"""Scoring and sampling with a trained model (one device; the serving engine has its own loop).

nll = score(cfg, params, ids)                          # mean next-token loss, nats/token
out = sample(cfg, params, prompt_ids, 200, temperature=0.8, top_k=40, seed=0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import decode_step, forward, prefill


def score(cfg: ModelConfig, params, ids: list[int]) -> float:
    """Mean next-token cross-entropy of ``ids`` (nats per token)."""
    if len(ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    tokens = jnp.asarray(ids, jnp.int32)[None]
    logits = jax.jit(forward, static_argnums=0)(cfg, params, tokens[:, :-1])
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())


def _pick(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    if temperature <= 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits_BxV = logits_BxV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BxV, top_k)[0][..., -1:]
        logits_BxV = jnp.where(logits_BxV < kth, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 4, 6, 7))
def _decode(cfg: ModelConfig, params, state, last_logits, n: int, key, top_k: int, temperature):
    def step(carry, key):
        logits, state = carry
        tok = _pick(logits, key, temperature, top_k)
        logits, state = decode_step(cfg, params, tok, state)
        return (logits, state), tok

    _, toks = jax.lax.scan(step, (last_logits, state), jax.random.split(key, n))
    return toks[:, 0]


def sample(
    cfg: ModelConfig,
    params,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[int]:
    """Prefill the prompt, then ``max_new_tokens`` decode steps on device (temperature 0 = greedy)."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    logits, state = jax.jit(prefill, static_argnums=0)(cfg, params, jnp.asarray(prompt_ids, jnp.int32)[None])
    toks = _decode(cfg, params, state, logits[:, -1], max_new_tokens, jax.random.key(seed), top_k, temperature)
    return [int(t) for t in toks]
