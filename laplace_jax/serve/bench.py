"""Load generator for any OpenAI-compatible /v1/completions server (``vllm bench serve`` style).

    python -m laplace_jax.serve.bench --base-url http://127.0.0.1:8000 --model tiny \\
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 8 --burstiness 1 \\
        --max-concurrency 16 --out results.json

Prompts are random token ids (exact input lengths) or lines of a --prompts-file. Arrival gaps
are gamma-distributed (shape = burstiness; 1 = Poisson), drawn in advance and rescaled to span
num_prompts / rate. Streams every request and reports TTFT, TPOT = (E2EL - TTFT) / (out - 1),
ITL (gaps between streamed chunks) and E2EL: mean, median, p90, p99; request, output-token and
total-token throughput.

    python -m laplace_jax.serve.bench --soak --model tiny --num-prompts 2000 --max-concurrency 32 \\
        [--server-pid PID] --out soak.json

``--soak`` runs the robustness soak instead (``laplace_jax/serve/soak.py``): random valid
parameters, 20% of clients leaving mid-stream, 5% invalid bodies; it reports errors by kind,
leaked slots, compiles after warmup and (with the server's PID) its RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
import numpy as np
from tqdm import tqdm

from laplace_jax.serve.soak import run_soak


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    if rate == float("inf"):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    return gaps * (n / rate) / max(gaps.sum(), 1e-12)


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, stamps, usage, err = None, [], None, None
    try:
        async with client.stream("POST", url, json=body, timeout=None) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    ttft = ttft if ttft is not None else now - t0
                    stamps.append(now)
    except httpx.HTTPError as e:
        err = str(e)
    e2e = time.perf_counter() - t0
    out = usage["completion_tokens"] if usage else len(stamps)
    return {
        "ok": err is None and ttft is not None,
        "error": err,
        "ttft": ttft,
        "e2el": e2e,
        "output_tokens": out,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "itl": list(np.diff(stamps)),
    }


async def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        prompts = [texts[i % len(texts)] for i in range(args.num_prompts)]
    else:
        prompts = [rng.integers(1, args.vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    gaps = arrival_gaps(args.num_prompts, args.request_rate, args.burstiness, rng)
    sem = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    url = args.base_url.rstrip("/") + "/v1/completions"

    async def limited(client, body):
        async with sem:
            return await one(client, url, body)

    limits = httpx.Limits(max_connections=args.num_prompts + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        for p, gap in zip(prompts, gaps, strict=True):
            await asyncio.sleep(gap)
            body = {
                "model": args.model,
                "prompt": p,
                "max_tokens": args.output_len,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "temperature": args.temperature,
                "seed": int(rng.integers(0, 2**31 - 1)),
            }
            tasks.append(asyncio.create_task(limited(client, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] or args.input_len for r in ok)
    tpot = [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "ttft_s": stats([r["ttft"] for r in ok]),
        "tpot_s": stats(tpot),
        "itl_s": stats([x for r in ok for x in r["itl"]]),
        "e2el_s": stats([r["e2el"] for r in ok]),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m laplace_jax.serve.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-file", default=None, help="one prompt per line (text) instead of random ids")
    ap.add_argument("--vocab-size", type=int, default=256, help="range of random prompt ids")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--soak", action="store_true", help="run the robustness soak (see the module docstring)")
    ap.add_argument("--server-pid", type=int, default=None, help="with --soak: measure this process's RSS growth")
    return ap.parse_args(argv)


def soak_main(args: argparse.Namespace) -> int:
    with tqdm(total=args.num_prompts, desc="soak", unit="req") as bar:
        res = asyncio.run(
            run_soak(
                args.base_url,
                args.model,
                args.num_prompts,
                args.max_concurrency or 32,
                args.vocab_size,
                args.seed,
                args.server_pid,
                progress=lambda: bar.update(1),
            )
        )
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    clean = res["errors_total"] == 0 and res["leaked_slots"] == 0 and res["compiles_after_warmup"] == 0
    return 0 if clean and res["health_after"] == 200 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.soak:
        return soak_main(args)
    res = asyncio.run(run(args))
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(
        f"completed {res['completed']}/{res['completed'] + res['failed']} in {res['duration_s']:.1f} s: "
        f"{res['output_throughput']:.1f} output tok/s, TTFT p50 {1e3 * res['ttft_s']['median']:.0f} ms, "
        f"TPOT p50 {1e3 * res['tpot_s']['median']:.1f} ms, p99 {1e3 * res['tpot_s']['p99']:.1f} ms"
    )
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
