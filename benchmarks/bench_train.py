"""Train-step throughput, model-FLOPs utilisation and compiled memory on whatever device is present.

    python -m benchmarks.bench_train [--configs tiny small_100m] [--steps 3] [--out results/train_cpu.json]
    python -m benchmarks.bench_train --configs gla_340m --global-batch 16 --seq-len 2048 \\
        --remat full none --dtype bfloat16 --out results/train_h200.json          # on a GPU

MFU = flops_per_token x tokens/s / (devices x peak). flops_per_token is 6 x matmul parameters +
3 x the GLA chunk-form FLOPs (``train.accounting.flops_per_token``; recomputation is not counted). The
peak is ``platform.peak_flops_per_device``: the dense bf16 table in ``laplace_jax/platform.py``
on accelerators, and on CPU an fp32 matmul measured in the same run. One device, synthetic
batches, median step time over ``--steps`` steps after two warm-up steps; memory is XLA's
compiled memory analysis of the same step.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from benchmarks.common import write_result
from laplace_jax.config import RunConfig, load_config_file
from laplace_jax.hlo_stats import memory_report
from laplace_jax.platform import median_seconds, peak_flops_per_device
from laplace_jax.train.accounting import flops_per_token
from laplace_jax.train.trainer import Trainer


def bench(cfg: RunConfig, steps: int, peak: float) -> dict:
    trainer = Trainer(cfg, jax.devices()[:1])
    step = trainer.compile()
    mem = memory_report(step)
    state = trainer.init(0)
    shape = trainer.abstract_batch.shape
    batch = jax.device_put(np.random.default_rng(0).integers(1, 256, shape).astype(np.int32), trainer.batch_sharding)
    holder = {"state": state}

    def one():
        holder["state"], m = step(holder["state"], batch)
        return m

    t = median_seconds(one, repeats=steps, warmup=2)
    tps = trainer.tokens_per_step / t
    fpt = flops_per_token(trainer.model_cfg, trainer.n_params, trainer.config.data.seq_len)
    return {
        "params": trainer.n_params,
        "batch": cfg.data.global_batch,
        "seq_len": cfg.data.seq_len,
        "dtype": cfg.model.dtype,
        "remat": cfg.model.remat,
        "tokens_per_step": trainer.tokens_per_step,
        "step_s": t,
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "mfu": fpt * tps / peak,
        "memory": mem,
    }


def _config(name: str, a: argparse.Namespace, remat: str | None) -> RunConfig:
    cfg = load_config_file(name if name.endswith(".py") else os.path.join("configs", f"{name}.py"))
    for key, value in (("global_batch", a.global_batch), ("seq_len", a.seq_len)):
        if value:
            cfg.data[key] = value
    if a.seq_len:
        cfg.model.max_seq_len = max(cfg.model.max_seq_len, a.seq_len)
    cfg.train.grad_accum = 1
    if a.dtype:
        cfg.model.dtype = a.dtype
    if remat:
        cfg.model.remat = remat
    return RunConfig.from_mapping(cfg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small_100m"], help="names under configs/ or paths")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per config (after two warm-up steps)")
    ap.add_argument("--global-batch", type=int, default=0, help="override data.global_batch (0: the config's)")
    ap.add_argument("--seq-len", type=int, default=0, help="override data.seq_len (0: the config's)")
    ap.add_argument("--dtype", default="", help="override model.dtype, e.g. bfloat16")
    ap.add_argument("--remat", nargs="*", default=[], help="model.remat values to run each config with")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    peak, source = peak_flops_per_device()
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "platform": dev.platform, "peak_flops": peak, "peak_source": source, "runs": {}}
    print(f"{dev.device_kind}: peak {peak / 1e12:.3f} TFLOP/s ({source})")
    for name in a.configs:
        for remat in a.remat or [None]:
            cfg = _config(name, a, remat)
            key = name if remat is None else f"{name} remat={remat}"
            r = res["runs"][key] = bench(cfg, a.steps, peak)
            print(
                f"{key:>24}: {r['params'] / 1e6:7.1f}M params  {r['batch']}x{r['seq_len']}  "
                f"step {r['step_s'] * 1e3:9.1f} ms  {r['tokens_per_s']:10,.0f} tok/s  MFU {100 * r['mfu']:5.1f}%  "
                f"memory {r['memory']['total'] / 2**30:.2f} GiB"
            )
    write_result(res, "bench_train", argv, a.out)


if __name__ == "__main__":
    main()
