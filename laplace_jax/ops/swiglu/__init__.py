"""SwiGLU's gate, silu(gate) * up: ``naive`` (plain JAX, every backend; the reference) and the same
product as Pallas TPU kernels, forward and backward (``mosaic.py``), which ``layers.common.SwiGLU``
runs on TPU."""

from __future__ import annotations

from laplace_jax.ops.swiglu.mosaic import swiglu as mosaic_swiglu
from laplace_jax.ops.swiglu.mosaic import takes
from laplace_jax.ops.swiglu.naive import swiglu

__all__ = ["mosaic_swiglu", "swiglu", "takes"]
