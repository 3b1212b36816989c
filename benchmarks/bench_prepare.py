"""Data preparation at scale: prepare's tokens/s per worker against the tokenizer's own
``encode_batch`` on the same core (the limit), peak memory at 1x and 4x the data, the training
reader's tokens/s, and what 100e9 tokens would take (an extrapolation of the measured rate).

    python -m benchmarks.bench_prepare --out benchmarks/results/prepare_cpu.json [--ray]

Inputs are FineWeb-Edu-shaped Parquet shards (text, id, url, score, token_count) made from text
that ships with CPython (the standard library's sources and docstrings), so nothing is
downloaded. The BPE tokenizer is trained here with ``tokenizers`` at GPT-2's vocabulary size
(50,257, byte-level, <|endoftext|>): GPT-2's own tokenizer.json cannot be fetched on this machine.
Every prepare and limit run is a child process pinned to one core; peak RSS is the sum over the
process tree, sampled every 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np
import psutil

from benchmarks.common import write_result

GPT2_VOCAB = 50_257
TARGET_STEP_TOKENS_S = 167_822  # the 3B step on v5p:2x2x4 with the Mosaic kernel (TPU compiler estimate, tpu.md)
HOSTS_OF_16_V5P = 4  # a v5p-32 slice: 16 chips on 4 hosts
RECIPE_TOKENS = 100e9


def stdlib_texts() -> list[str]:
    """The standard library's .py files, in a fixed order (about 30 MB of text)."""
    texts, root = [], sysconfig.get_paths()["stdlib"]
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
    return texts


def make_shards(texts: list[str], folder: str, shards: int, mb_per_shard: float) -> int:
    """FineWeb-Edu-shaped Parquet shards; shard i cycles the texts from an offset, each document
    tagged with its shard and row (no two identical). Returns the bytes of text written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    total = 0
    for i in range(shards):
        rows, size, j = [], 0, i * 97
        while size < mb_per_shard * 1e6:
            text = f"# shard {i} row {len(rows)}\n" + texts[j % len(texts)]
            rows.append(text)
            size, j = size + len(text.encode()), j + 1
        n = len(rows)
        table = pa.table(
            {
                "text": rows,
                "id": [f"<urn:uuid:{i:04d}-{r:06d}>" for r in range(n)],
                "url": [f"https://example.org/{i}/{r}" for r in range(n)],
                "score": np.linspace(2.5, 4.5, n).tolist(),
                "token_count": [len(t) // 4 for t in rows],
            }
        )
        pq.write_table(table, os.path.join(folder, f"shard-{i:05d}.parquet"))
        total += size
    return total


def train_bpe(texts: list[str], path: str) -> float:
    """A byte-level BPE tokenizer.json at GPT-2's vocabulary size; returns the training seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=GPT2_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return time.perf_counter() - t


