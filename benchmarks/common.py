"""Benchmark helpers; timing and the matmul peak live in laplace_jax.platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.platform import matmul_gflops, median_seconds

__all__ = ["batched_matmul_gflops", "matmul_gflops", "median_seconds"]


def batched_matmul_gflops(batch: int = 256, m: int = 128, k: int = 128, n: int = 256, repeats: int = 7) -> float:
    """Throughput of a batch of small matmuls (the shape chunk_gla issues per chunk)."""
    a = jax.random.normal(jax.random.key(0), (batch, m, k))
    b = jax.random.normal(jax.random.key(1), (batch, k, n))
    f = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    return 2 * batch * m * k * n / median_seconds(lambda: f(a, b), repeats) / 1e9
