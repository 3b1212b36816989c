"""Projections: ``reference`` (the XLA dot, every backend) and ``rows_matmul``, the same product of
a few rows as a Pallas TPU kernel (``mosaic.py``), with the residual add or SwiGLU's gate in its
epilogue (``residual_rows_matmul``, ``gated_rows_matmul``; their references beside them), or
several weights of the same rows in one call (``rows_projections``), which
``layers.common.matmul``, ``gated_matmul`` and ``projections`` pick in decode and short-prefill programs compiled
for a two-TensorCore TPU; GLA's low-rank log-decay gate likewise (``log_decay.py``:
``rows_log_decay`` beside ``log_decay_reference``, picked by ``layers.common.log_decay``)."""

from __future__ import annotations

from laplace_jax.ops.matmul.log_decay import gate as log_decay_gate
from laplace_jax.ops.matmul.log_decay import reference as log_decay_reference
from laplace_jax.ops.matmul.log_decay import rows_log_decay
from laplace_jax.ops.matmul.log_decay import takes as log_decay_takes
from laplace_jax.ops.matmul.mosaic import (
    gated_reference,
    gated_rows_matmul,
    projections_take,
    reference,
    residual_reference,
    residual_rows_matmul,
    rows_matmul,
    rows_projections,
    takes,
)

__all__ = [
    "gated_reference",
    "gated_rows_matmul",
    "log_decay_gate",
    "log_decay_reference",
    "log_decay_takes",
    "projections_take",
    "reference",
    "residual_reference",
    "residual_rows_matmul",
    "rows_log_decay",
    "rows_matmul",
    "rows_projections",
    "takes",
]
