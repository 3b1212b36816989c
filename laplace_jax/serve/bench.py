"""Load generator for any OpenAI-compatible /v1/completions server (``vllm bench serve`` style).

    python -m laplace_jax.serve.bench --base-url http://127.0.0.1:8000 --model tiny \\
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 8 --burstiness 1 \\
        --max-concurrency 16 --out results.json

Prompts are random token ids (exact input lengths), the same as text with ``--text`` (one letter
per id, an exact length with the byte tokenizer: routers such as sglang-router's cache_aware
match prefixes of the request text), or lines of a --prompts-file.
``--workload shared-prefix``: each prompt is one of --num-prefixes random --prefix-len-id system
prompts followed by --input-len random ids (K system prompts x many users).
``--workload multi-turn``: --num-prompts chats of --turns turns, run turn by turn; each turn's
prompt is the previous turn's prompt and reply plus --input-len new ids (the reply's ids come
back as logprobs with ``return_tokens_as_token_ids``). It reports TTFT per turn and, from the
server's /metrics where it has them, the ids prefilled and restored from the prefix cache per turn.

Arrival gaps are gamma-distributed (shape = burstiness; 1 = Poisson), drawn in advance and rescaled to span
num_prompts / rate. Streams every request and reports TTFT, TPOT = (E2EL - TTFT) / (out - 1),
ITL (gaps between streamed chunks) and E2EL: mean, median, p90, p99; request, output-token and
total-token throughput. A chunk counts when it carries a token, also one whose text the server
still holds back (an incomplete UTF-8 sequence of the byte tokenizer).

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

from laplace_jax.serve.metrics import sample_sum
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
    ttft, stamps, usage, err, ids = None, [], None, None, []
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
                lp = chunk["choices"][0].get("logprobs") if chunk.get("choices") else None
                if lp:  # "token_id:<id>" (return_tokens_as_token_ids)
                    ids += [int(t.split(":", 1)[1]) for t in lp["tokens"]]
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice and (choice.get("text") or choice.get("finish_reason") is None):  # a token arrived
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
        "ids": ids,
    }


def _body(args: argparse.Namespace, prompt, seed: int) -> dict:
    return {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": args.temperature,
        "seed": seed,
    }


async def _metric(client: httpx.AsyncClient, base_url: str, name: str) -> float | None:
    """A counter from the server's /metrics (None if it has none: another server)."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics")
        return sample_sum(r.text, name) if r.status_code == 200 and name in r.text else None
    except httpx.HTTPError:
        return None


async def run_chats(args: argparse.Namespace) -> dict:
    """The multi-turn workload (see the module docstring)."""
    rng = np.random.default_rng(args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    convs = [[] for _ in range(args.num_prompts)]
    sem = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    turns, failed = [], 0
    names = {"prefilled": "laplace:prefill_tokens_total", "restored": "laplace:prefix_cache_tokens_total"}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.num_prompts + 8)) as client:

        async def turn(i: int) -> dict:
            convs[i] += rng.integers(1, args.vocab_size, args.input_len).tolist()
            body = _body(args, convs[i], int(rng.integers(0, 2**31 - 1)))
            body |= {"logprobs": 0, "return_tokens_as_token_ids": True}
            async with sem:
                r = await one(client, url, body)
            convs[i] += r["ids"]
            return r

        for t in range(args.turns):
            before = {k: await _metric(client, args.base_url, n) for k, n in names.items()}
            t0 = time.perf_counter()
            results = await asyncio.gather(*(turn(i) for i in range(args.num_prompts)))
            wall = time.perf_counter() - t0
            after = {k: await _metric(client, args.base_url, n) for k, n in names.items()}
            ok = [r for r in results if r["ok"]]
            failed += len(results) - len(ok)
            counted = {k: None if before[k] is None else after[k] - before[k] for k in names}
            turns.append(
                {
                    "turn": t + 1,
                    "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
                    "new_tokens": args.input_len * len(ok),
                    "prefilled_tokens": counted["prefilled"],
                    "restored_tokens": counted["restored"],
                    "duration_s": wall,
                    "ttft_s": stats([r["ttft"] for r in ok]),
                }
            )
    return {"config": {k: v for k, v in vars(args).items() if k != "out"}, "failed": failed, "turns": turns}


async def run(args: argparse.Namespace) -> dict:
    if args.workload == "multi-turn":
        return await run_chats(args)
    rng = np.random.default_rng(args.seed)
    if args.workload == "shared-prefix":
        systems = [rng.integers(1, args.vocab_size, args.prefix_len).tolist() for _ in range(args.num_prefixes)]
        prompts = [
            systems[i % args.num_prefixes] + rng.integers(1, args.vocab_size, args.input_len).tolist()
            for i in range(args.num_prompts)
        ]
    elif args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        prompts = [texts[i % len(texts)] for i in range(args.num_prompts)]
    else:
        prompts = [rng.integers(1, args.vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    if args.text and not args.prompts_file:
        prompts = ["".join(chr(97 + t % 26) for t in p) for p in prompts]
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
            body = _body(args, p, int(rng.integers(0, 2**31 - 1)))
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
        "ttft_by_request_s": [r.get("ttft") for r in results],
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
    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix", "multi-turn"])
    ap.add_argument("--input-len", type=int, default=128, help="ids per prompt (shared-prefix: after the prefix)")
    ap.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: ids per system prompt")
    ap.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    ap.add_argument("--turns", type=int, default=3, help="multi-turn: turns per chat")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-file", default=None, help="one prompt per line (text) instead of random ids")
    ap.add_argument("--text", action="store_true", help="send the random prompts as text (a letter per id)")
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
    if args.workload == "multi-turn":
        for t in res["turns"]:
            print(
                f"turn {t['turn']}: TTFT p50 {1e3 * t['ttft_s']['median']:.0f} ms, {t['new_tokens']} new ids, "
                f"{t['prefilled_tokens']} prefilled, {t['restored_tokens']} restored"
            )
        return 0 if res["failed"] == 0 else 1
    print(
        f"completed {res['completed']}/{res['completed'] + res['failed']} in {res['duration_s']:.1f} s: "
        f"{res['output_throughput']:.1f} output tok/s, TTFT p50 {1e3 * res['ttft_s']['median']:.0f} ms, "
        f"TPOT p50 {1e3 * res['tpot_s']['median']:.1f} ms, p99 {1e3 * res['tpot_s']['p99']:.1f} ms"
    )
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
