"""laplace-jax: Gated Linear Attention language models in JAX (Laplace 3B and the fla GLA family)."""

from laplace_jax.xla_flags import prefer_memory_schedule

prefer_memory_schedule()  # before anything starts a JAX backend (laplace_jax/xla_flags.py)

# The model API loads on first use (PEP 562), so tools that import a submodule without JAX (the
# data preparation workers) do not pay for it.
_LAZY = {
    "ModelConfig": "laplace_jax.config",
    "ConfigError": "laplace_jax.errors",
    **{
        name: "laplace_jax.models.gla_lm"
        for name in (
            "abstract_params",
            "count_params",
            "decode_step",
            "forward",
            "init_params",
            "init_state",
            "param_logical_axes",
            "prefill",
        )
    },
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'laplace_jax' has no attribute {name!r}")


__all__ = sorted(_LAZY)  # resolved on first use by __getattr__
__version__ = "0.1.0"
