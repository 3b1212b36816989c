"""serve.py with and without ``--speculative-config`` (n-gram lookup), side by side, over HTTP.

    python -m benchmarks.bench_speculative_serve --out benchmarks/results/speculative_serve_cpu.json

Two servers of the same model and settings run in this process (one with speculation), each on
its own loopback port; rounds alternate between them (A B A B ..) and the ratio is taken round by
round. A round sends ``--requests`` completions over one kept-alive ``httpx.Client`` (a new client
per request costs ~20 ms here: its TLS context), with ``--width`` of them in flight at once (W=1:
one at a time; W=8: eight decoded together) and times output tokens per second and per-token
latency ((end - first token) / (tokens - 1), from the stream). Workloads: "repetitive" (a prompt
that repeats one phrase, greedy; the random-weight model does not continue the phrase, and its
output repeats itself after a few dozen tokens), "quoting" (a prompt that holds the model's own
greedy continuation of its first 24 ids, greedy: the output goes on with text from the prompt
from its first token, as a summary that quotes its source or a code edit does) and
"non-repetitive" (a prompt of random ids, sampled at temperature 1: drafts fail, and speculation
must turn itself off). The model is
``--config`` with random weights (the tiny model: a decode step is a fraction of a millisecond, so
host and dispatch overhead weigh as much as the model).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import orjson
import portpicker

from benchmarks.common import write_result
from laplace_jax.config import load_run_config
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.models.gla_lm import init_params
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.launch import BackgroundServer
from laplace_jax.serve.metrics import ServeMetrics
from laplace_jax.serve.request import SamplingParams
from laplace_jax.serve.routes import Server


def _workloads(engine: Engine, n: int) -> dict[str, list[dict]]:
    """Request bodies (no model field) per workload; ``n`` of each, distinct prompts. "quoting":
    a random start and the model's own greedy continuation of it (``engine``), so the output goes
    on with text the prompt already holds, as a summary quotes its source."""
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    out: dict[str, list[dict]] = {"repetitive": [], "quoting": [], "non-repetitive": []}
    starts = [[int(t) for t in rng.integers(1, vocab, 24)] for _ in range(n)]
    greedy = SamplingParams(max_tokens=168, temperature=0, ignore_eos=True)
    for i, (start, done) in enumerate(zip(starts, engine.generate(starts, greedy), strict=True)):
        phrase = [int(t) for t in rng.integers(1, vocab, 24)]
        out["repetitive"].append({"prompt": phrase * 8, "temperature": 0})
        out["quoting"].append({"prompt": start + done.tokens, "temperature": 0})
        out["non-repetitive"].append({"prompt": [int(t) for t in rng.integers(1, vocab, 192)], "seed": i})
    return out


def _stream(client: httpx.Client, url: str, body: dict) -> tuple[int, float, float]:
    """(output tokens, seconds to the first token, seconds to the end) of one streamed completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
    return tokens, first or 0.0, time.perf_counter() - t0


def _round(url: str, bodies: list[dict], width: int) -> dict:
    with httpx.Client() as client, ThreadPoolExecutor(width) as pool:  # kept-alive connections, as SDKs keep
        t0 = time.perf_counter()
        done = list(pool.map(lambda b: _stream(client, url, b), bodies))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _, _ in done)
    tpot = statistics.mean((end - first) / max(n - 1, 1) for n, first, end in done)
    return {"tok_s": tokens / wall, "tpot_s": tpot, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8, help="requests per round")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_run_config(a.config).model
    params = init_params(cfg, jax.random.key(0))
    serve = ServeConfig(devices=1, max_num_seqs=max(a.widths), max_model_len=1024)
    workloads = _workloads(Engine(cfg, params, serve, eos_id=ByteTokenizer().eos_id), a.requests)
    servers = {}
    for name, spec in (("plain", None), ("speculative", a.speculative_config)):
        serve = ServeConfig(devices=1, max_num_seqs=max(a.widths), max_model_len=1024, speculative_config=spec)
        engine = Engine(cfg, params, serve, eos_id=ByteTokenizer().eos_id, metrics=ServeMetrics())
        servers[name] = BackgroundServer(Server(engine, ByteTokenizer(), "tiny"), portpicker.pick_unused_port())
    res: dict = {"config": a.config, "max_tokens": a.max_tokens, "speculative_config": a.speculative_config}
    res["rounds"] = a.rounds
    res["runs"] = {}
    for workload, bodies in workloads.items():
        bodies = [{**b, "model": "tiny", "max_tokens": a.max_tokens, "ignore_eos": True} for b in bodies]
        for width in a.widths:
            rounds: dict[str, list[dict]] = {"plain": [], "speculative": []}
            before = servers["speculative"].server.engine.programs.speculation_counts.copy()
            for _ in range(a.rounds + 1):  # the first round warms both up and is not counted
                for name, srv in servers.items():
                    rounds[name].append(_round(srv.url, bodies, width))
            drafts, proposed, accepted = servers["speculative"].server.engine.programs.speculation_counts - before
            p, s = rounds["plain"][1:], rounds["speculative"][1:]
            row = {
                "workload": workload,
                "width": width,
                "plain_tok_s": statistics.median(r["tok_s"] for r in p),
                "speculative_tok_s": statistics.median(r["tok_s"] for r in s),
                "speedup": statistics.median(b["tok_s"] / a_["tok_s"] for a_, b in zip(p, s, strict=True)),
                "plain_tpot_ms": 1e3 * statistics.median(r["tpot_s"] for r in p),
                "speculative_tpot_ms": 1e3 * statistics.median(r["tpot_s"] for r in s),
                "acceptance_rate": float(accepted / proposed) if proposed else 0.0,
                "drafts": int(drafts),
                # output tokens that came from verify steps (each: its accepted draft tokens and one more)
                "verified_share": float((drafts + accepted) / sum(r["tokens"] for r in rounds["speculative"])),
            }
            res["runs"][f"{workload}/W={width}"] = row
            print(row, flush=True)
    for srv in servers.values():
        res.setdefault("compiles_after_warmup", 0)
        res["compiles_after_warmup"] += srv.server.engine.compiles.total("serving")
        srv.close()
    write_result(res, "bench_speculative_serve", argv, a.out)


if __name__ == "__main__":
    main()
