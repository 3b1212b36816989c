"""The training objective, shared by the train and eval steps and by ``generate.score``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from laplace_jax.config import ModelConfig
from laplace_jax.data.synthetic import NO_LOSS
from laplace_jax.models.gla_lm import forward


def loss_terms(cfg: ModelConfig, params: Any, batch_BxT1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropies, number of targets) of windows [B, T + 1], fp32, over
    the targets without ``NO_LOSS``.

    Text corpora flag nothing (every target counts); synthetic tasks such as MQAR flag their prompt
    tokens so that only answers are trained. The model always sees the plain ids.
    """
    tokens_BxT1 = batch_BxT1 & (NO_LOSS - 1)
    logits = forward(cfg, params, tokens_BxT1[:, :-1])
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxT1[:, 1:])
    weight_BxT = ((batch_BxT1[:, 1:] & NO_LOSS) == 0).astype(ce_BxT.dtype)
    return (ce_BxT * weight_BxT).sum(), weight_BxT.sum()


def loss_fn(cfg: ModelConfig, params: Any, batch_BxT1: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (fp32) over the counted targets (``loss_terms``)."""
    total, count = loss_terms(cfg, params, batch_BxT1)
    return total / jnp.maximum(count, 1.0)
