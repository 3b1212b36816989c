"""Train-step throughput and model-FLOPs utilisation on this machine.

    python -m benchmarks.bench_train [--configs tiny small_100m] [--steps 8] [--out results/train_cpu.json]

MFU = flops_per_token x tokens/s / peak, where flops_per_token is 6 x matmul parameters + 3 x the
GLA chunk-form FLOPs (laplace_jax.train.step.flops_per_token) and the peak is this machine's
fp32 matmul throughput measured in the same run (2048^3). One device, synthetic batches,
median step time over ``--steps`` steps after two warm-up steps.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from laplace_jax.config import load_config_file
from laplace_jax.platform import matmul_gflops, median_seconds
from laplace_jax.train.loop import Setup
from laplace_jax.train.step import flops_per_token


def bench(name: str, steps: int, peak: float) -> dict:
    cfg = load_config_file(f"configs/{name}.py")
    setup = Setup(cfg, jax.devices()[:1])
    step = setup.compile()
    state = setup.init(0)
    shape = setup.abstract_batch.shape
    batch = jax.device_put(np.random.default_rng(0).integers(1, 256, shape).astype(np.int32), setup.batch_sharding)
    holder = {"state": state}

    def one():
        holder["state"], m = step(holder["state"], batch)
        return m

    t = median_seconds(one, repeats=steps, warmup=2)
    tps = setup.tokens_per_step / t
    fpt = flops_per_token(setup.model, setup.n_params)
    return {
        "params": setup.n_params,
        "tokens_per_step": setup.tokens_per_step,
        "step_s": t,
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "mfu": fpt * tps / peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small_100m"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    peak = matmul_gflops() * 1e9
    res = {"device": jax.devices()[0].device_kind, "matmul_fp32_gflops": peak / 1e9, "configs": {}}
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    for name in a.configs:
        r = bench(name, a.steps, peak)
        res["configs"][name] = r
        print(
            f"{name:>12}: {r['params'] / 1e6:7.1f}M params  step {r['step_s'] * 1e3:8.1f} ms  "
            f"{r['tokens_per_s']:9,.0f} tok/s  MFU {100 * r['mfu']:5.1f}%"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
