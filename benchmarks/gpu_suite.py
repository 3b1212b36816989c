"""One prepared GPU run: every figure the GPU issues ask for, appended as JSON lines as it goes.

    PYTHONPATH=. python -m benchmarks.gpu_suite --out $OUT/gpu_suite.jsonl          # a GPU machine
    python -m benchmarks.gpu_suite --dry-run --out /tmp/gpu_suite.jsonl              # tiny shapes, any machine

Measures, in this order (cheapest first, so a time limit cuts the end, not the start):
  1. chunk_gla forward and forward+backward, XLA and Pallas kernels (chunk 64 and 128), at the
     3B layer (B4 T4096 H16 K96 V192, bf16 q/k/v, fp32 g);
  2. fla's chunk_gla at the same shape, when fla and a CUDA torch are installed;
  3. a training step of the 340M config (its own batch and remat policy, one device);
  4. the 3B decode call (bf16 weights, 8 tokens per call) at W = 1, 256 and 1,024 slots.
Every line holds its name, the device kind, the median seconds (warm-up excluded) and the
shape. ``--dry-run`` uses tiny shapes and the Pallas interpreter: it checks the script, not speed.
A failing item writes a line with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp

from laplace_jax.platform import median_seconds, on_gpu

LAYER = {"full": (4, 4096, 16, 96, 192), "dry": (1, 128, 2, 32, 64)}
DECODE_WIDTHS = {"full": (1, 256, 1024), "dry": (4,)}


def emit(out: str, record: dict) -> None:
    record = {"device": jax.devices()[0].device_kind, "time": time.time(), **record}
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def guarded(out: str, name: str, fn: Callable[[], list[dict]]) -> None:
    try:
        for rec in fn():
            emit(out, {"name": name, **rec})
    except Exception as e:  # one failing item must not cost the others
        emit(out, {"name": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})


def gla_inputs(shape):
    B, T, H, K, V = shape
    ks = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(x, (B, T, H, K), jnp.bfloat16) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, K))) / 16
    return q, k, v, g


def kernels(shape, dry: bool) -> list[dict]:
    from laplace_jax.ops.gla import gla

    args = gla_inputs(shape)
    out = []
    for kernel, C in (("chunk", 64), ("chunk", 128), ("pallas", 64), ("pallas", 128)):
        kw = {"impl": kernel, "chunk_size": C, **({"interpret": True} if kernel == "pallas" and dry else {})}
        fwd = jax.jit(lambda q, k, v, g, kw=kw: gla(q, k, v, g, **kw)[0])
        loss = lambda q, k, v, g, kw=kw: gla(q, k, v, g, **kw)[0].astype(jnp.float32).sum()  # noqa: E731
        both = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        for name, fn in (("forward", fwd), ("forward+backward", both)):
            t = median_seconds(lambda fn=fn: fn(*args), repeats=3 if dry else 10, warmup=1 if dry else 3)
            out.append({"kernel": kernel, "chunk": C, "pass": name, "seconds": t, "shape": shape})
    return out


def fla_kernel(shape) -> list[dict]:
    import torch
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    if not torch.cuda.is_available():
        return [{"skipped": "no CUDA torch"}]
    B, T, H, K, V = shape
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).requires_grad_()

    def timed(fn, n=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[n // 2]

    fwd = lambda: fla_chunk_gla(q, k, v, g)[0]  # noqa: E731
    both = lambda: fla_chunk_gla(q, k, v, g)[0].float().sum().backward()  # noqa: E731
    return [
        {"kernel": "fla", "pass": "forward", "seconds": timed(fwd), "shape": shape},
        {"kernel": "fla", "pass": "forward+backward", "seconds": timed(both), "shape": shape},
    ]


def train_step(dry: bool) -> list[dict]:
    from benchmarks.bench_train import bench
    from laplace_jax.config import load_run_config
    from laplace_jax.platform import peak_flops_per_device

    cfg = load_run_config("configs/tiny.py" if dry else "configs/gla_340m.py")
    peak, _ = peak_flops_per_device()
    r = bench(cfg, 2 if dry else 5, peak)
    keep = ("step_s", "tokens_per_s", "mfu", "batch", "seq_len", "remat")
    return [{"config": "tiny" if dry else "gla_340m", **{k: r[k] for k in keep}}]


def decode(dry: bool) -> list[dict]:
    from benchmarks.common import every_slot_live
    from laplace_jax.config import load_run_config
    from laplace_jax.loading import cast_params
    from laplace_jax.models.gla_lm import init_params
    from laplace_jax.serve.config import ServeConfig
    from laplace_jax.serve.engine import Engine

    cfg = load_run_config("configs/tiny.py" if dry else "configs/3b.py").model
    params = cast_params(init_params(cfg, jax.random.key(0)), "bfloat16")
    out = []
    for W in DECODE_WIDTHS["dry" if dry else "full"]:
        serve = ServeConfig(max_num_seqs=W, decode_buckets=str(W), steps_per_call=8, devices=1, prefix_cache_bytes=0)
        eng = Engine(cfg, params, serve, eos_id=0)
        eng.warmup()
        every_slot_live(eng)
        t = median_seconds(lambda eng=eng, W=W: eng.programs.decode(W)[0], repeats=5, warmup=2)
        out.append({"width": W, "call_s": t, "tokens_per_s": 8 * W / t})
        del eng
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON lines are appended here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes and the Pallas interpreter (any machine)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    if not dry and not on_gpu():
        ap.error("no GPU here; pass --dry-run to check the script on this machine")
    shape = LAYER["dry" if dry else "full"]
    guarded(a.out, "chunk_gla", lambda: kernels(shape, dry))
    if not dry:
        guarded(a.out, "fla_chunk_gla", lambda: fla_kernel(shape))
    guarded(a.out, "train_step", lambda: train_step(dry))
    guarded(a.out, "decode", lambda: decode(dry))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
