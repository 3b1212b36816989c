"""Benchmark helpers; timing and the matmul peak live in laplace_jax.platform."""

from __future__ import annotations

import json
import sys

from laplace_jax.platform import matmul_gflops, median_seconds

__all__ = ["matmul_gflops", "median_seconds", "write_result"]


def write_result(res: dict, module: str, argv: list[str] | None, out: str | None) -> None:
    """Record the command that produced ``res`` in it, and write it as JSON to ``out`` (if given)."""
    res["command"] = f"python -m benchmarks.{module} " + " ".join(argv if argv is not None else sys.argv[1:])
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
