"""Timing helpers shared by the benchmarks: medians of jitted calls, and this machine's matmul peak."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` (outputs blocked on) over ``repeats`` runs after ``warmup``."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops(n: int = 2048, dtype=jnp.float32, repeats: int = 7) -> float:
    """Measured throughput of one n x n x n matmul (GFLOP/s): the machine's practical peak."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    return 2 * n**3 / median_seconds(lambda: f(a, b), repeats) / 1e9


def batched_matmul_gflops(batch: int = 256, m: int = 128, k: int = 128, n: int = 256, repeats: int = 7) -> float:
    """Throughput of a batch of small matmuls (the shape chunk_gla issues per chunk)."""
    a = jax.random.normal(jax.random.key(0), (batch, m, k))
    b = jax.random.normal(jax.random.key(1), (batch, k, n))
    f = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    return 2 * batch * m * k * n / median_seconds(lambda: f(a, b), repeats) / 1e9
