"""laplace-jax: Gated Linear Attention language models in JAX (Laplace 3B and the fla GLA family)."""

from laplace_jax.xla_flags import prefer_memory_schedule

prefer_memory_schedule()  # before anything starts a JAX backend (laplace_jax/xla_flags.py)

# ruff: noqa: E402

from laplace_jax.config import ModelConfig
from laplace_jax.errors import ConfigError
from laplace_jax.models.gla_lm import (
    abstract_params,
    count_params,
    decode_step,
    forward,
    init_params,
    init_state,
    param_logical_axes,
    prefill,
)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "abstract_params",
    "count_params",
    "decode_step",
    "forward",
    "init_params",
    "init_state",
    "param_logical_axes",
    "prefill",
]
__version__ = "0.1.0"