def run_tree(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` on core 0; wall seconds and the peak RSS of its whole process tree."""
    t = time.perf_counter()
    proc = subprocess.Popen(["taskset", "-c", "0", *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err.decode()[-3000:]}")
    return {"seconds": time.perf_counter() - t, "peak_rss_bytes": peak, "output": out.decode().strip()}


def prepare_run(inputs: str, tokenizer: str, out: str, tasks: int, workers: int, extra=()) -> dict:
    cmd = [sys.executable, "-m", "laplace_jax.data.prepare", "--input", inputs, "--tokenizer", tokenizer]
    r = run_tree([*cmd, "--out", out, "--tasks", str(tasks), "--workers", str(workers), *extra])
    print(r.pop("output"), flush=True)  # its one summary line (it names this machine's temporary paths)
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(out, ".prepare", "tasks", "stats.json")) as f:
        writer = next(step for step in json.load(f) if "tokenize to a shard" in step["name"])
    task_seconds = writer["time_stats"]["total"]  # every task's read + tokenize + write, summed
    tokens = sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
    docs = sum(manifest["splits"][s]["docs"] for s in ("train", "val"))
    return {
        **r,
        "tokens": tokens,
        "docs": docs,
        "task_seconds": task_seconds,
        "tokens_per_s": tokens / task_seconds,  # per worker, in its tasks
        "wall_tokens_per_s": tokens / r["seconds"],  # the whole command, start-up included
        "manifest": manifest,
    }


LIMIT = """
import glob, sys, time, pyarrow.parquet as pq
from laplace_jax.data.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[2])
texts = [t for f in sorted(glob.glob(sys.argv[1])) for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
t = time.perf_counter(); n = 0
for i in range(0, len(texts), 512):
    n += sum(len(x) for x in tok.encode_batch(texts[i:i + 512]))
print(n, time.perf_counter() - t)
"""


def encode_limit(inputs: str, tokenizer: str) -> dict:
    """The tokenizer's own batch call alone over the same texts, on the same core (the limit);
    the documents' EOS tokens are added so the count matches prepare's."""
    r = run_tree([sys.executable, "-c", LIMIT, inputs, tokenizer])
    tokens, seconds = r["output"].split()
    return {"tokens": int(tokens), "encode_seconds": float(seconds), "tokens_per_s": int(tokens) / float(seconds)}


def reader_rate(path: str, seq_len: int, global_batch: int, batches: int) -> dict:
    """Tokens/s of the training reader (grain over the shards, shuffled windows) on this host."""
    from laplace_jax.data.pipeline import store_windows, train_batches

    windows = store_windows(path, "train", seq_len)
    it = iter(train_batches(windows, global_batch=global_batch, seed=0, num_steps=batches + 5))
    for _ in range(5):  # warm: the prefetch threads start and the shards open
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t
    tokens = batches * global_batch * seq_len
    return {"seq_len": seq_len, "global_batch": global_batch, "batches": batches, "tokens_per_s": tokens / seconds}


def ray_run(inputs: str, out: str, tasks: int, local_manifest: dict) -> dict:
    """The same pipeline on datatrove's Ray executor against a local ``ray start --head``."""
    subprocess.run(
        ["ray", "start", "--head", "--num-cpus", "2", "--disable-usage-stats"], check=True, capture_output=True
    )
    try:
        r = prepare_run(inputs, "byte", out, tasks, 2, ("--executor", "ray", "--ray_address", "auto"))
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    same = r.pop("manifest") == local_manifest
    return {**r, "manifest_equals_local": same}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--mb", type=float, default=6.0, help="MB of text per input shard (1x = 4 shards)")
    ap.add_argument("--ray", action="store_true", help="also run the Ray executor on a local Ray instance")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench_prepare_")
    texts = stdlib_texts()
    res: dict = {"host_cpus": os.cpu_count(), "inputs": {}}
    for scale, shards in (("1x", 4), ("4x", 16)):
        res["inputs"][scale] = {"shards": shards, "text_bytes": make_shards(texts, f"{tmp}/{scale}", shards, a.mb)}
    bpe = f"{tmp}/tokenizer.json"
    res["bpe"] = {"vocab_size": GPT2_VOCAB, "train_seconds": train_bpe(texts, bpe)}
    runs, limits = {}, {}
    for name, scale, tok, tasks in (
        ("byte_1x", "1x", "byte", 4),
        ("byte_4x", "4x", "byte", 16),
        ("bpe_1x", "1x", bpe, 4),
    ):
        inputs = f"{tmp}/{scale}/*.parquet"
        runs[name] = prepare_run(inputs, tok, f"{tmp}/out_{name}", tasks, 1)
        print(f"{name}: {runs[name]['tokens']:,} tokens, {runs[name]['tokens_per_s'] / 1e6:.2f} M tok/s, "
              f"peak RSS {runs[name]['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
        if scale == "1x":
            limits[name] = encode_limit(inputs, tok)
            docs = runs[name]["docs"]
            limits[name]["tokens_per_s"] = (limits[name]["tokens"] + docs) / limits[name]["encode_seconds"]
            runs[name]["share_of_limit"] = runs[name]["tokens_per_s"] / limits[name]["tokens_per_s"]
    local_manifest = runs["byte_1x"]["manifest"]
    for r in runs.values():
        r.pop("manifest")
    res["prepare"], res["encode_limit"] = runs, limits
    res["rss_4x_over_1x"] = runs["byte_4x"]["peak_rss_bytes"] / runs["byte_1x"]["peak_rss_bytes"]
    reader = reader_rate(f"{tmp}/out_byte_4x", 2048, 64, 40)
    per_host_need = TARGET_STEP_TOKENS_S / HOSTS_OF_16_V5P
    res["reader"] = {**reader, "step_tokens_per_s": TARGET_STEP_TOKENS_S, "per_host_need": per_host_need}
    rate = runs["bpe_1x"]["tokens_per_s"]
    res["extrapolation"] = {
        "tokens": RECIPE_TOKENS,
        "per_worker_tokens_per_s": rate,
        "hours": {str(n): RECIPE_TOKENS / (rate * n) / 3600 for n in (64, 256, 1024)},
    }
    if a.ray:
        res["ray"] = ray_run(f"{tmp}/1x/*.parquet", f"{tmp}/out_ray", 4, local_manifest)
    write_result(res, "bench_prepare", argv, a.out)
    print(json.dumps({k: v for k, v in res.items() if k != "inputs"}, indent=1, default=str)[:3000])
    return res


if __name__ == "__main__":
    main()
