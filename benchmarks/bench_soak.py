"""Serving soak on this machine: ``serve.py`` in its own process, then the soak client against it.

    python -m benchmarks.bench_soak [--requests 2000 --concurrency 32] --out benchmarks/results/soak_cpu_tiny.json

The model is a 2-layer d=64 byte model with random weights (saved to a temporary model
directory), served with 8 slots and pow2 buckets. The server's RSS is read (psutil) after a
warm-up batch of 100 requests and at the end, so allocator warm-up is not counted as growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import portpicker
from tqdm import tqdm

from benchmarks.common import write_result
from laplace_jax.checkpoint import save_model
from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import init_params
from laplace_jax.serve.soak import run_soak

CFG = ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, max_seq_len=1024
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prefix-cache-bytes", default="1G", help="serve.py's prefix-cache budget (its default: 1G)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(os.path.join(tmp, "m"), CFG, init_params(CFG, jax.random.key(0)))
        port = portpicker.pick_unused_port()
        url = f"http://127.0.0.1:{port}"
        args = ["--checkpoint", os.path.join(tmp, "m"), "--tokenizer", "byte", "--port", str(port)]
        args += ["--max-num-seqs", "8", "--prefill-chunk", "32", "--max-queue", "256"]
        args += ["--prefix-cache-bytes", a.prefix_cache_bytes]
        proc = subprocess.Popen([sys.executable, "serve.py", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            asyncio.run(run_soak(url, "m", 100, a.concurrency, seed=1))  # warm-up batch (not reported)
            with tqdm(total=a.requests, desc="soak", unit="req") as bar:
                res = asyncio.run(
                    run_soak(url, "m", a.requests, a.concurrency, server_pid=proc.pid, progress=lambda: bar.update(1))
                )
        finally:
            proc.terminate()
            proc.wait(60)
    res["model"] = "2-layer d=64 byte model, random weights, 8 slots, pow2 buckets"
    write_result(res, "bench_soak", argv, a.out)
    print(json.dumps(res, indent=2))
    clean = res["errors_total"] == 0 and res["leaked_slots"] == 0 and res["compiles_after_warmup"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
