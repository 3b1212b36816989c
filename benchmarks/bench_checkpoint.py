"""What checksums add to a checkpoint: Orbax save vs seal (CRC-32 of every file) vs verify.

    python -m benchmarks.bench_checkpoint --config configs/3b.py --devices 64 \\
        --out benchmarks/results/checkpoint_3b.json

Builds one device's share of the config's training state (fp32 parameters plus the optimizer's
two fp32 buffers per parameter: Muon momentum or Adam's moments, an upper bound), saves it with
Orbax (synchronously, so the time is the write), then seals it (``checkpoint.seal``: CRC-32 of
every file) and verifies it (``checkpoint.damage``). Medians of ``--repeats`` runs, one process;
the figure that transfers is the ratio, since both sides read or write the same bytes.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from benchmarks.common import write_result
from laplace_jax.checkpoint import damage, seal
from laplace_jax.config import load_run_config
from laplace_jax.models.gla_lm import abstract_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices", type=int, default=64, help="the state is split over this many devices")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    leaves = jax.tree.leaves(abstract_params(load_run_config(a.config).model))
    rng = np.random.default_rng(0)
    # one device's share of every parameter, and of two optimizer buffers like it
    state = {
        f"{kind}{i}": rng.standard_normal(max(1, math.prod(x.shape) // a.devices), dtype=np.float32)
        for i, x in enumerate(leaves)
        for kind in ("param", "mu", "nu")
    }
    nbytes = sum(v.nbytes for v in state.values())
    root = tempfile.mkdtemp(dir=a.dir)
    times: dict[str, list[float]] = {"save": [], "seal": [], "verify": []}
    try:
        for r in range(a.repeats):
            path = os.path.join(root, f"ckpt{r}")
            t0 = time.perf_counter()
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(path, state)
            t1 = time.perf_counter()
            seal(path)
            t2 = time.perf_counter()
            assert damage(path) is None
            t3 = time.perf_counter()
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[k].append(v)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "config": a.config,
        "devices": a.devices,
        "bytes_per_device": nbytes,
        "cpu_count": os.cpu_count(),
        "median_s": med,
        "seal_over_save": med["seal"] / med["save"],
        "verify_over_save": med["verify"] / med["save"],
    }
    print(
        f"{nbytes / 1e9:.2f} GB per device: save {med['save']:.2f} s, seal {med['seal']:.2f} s "
        f"({100 * res['seal_over_save']:.1f}% of the save), verify {med['verify']:.2f} s"
    )
    write_result(res, "bench_checkpoint", argv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
