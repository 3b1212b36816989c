"""Gated Linear Attention kernels: chunkwise-parallel form, token recurrence, one decode step.

Layout: q, k, g are [B, T, H, K]; v is [B, T, H, V]; the recurrent state is [B, H, K, V] in
float32. ``g`` is the log forget gate (<= 0). Per head:

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,      o_t = S_t^T (scale * q_t)

``chunk_gla`` evaluates the same recurrence with matmuls over chunks of ``chunk_size`` tokens,
a loop over chunks carrying the state. Every exponent is a direct sum of log-decays (<= 0),
never the difference of two cumulative sums, so nothing overflows and nothing cancels however
strong the decay: the scores inside a chunk come from dyadic levels (halves, quarters, ...),
each one full-width matmul of operands scaled by sums within their half-block (``levels.py``).
``pallas_gla`` (GPU, Triton) and ``mosaic_gla`` (TPU) are the same contract as Pallas kernels.
``recurrent_gla`` is the token-by-token scan (the oracle) of ``gla_step``, the one-token step;
``gla_states`` keeps every position's state and ``gla_replay`` reruns the state's update alone
(a speculative verify's two ways to roll the state back);
``mosaic_gla_step`` is that step as a Pallas TPU kernel, and ``gla_decode`` picks one of the two.
``context_gla`` runs one sequence split across devices (context parallelism, ``context.py``).

All accumulation is float32; matmul operands take the dtype of ``q`` (bf16 inputs -> bf16
operands, fp32 accumulation). Outputs take the dtype of ``v``.
"""

from __future__ import annotations

from laplace_jax.ops.gla.chunk import chunk_gla
from laplace_jax.ops.gla.context import context_gla
from laplace_jax.ops.gla.dispatch import gla, gla_decode, kernel_for
from laplace_jax.ops.gla.limits import IMPLS
from laplace_jax.ops.gla.mosaic import mosaic_gla
from laplace_jax.ops.gla.mosaic_step import mosaic_gla_step
from laplace_jax.ops.gla.naive import naive_gla
from laplace_jax.ops.gla.pallas import pallas_gla
from laplace_jax.ops.gla.recurrent import gla_replay, gla_states, recurrent_gla
from laplace_jax.ops.gla.step import gla_step

__all__ = [
    "IMPLS",
    "chunk_gla",
    "context_gla",
    "gla",
    "gla_decode",
    "gla_replay",
    "gla_states",
    "gla_step",
    "kernel_for",
    "mosaic_gla",
    "mosaic_gla_step",
    "naive_gla",
    "pallas_gla",
    "recurrent_gla",
]
