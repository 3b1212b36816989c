"""Causal softmax attention kernels for the hybrid models' attention layers (``layers.attention``).

Layout: q is [B, T, H, d]; k and v are [B, S, N, d] with N kv heads (GQA: query head h reads kv
head h // (H / N), as flash-attn does). A query at position p sees the valid keys at positions p'
with p - window < p' <= p (window None: every p' <= p). Scores, the softmax's max and sum are
float32; the probabilities meet v in v's dtype with float32 accumulation.

``chunk_attention`` runs blocks of ``chunk_size`` queries, each against only the keys its window
can reach, and recomputes each block's scores in the backward (nothing T x T is stored);
``naive_attention`` is the float64 NumPy reference it is tested against.
"""

from __future__ import annotations

from laplace_jax.ops.attention.chunk import Prefix, chunk_attention
from laplace_jax.ops.attention.naive import naive_attention

__all__ = ["Prefix", "chunk_attention", "naive_attention"]
