"""This tree against another commit's, side by side: ``bench_serve`` run in turn in a git worktree of
``--baseline`` and here, ``--rounds`` times, and the ratio now / before per row.

    python -m benchmarks.bench_ab --baseline ed74b2d --rounds 3 --out benchmarks/results/serve_cpu_structured_ab.json

Rows: the compiled decode call's tokens/s per bucket (``roofline``) and the HTTP output tokens/s
per concurrency (``concurrency``), unconstrained requests only, as ``bench_serve`` measures them.
Rounds alternate (before, now, before, now, ...) so a drift of the machine's speed falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import write_result


def _rows(result: dict) -> dict[str, float]:
    out = {}
    for config, sections in result["configs"].items():
        for width, x in sections.get("roofline", {}).get("buckets", {}).items():
            out[f"{config} roofline {width}"] = x["tokens_per_s"]
        for width, x in (sections.get("concurrency") or {}).items():
            out[f"{config} concurrency {width}"] = x["output_throughput"]
    return out


def _bench(tree: str, args: list[str], out: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_serve", *args, "--out", out]
    subprocess.run(cmd, cwd=tree, check=True, env={**os.environ, "PYTHONPATH": tree}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return _rows(json.load(f))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=["tiny"])
    ap.add_argument("--sections", nargs="+", default=["roofline", "concurrency"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    here = os.getcwd()
    args = ["--configs", *a.configs, "--sections", *a.sections]
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "baseline")
        subprocess.run(["git", "worktree", "add", "--detach", base, a.baseline], check=True, capture_output=True)
        try:
            runs = {"before": [], "now": []}
            for i in range(a.rounds):
                for which, tree in (("before", base), ("now", here)):
                    runs[which].append(_bench(tree, args, os.path.join(tmp, f"{which}{i}.json")))
                    print(f"round {i + 1}/{a.rounds} {which}: done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], check=False, capture_output=True)
    rows = {}
    for name in runs["now"][0]:
        before, now = [r[name] for r in runs["before"]], [r[name] for r in runs["now"]]
        ratio = statistics.median(n / b for n, b in zip(now, before, strict=True))
        rows[name] = {"before": before, "now": now, "ratio_median": ratio}
        print(f"{name}: now / before {ratio:.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", a.baseline], capture_output=True, text=True).stdout.strip()
    write_result({"baseline_commit": commit, "rounds": a.rounds, "rows": rows}, "bench_ab", argv, a.out)


if __name__ == "__main__":
    main()
