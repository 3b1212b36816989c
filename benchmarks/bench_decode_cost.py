"""What the sampling features (penalties, logit bias, min-p, min-tokens, logprobs) cost a decode
call, against another checkout of the package, side by side.

Two worker processes stay alive together, one per checkout; each builds the engine for a config,
compiles decode[W] and then, whenever asked, times the median of ``--calls`` decode calls
(``steps_per_call`` tokens for W slots, every slot marked live and never finishing, so the
device runs every row without requests). The driver asks them in turn, A B A B ...,
``--rounds`` times, so machine drift hits both alike, and quotes the median of the per-round
ratios.

    python -m benchmarks.bench_decode_cost --baseline /path/to/other/checkout --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks.common import write_result

WORKER = """
import json, sys, jax
import numpy as np
from laplace_jax.config import load_run_config
from laplace_jax.models.gla_lm import init_params
from laplace_jax.platform import median_seconds
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
name, W, steps, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = load_run_config(f"configs/{name}.py").model
serve = ServeConfig(max_num_seqs=W, decode_buckets=str(W), steps_per_call=steps, devices=1, prefix_cache_bytes=0)
eng = Engine(cfg, init_params(cfg, jax.random.key(0)), serve, eos_id=0)
eng.warmup()
rows = eng.programs.slots["rows"]  # as benchmarks.common.every_slot_live (the other checkout may lack it)
for k, value in (("done", False), ("remaining", 2**30)):
    rows[k] = jax.device_put(np.full(rows[k].shape, value, rows[k].dtype), rows[k].sharding)
print("ready", flush=True)
for _ in sys.stdin:
    print(json.dumps(median_seconds(lambda: eng.programs.decode(W)[0], repeats=calls, warmup=2)), flush=True)
"""


def worker(tree: str, name: str, width: int, steps: int, calls: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, name, str(width), str(steps), str(calls)],
        cwd=tree, env=dict(os.environ, PYTHONPATH=tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker for {tree} failed to start")
    return p


def ask(p: subprocess.Popen) -> float:
    p.stdin.write("go\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other checkout's root (e.g. a git worktree)")
    ap.add_argument("--configs", nargs="+", default=["tiny", "small_100m"])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = {"width": a.width, "steps_per_call": a.steps, "configs": {}}
    for name in a.configs:
        this, base = (worker(t, name, a.width, a.steps, a.calls) for t in (here, a.baseline))
        try:
            pairs = [(ask(this), ask(base)) for _ in range(a.rounds)]
        finally:
            for p in (this, base):
                p.stdin.close()
                p.wait()
        ratios = [x / y for x, y in pairs]
        res["configs"][name] = {
            "this_call_s": statistics.median(p[0] for p in pairs),
            "baseline_call_s": statistics.median(p[1] for p in pairs),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
        }
        r = res["configs"][name]
        print(
            f"{name}: decode[{a.width}] x {a.steps} steps: {1e3 * r['this_call_s']:.2f} ms here, "
            f"{1e3 * r['baseline_call_s']:.2f} ms baseline; ratio {r['ratio_median']:.3f} "
            f"(rounds {min(ratios):.3f} to {max(ratios):.3f})"
        )
    write_result(res, "bench_decode_cost", argv, a.out)


if __name__ == "__main__":
    main()
