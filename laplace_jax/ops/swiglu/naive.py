"""SwiGLU's gate in plain JAX: the reference for ``mosaic.py`` and the form every backend runs."""

from __future__ import annotations

import jax

Array = jax.Array


def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up in the operands' dtype (fla's GatedMLP with swish, before its down projection)."""
    return jax.nn.silu(gate) * up
