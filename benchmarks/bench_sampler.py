"""``sampling.sample_rows`` alone, per kind of request, on this backend; with ``--baseline``, against
another commit's, side by side.

    python -m benchmarks.bench_sampler --baseline a7ff4d1 --out benchmarks/results/sampler_cpu_ab.json

Rows: W rows of V fp32 logits (the 3B's vocabulary by default), every row of one kind: greedy
(temperature 0), plain sampling (temperature 1, no limits: what an OpenAI client sends by
default), top-p 0.95, top-k 50, min-p 0.05. Each figure is the median of ``--calls`` jitted calls
after a warm-up. With ``--baseline`` the measurement also runs in a git worktree of that commit,
rounds alternating (before, now, ...) so the machine's drift falls on both; each row's ratio is
the median of the per-round ratios.
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

KINDS = {  # temperature, top_k, top_p, min_p
    "greedy": (0.0, 0, 1.0, 0.0),
    "plain sampling": (1.0, 0, 1.0, 0.0),
    "top-p 0.95": (1.0, 0, 0.95, 0.0),
    "top-k 50": (1.0, 50, 1.0, 0.0),
    "min-p 0.05": (1.0, 0, 1.0, 0.05),
}


def measure(widths: list[int], vocab: int, calls: int) -> dict[str, float]:
    """{"<kind> W=<w>": median seconds of one ``sample_rows`` call}."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.platform import median_seconds
    from laplace_jax.sampling import sample_rows

    fn = jax.jit(sample_rows)
    out = {}
    for W in widths:
        logits = jax.random.normal(jax.random.key(0), (W, vocab), jnp.float32) * 3
        keys = jax.random.split(jax.random.key(1), W)
        for kind, (t, k, p, m) in KINDS.items():
            args = (
                logits,
                jnp.full(W, t),
                jnp.full(W, k, jnp.int32),
                jnp.full(W, p),
                keys,
                jnp.full(W, m),
            )
            out[f"{kind} W={W}"] = median_seconds(lambda a=args: fn(*a).block_until_ready(), repeats=calls)
    return out


def _run(tree: str, a: argparse.Namespace) -> dict[str, float]:
    """This file's ``measure`` against ``tree``'s package, in a child process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--measure-only", f.name]
        cmd += ["--widths", *map(str, a.widths), "--vocab", str(a.vocab), "--calls", str(a.calls)]
        subprocess.run(cmd, cwd=tree, check=True, env={**os.environ, "PYTHONPATH": tree})
        return json.load(open(f.name))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8, 64], help="rows per call")
    ap.add_argument("--vocab", type=int, default=50304, help="logits per row")
    ap.add_argument("--calls", type=int, default=15, help="timed calls per row (the median is kept)")
    ap.add_argument("--baseline", help="a commit to compare against (measured in a git worktree of it)")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: alternating rounds")
    ap.add_argument("--measure-only", metavar="JSON", help=argparse.SUPPRESS)  # one tree's figures (a child run)
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args(argv)
    if a.measure_only:
        with open(a.measure_only, "w") as f:
            json.dump(measure(a.widths, a.vocab, a.calls), f)
        return {}
    import jax

    res: dict = {"device": jax.default_backend(), "vocab": a.vocab, "calls": a.calls, "kinds": KINDS}
    here = os.getcwd()
    if not a.baseline:
        res["now_s"] = measure(a.widths, a.vocab, a.calls)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "baseline")
            subprocess.run(["git", "worktree", "add", "--detach", tree, a.baseline], check=True, capture_output=True)
            try:
                rounds = [(_run(tree, a), _run(here, a)) for _ in range(a.rounds)]
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], check=True)
        res["baseline"], res["rounds"] = a.baseline, a.rounds
        res["before_s"] = {k: statistics.median(b[k] for b, _ in rounds) for k in rounds[0][0]}
        res["now_s"] = {k: statistics.median(n[k] for _, n in rounds) for k in rounds[0][1]}
        res["speedup"] = {k: statistics.median(b[k] / n[k] for b, n in rounds) for k in rounds[0][1]}
    write_result(res, "bench_sampler", argv, a.out)
    for k, s in res["now_s"].items():
        extra = f"  ({res['speedup'][k]:.2f}x of {a.baseline})" if a.baseline else ""
        print(f"{k:24s} {1e3 * s:8.2f} ms{extra}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
