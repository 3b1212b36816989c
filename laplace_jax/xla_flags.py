"""The one XLA flag this package sets, at import, before JAX starts a backend.

``--xla_cpu_enable_concurrency_optimized_scheduler=false``: XLA:CPU's default scheduler orders
independent ops for parallelism, so in ``decode_step``'s unrolled layer loop it widens every
layer's bf16 weights to f32 up front (they depend on nothing but the parameters) and keeps them
all alive: 10.4 GiB of temporaries for the 3B decode step at W=256, and a 340M step 2.6x slower
than with the memory-ordered schedule (``benchmarks/bench_memory.py``; BENCHMARKS.md). The flag
only concerns XLA:CPU; other backends ignore it. A value already in ``XLA_FLAGS`` is kept, and a
process whose CPU backend started before this import keeps the scheduler it started with.
"""

from __future__ import annotations

import os

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def prefer_memory_schedule() -> None:
    """Add the flag to ``XLA_FLAGS`` unless the user set it (either way)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}=false".strip()
