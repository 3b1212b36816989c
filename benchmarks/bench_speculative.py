"""n-gram speculative decoding against plain decoding, one sequence (W=1), on this host.

    python -m benchmarks.bench_speculative --out benchmarks/results/speculative_cpu.json

Both are single compiled loops on device (``generate.sample``: a scan of decode steps;
``speculative.speculative_sample``: a while loop of lookups and verify calls), greedy, run in turn
and timed after a warmup; the ratio is taken pair by pair. Workloads on the tiny model with random
weights: a prompt that repeats one phrase, and a prompt of random ids. The verify call's K + 1
tokens go through the token scan and, for comparison, the chunk kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import write_result
from laplace_jax.config import load_run_config
from laplace_jax.generate import sample
from laplace_jax.models.gla_lm import init_params
from laplace_jax.speculative import speculative_sample


def _workloads(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    phrase = [int(t) for t in rng.integers(0, vocab, 24)]
    return {"repetitive": phrase * 8, "random": [int(t) for t in rng.integers(0, vocab, 192)]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_run_config(a.config).model
    params = init_params(cfg, jax.random.key(0))
    res = {"config": a.config, "new_tokens": a.new_tokens, "k": a.k, "width": 1, "greedy": True, "runs": {}}
    for name, prompt in _workloads(cfg.vocab_size).items():
        plain = lambda p=prompt: sample(cfg, params, p, a.new_tokens, temperature=0.0)  # noqa: E731
        want = plain()
        for impl in ("recurrent", "chunk"):
            spec = lambda p=prompt, i=impl: speculative_sample(  # noqa: E731
                cfg, params, p, a.new_tokens, num_speculative_tokens=a.k, temperature=0.0, verify_impl=i
            )
            got, stats = spec()
            pairs = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                plain()
                t1 = time.perf_counter()
                spec()
                pairs.append((t1 - t0, time.perf_counter() - t1))
            plain_s, spec_s = (statistics.median(x) for x in zip(*pairs, strict=True))
            res["runs"][f"{name}/{impl}"] = {
                "workload": name,
                "verify_impl": impl,
                "identical_to_plain": got == want,
                "plain_s": plain_s,
                "speculative_s": spec_s,
                "speedup": statistics.median(p / s for p, s in pairs),
                "verify_calls": stats.verify_calls,
                "plain_steps": stats.plain_steps,
                "acceptance_rate": stats.acceptance_rate,
                "tokens_per_verify": (a.new_tokens - stats.plain_steps) / max(stats.verify_calls, 1),
            }
            print(name, impl, res["runs"][f"{name}/{impl}"])
    write_result(res, "bench_speculative", argv, a.out)


if __name__ == "__main__":
    main()
