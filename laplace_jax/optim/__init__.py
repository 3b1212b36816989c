"""Optimizers: Muon with distributed Newton-Schulz (+ AdamW for non-matrix parameters)."""

from laplace_jax.optim.muon import DEFAULT_ROUTING, label_params, muon, payload_dtype, scale_by_muon

__all__ = ["DEFAULT_ROUTING", "label_params", "muon", "payload_dtype", "scale_by_muon"]
