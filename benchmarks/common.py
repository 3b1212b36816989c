"""Benchmark helpers; timing and the matmul peak live in laplace_jax.platform."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from collections.abc import Callable

from laplace_jax.platform import matmul_gflops, median_seconds

__all__ = ["baseline_chunk_gla", "matmul_gflops", "median_seconds", "write_result"]


def every_slot_live(eng) -> None:
    """Mark every decode slot of engine ``eng`` live and never finishing, so a timed decode call
    runs the model for every row (a call whose rows are all done skips the model)."""
    import jax
    import numpy as np

    rows = eng.programs.slots["rows"]
    for name, value in (("done", False), ("remaining", 2**30)):
        rows[name] = jax.device_put(np.full(rows[name].shape, value, rows[name].dtype), rows[name].sharding)


def write_result(res: dict, module: str, argv: list[str] | None, out: str | None) -> None:
    """Record the command that produced ``res`` in it, and write it as JSON to ``out`` (if given)."""
    res["command"] = f"python -m benchmarks.{module} " + shlex.join(argv if argv is not None else sys.argv[1:])
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


def baseline_chunk_gla(path: str) -> Callable:
    """Another version's chunked GLA from a file, as fn(q, k, v, g, s0 or None, chunk_size) ->
    (o, final state): an ``ops/gla.py`` that defines ``chunk_gla`` (before the kernel moved out of
    it), or an ``ops/gla_chunk.py`` whose ``chunk_gla_padded`` gets T padded state-neutrally here."""
    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("gla_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "chunk_gla"):
        return lambda q, k, v, g, s0, C: module.chunk_gla(q, k, v, g, initial_state=s0, chunk_size=C)

    def fn(q, k, v, g, s0, C):
        B, T, H, K = q.shape
        s0 = jnp.zeros((B, H, K, v.shape[3]), jnp.float32) if s0 is None else s0
        pad = ((0, 0), (0, (-T) % C), (0, 0), (0, 0))
        o, s = module.chunk_gla_padded(*(jnp.pad(x, pad) for x in (q, k, v, g)), s0, K**-0.5, C)
        return o[:, :T], s

    return fn
