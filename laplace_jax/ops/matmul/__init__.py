"""Projections: ``reference`` (the XLA dot, every backend) and ``rows_matmul``, the same product of
a few rows as a Pallas TPU kernel (``mosaic.py``), which ``layers.common.matmul`` picks in decode
and short-prefill programs compiled for a two-TensorCore TPU."""

from __future__ import annotations

from laplace_jax.ops.matmul.mosaic import reference, rows_matmul, takes

__all__ = ["reference", "rows_matmul", "takes"]
