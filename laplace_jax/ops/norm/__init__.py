"""RMSNorm: ``naive`` (plain JAX, every backend; the reference) and the same norm as Pallas TPU
kernels, forward and backward (``mosaic.py``), which ``layers.common.RMSNorm`` runs on TPU."""

from __future__ import annotations

from laplace_jax.ops.norm.mosaic import residual_rms_norm as mosaic_residual_rms_norm
from laplace_jax.ops.norm.mosaic import rms_norm as mosaic_rms_norm
from laplace_jax.ops.norm.mosaic import takes
from laplace_jax.ops.norm.naive import residual_rms_norm, rms_norm, rms_normalize

__all__ = [
    "mosaic_residual_rms_norm",
    "mosaic_rms_norm",
    "residual_rms_norm",
    "rms_norm",
    "rms_normalize",
    "takes",
]
