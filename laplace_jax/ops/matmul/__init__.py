"""Projections: ``reference`` (the XLA dot, every backend) and ``rows_matmul``, the same product of
a few rows as a Pallas TPU kernel (``mosaic.py``), with the residual add or SwiGLU's gate in its
epilogue (``residual_rows_matmul``, ``gated_rows_matmul``; their references beside them), which
``layers.common.matmul`` and ``gated_matmul`` pick in decode and short-prefill programs compiled
for a two-TensorCore TPU."""

from __future__ import annotations

from laplace_jax.ops.matmul.mosaic import (
    gated_reference,
    gated_rows_matmul,
    reference,
    residual_reference,
    residual_rows_matmul,
    rows_matmul,
    takes,
)

__all__ = [
    "gated_reference",
    "gated_rows_matmul",
    "reference",
    "residual_reference",
    "residual_rows_matmul",
    "rows_matmul",
    "takes",
]
