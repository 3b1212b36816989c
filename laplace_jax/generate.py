"""Scoring and sampling with a trained model (one device; the serving engine has its own loop).

nll = score(cfg, params, ids)                          # mean next-token loss, nats/token
out = sample(cfg, params, prompt_ids, 200, temperature=0.8, top_k=40, seed=0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from laplace_jax.config import ModelConfig
from laplace_jax.loss import loss_fn
from laplace_jax.models.gla_lm import decode_step, prefill
from laplace_jax.sampling import sample_rows


def score(cfg: ModelConfig, params, ids: list[int]) -> float:
    """Mean next-token cross-entropy of ``ids`` (nats per token)."""
    if len(ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    return float(jax.jit(loss_fn, static_argnums=0)(cfg, params, jnp.asarray(ids, jnp.int32)[None]))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _decode(cfg: ModelConfig, params, state, last_logits, n: int, key, temperature, top_k):
    B = last_logits.shape[0]
    temp_B, top_k_B, top_p_B = jnp.full((B,), temperature), jnp.full((B,), top_k), jnp.ones((B,))

    def step(carry, key):
        logits, state = carry
        tok = sample_rows(logits, temp_B, top_k_B, top_p_B, jax.random.split(key, B))
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
    toks = _decode(cfg, params, state, logits[:, -1], max_new_tokens, jax.random.key(seed), temperature, top_k)
    return [int(t) for t in toks]
