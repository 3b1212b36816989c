"""README's first command, timed: ``python train.py --config configs/tiny.py`` from start to
exit in a fresh workdir, with the losses it reaches.

    python -m benchmarks.bench_first_run --out benchmarks/results/first_run_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        work = os.path.join(tmp, "run")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "train.py", "--config", a.config, "--workdir", work], cwd=root, check=True)
        wall = time.perf_counter() - t0
        with open(os.path.join(work, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    res = {
        "config": a.config,
        "wall_s": wall,
        "steps": train[-1]["step"],
        "final_train_loss": train[-1]["loss"],
        "final_eval_loss": evals[-1]["eval_loss"],
        "final_eval_step": evals[-1]["step"],
    }
    print(json.dumps(res, indent=2))
    write_result(res, "bench_first_run", argv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
