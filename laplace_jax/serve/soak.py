"""Soak test for an OpenAI-compatible server: many requests with random valid parameters, clients
that vanish mid-stream, and invalid bodies; then leaked slots, compiles after warmup and RSS growth.

Run through the load generator: ``python -m laplace_jax.serve.bench --soak --model NAME
[--num-prompts 2000 --max-concurrency 32 --server-pid PID]``. Each request is one of
  valid       (75%): random sampling fields, streamed or not; must finish with a finish_reason
  disconnect  (20%): streamed, long; the client closes after 1-5 chunks
  invalid     (5%):  a body the server must refuse with a 4xx OpenAI error envelope
Anything else (5xx, a 4xx for a valid body, a stream without [DONE], a broken envelope, a
transport error) is an error, counted by kind.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time

import httpx
import numpy as np
import psutil

from laplace_jax.serve.metrics import sample_sum

INVALID_BODIES = (
    lambda m: {"model": m, "prompt": "x", "seed": 2**64 + 3},
    lambda m: {"model": m, "prompt": "x", "stop_token_ids": [2**40]},
    lambda m: {"model": m, "prompt": "x", "top_k": -7},
    lambda m: {"model": m, "prompt": "x", "top_p": 0},
    lambda m: {"model": m, "prompt": "x", "temperature": 9},
    lambda m: {"model": m, "prompt": "x", "max_tokens": "many"},
    lambda m: {"model": m, "prompt": "x", "bogus_field": 1},
    lambda m: {"model": m, "prompt": [-4, 2]},
    lambda m: {"model": m, "prompt": "x", "stop": [""]},
    lambda m: {"model": "no-such-model", "prompt": "x"},
    lambda m: "{not json",
    lambda m: {"model": m, "prompt": "x", "user": "u" * (2 << 20)},  # over the body cap: 413
    lambda m: json.dumps({"model": m, "prompt": "\ud800"}),  # a lone surrogate (escaped in the JSON)
    lambda m: {"model": m, "prompt": "x", "n": 10**6},
    lambda m: {"model": m, "prompt": "x", "logprobs": 21},
    lambda m: {"model": m, "prompt": "x", "presence_penalty": 3},
    lambda m: {"model": m, "prompt": "x", "logit_bias": {"-1": 1}},
    lambda m: {"model": m, "prompt": "x", "suffix": "y"},
)


def _valid_body(model: str, rng: np.random.Generator, vocab: int) -> dict:
    body = {
        "model": model,
        "prompt": rng.integers(1, vocab, int(rng.integers(1, 64))).tolist(),
        "max_tokens": int(rng.integers(1, 64)),
        "stream": bool(rng.random() < 0.5),
        "temperature": float(rng.choice([0.0, rng.uniform(0.0, 2.0)])),
        "seed": int(rng.integers(0, 2**63 - 1)),
    }
    if rng.random() < 0.5:
        body["top_p"] = float(rng.uniform(0.05, 1.0))
    if rng.random() < 0.5:
        body["top_k"] = int(rng.integers(0, 50))
    if rng.random() < 0.3:
        body["stop"] = [bytes(rng.integers(97, 123, int(rng.integers(1, 3))).tolist()).decode()]
    if rng.random() < 0.3:
        body["stop_token_ids"] = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
    body["echo"] = bool(rng.random() < 0.1)
    body["ignore_eos"] = bool(rng.random() < 0.5)
    _add_features(body, rng, vocab)
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def _add_features(body: dict, rng: np.random.Generator, vocab: int) -> None:
    """The vLLM/OpenAI extras, each in a share of the requests: batches, n / best_of, logprobs,
    penalties, logit bias, min-p, min-tokens, kept stop strings."""
    if rng.random() < 0.15:
        body["prompt"] = [rng.integers(1, vocab, int(rng.integers(1, 48))).tolist() for _ in range(rng.integers(1, 4))]
    if rng.random() < 0.15:
        body["n"] = int(rng.integers(1, 4))
        if not body["stream"] and rng.random() < 0.5:
            body["best_of"] = body["n"] + int(rng.integers(0, 2))
    if rng.random() < 0.2:
        body["logprobs"] = int(rng.integers(0, 6))
    for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 0.5, 2)):
        if rng.random() < 0.15:
            body[name] = float(rng.uniform(lo, hi))
    if rng.random() < 0.1:
        body["logit_bias"] = {str(int(t)): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, 3)}
    if rng.random() < 0.1:
        body["min_p"] = float(rng.uniform(0, 0.5))
    if rng.random() < 0.1:
        body["min_tokens"] = int(rng.integers(0, body["max_tokens"] + 1))
    if "stop" in body and rng.random() < 0.5:
        body["include_stop_str_in_output"] = True


def _is_envelope(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return err.get("code") == r.status_code and bool(err.get("message")) and bool(err.get("type"))


async def _one(client: httpx.AsyncClient, url: str, kind: str, body, rng: np.random.Generator) -> str:
    """The outcome: "ok", "disconnected", "refused" (expected 4xx), or an error kind."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    try:
        if kind == "invalid":
            r = await client.post(url, content=content, headers=headers)
            return "refused" if 400 <= r.status_code < 500 and _is_envelope(r) else f"invalid_got_{r.status_code}"
        if kind == "disconnect" or body["stream"]:
            leave_after = int(rng.integers(1, 6)) if kind == "disconnect" else None
            async with client.stream("POST", url, content=content, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"http_{r.status_code}"
                n, done, finish = 0, False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "stream_error_event"
                    n += 1
                    finish = (chunk.get("choices") or [{}])[0].get("finish_reason") or finish
                    if leave_after is not None and n >= leave_after:
                        return "disconnected"  # leaving the block closes the connection mid-stream
            if leave_after is not None:
                return "disconnected"  # finished before we left
            return "ok" if done and finish in ("stop", "length") else "incomplete_stream"
        r = await client.post(url, content=content, headers=headers)
        if r.status_code != 200:
            return f"http_{r.status_code}"
        return "ok" if r.json()["choices"][0]["finish_reason"] in ("stop", "length") else "bad_finish_reason"
    except httpx.HTTPError as e:
        return f"transport_{type(e).__name__}"


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    return psutil.Process(pid).memory_info().rss / 2**20


async def run_soak(
    base_url: str,
    model: str,
    num_requests: int = 2000,
    concurrency: int = 32,
    vocab_size: int = 256,
    seed: int = 0,
    server_pid: int | None = None,
    progress=None,
) -> dict:
    """Run the soak and return its report (see the module docstring)."""
    rng = np.random.default_rng(seed)
    base = base_url.rstrip("/")
    url = base + "/v1/completions"
    kinds = rng.choice(["valid", "disconnect", "invalid"], num_requests, p=[0.75, 0.20, 0.05])
    sem = asyncio.Semaphore(concurrency)
    outcomes: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as client:
        before = await client.get(base + "/metrics")
        rss_before = _rss_mb(server_pid)

        async def go(kind: str, sub_seed: int) -> None:
            r = np.random.default_rng(sub_seed)
            if kind == "invalid":
                body = INVALID_BODIES[int(r.integers(len(INVALID_BODIES)))](model)
            else:
                body = _valid_body(model, r, vocab_size)
                if kind == "disconnect":
                    body.update(stream=True, max_tokens=400, ignore_eos=True)
                    body.pop("best_of", None)  # best_of > n cannot stream
            async with sem:
                outcome = await _one(client, url, kind, body, r)
            outcomes[(kind, outcome)] += 1
            if progress is not None:
                progress()

        t0 = time.perf_counter()
        seeds = rng.integers(0, 2**63 - 1, num_requests)
        await asyncio.gather(*(go(k, int(s)) for k, s in zip(kinds, seeds, strict=True)))
        duration = time.perf_counter() - t0
        settle_t0 = time.perf_counter()
        while True:  # give the engine a moment to reap the last disconnects
            after = (await client.get(base + "/metrics")).text
            busy = sample_sum(after, "laplace:num_requests_running") + sample_sum(after, "laplace:num_requests_waiting")
            if busy == 0 or time.perf_counter() - settle_t0 > 10:
                break
            await asyncio.sleep(0.1)
        health = (await client.get(base + "/health")).status_code
    rss_after = _rss_mb(server_pid)
    expected = {("valid", "ok"), ("disconnect", "disconnected"), ("invalid", "refused")}
    errors = collections.Counter({f"{k}:{o}": n for (k, o), n in outcomes.items() if (k, o) not in expected})
    return {
        "requests": num_requests,
        "concurrency": concurrency,
        "duration_s": duration,
        "outcomes": {f"{k}:{o}": n for (k, o), n in sorted(outcomes.items())},
        "errors_by_kind": dict(errors),
        "errors_total": sum(errors.values()),
        "leaked_slots": sample_sum(after, "laplace:num_requests_running"),
        "waiting_after": sample_sum(after, "laplace:num_requests_waiting"),
        "compiles_after_warmup": sample_sum(after, "laplace:compiles_total", phase="serving")
        - sample_sum(before.text, "laplace:compiles_total", phase="serving"),
        "engine_restarts": sample_sum(after, "laplace:engine_restarts_total"),
        "prefix_cache_bytes_after": sample_sum(after, "laplace:prefix_cache_bytes"),
        "prefix_cache_hits": sample_sum(after, "laplace:prefix_cache_hits_total"),
        "health_after": health,
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_after,
        "rss_growth_mb": None if rss_before is None else rss_after - rss_before,
    }
