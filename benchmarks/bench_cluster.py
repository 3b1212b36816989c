"""One server against sglang-router over two replicas, on the same devices: throughput, TTFT,
prefix-cache hit rate and how unrelated requests spread; and /health under a burst of ~1 MiB
bodies with an API key.

    python -m benchmarks.bench_cluster --out benchmarks/results/cluster_cpu.json

The model is configs/tiny.py's architecture with random weights (the byte tokenizer). "One
server" is serve.py on 2 CPU devices with 4 slots each; "router + 2 replicas" is
``python -m laplace_jax.serve.cluster --replicas 2`` with 1 device and 4 slots each, so both have 8
slots on the same 2 cores. Load comes from ``python -m laplace_jax.serve.bench --text`` (text
prompts: the router's cache_aware policy matches prefixes of the request text) and, with
``--guidellm PATH`` (its executable, in an environment of its own: it brings its own torch), from
guidellm unmodified: 8 concurrent streams of synthetic chat requests, its token counts from the
byte tokenizer exported as a Hugging Face tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.common import write_result
from laplace_jax.serve.bench import parse as bench_args
from laplace_jax.serve.bench import run as bench_run
from laplace_jax.serve.metrics import sample_sum

PORT = 18400
WORKLOADS = {  # name: serve.bench arguments, and whether the requests arrive all at once (else at --request-rate)
    "prefix_heavy": (
        ["--workload", "shared-prefix", "--num-prefixes", "4", "--prefix-len", "1024", "--input-len", "64"],
        False,
    ),
    "prefix_free": (["--workload", "random", "--input-len", "512"], False),
    "prefix_free_burst": (["--workload", "random", "--input-len", "512"], True),
}
COUNTERS = {
    "hits": "laplace:prefix_cache_hits_total",
    "misses": "laplace:prefix_cache_misses_total",
    "restored": "laplace:prefix_cache_tokens_total",
    "finished": "laplace:request_success_total",
}


def make_model(path: str) -> None:
    import jax

    from laplace_jax import init_params
    from laplace_jax.checkpoint import save_model
    from laplace_jax.config import load_run_config

    cfg = load_run_config("configs/tiny.py").model
    save_model(path, cfg, init_params(cfg, jax.random.key(0)))


def env_with_devices(n: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    return env


def wait(url: str, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def counters(urls: list[str]) -> list[dict[str, float]]:
    out = []
    for u in urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        out.append({k: sample_sum(text, name) for k, name in COUNTERS.items()})
    return out


def measure(url: str, servers: list[str], workload: str, n: int, rate: float) -> dict:
    before = counters(servers)
    args = ["--base-url", url, "--model", "tiny", "--num-prompts", str(n), "--output-len", "32"]
    extra, burst = WORKLOADS[workload]
    args += ["--request-rate", "inf" if burst else str(rate), "--text", "--seed", "1", *extra]
    res = asyncio.run(bench_run(bench_args(args)))
    after = counters(servers)
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    hits, misses = sum(d["hits"] for d in delta), sum(d["misses"] for d in delta)
    return {
        "completed": res["completed"],
        "failed": res["failed"],
        "request_throughput": res["request_throughput"],
        "output_throughput": res["output_throughput"],
        "ttft_p50_s": res["ttft_s"]["median"],
        "ttft_p99_s": res["ttft_s"]["p99"],
        "prefix_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "finished_per_server": [d["finished"] for d in delta],
    }


GUIDELLM = {"streams": 8, "requests": 64, "prompt_tokens": 512, "output_tokens": 32}


def guidellm(exe: str, url: str, tmp: str, name: str) -> dict:
    """guidellm's own run against ``url`` (``GUIDELLM``): its request totals and latencies."""
    out = f"{tmp}/guidellm_{name}.json"
    g = GUIDELLM
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model=tiny"]
    cmd += ["--profile", f"kind=concurrent,streams={g['streams']}"]
    cmd += ["--constraint", f"kind=max_requests,count={g['requests']}"]
    cmd += ["--data", f"kind=synthetic_text,prompt_tokens={g['prompt_tokens']},output_tokens={g['output_tokens']}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={tmp}/hf_tokenizer", "--output", f"kind=json,path={out}"]
    cmd += ["--disable-console"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        report = json.load(f)
    m = report["benchmarks"][0]["metrics"]
    ttft = m["time_to_first_token_ms"]["successful"]
    return {
        "guidellm_version": report["metadata"]["guidellm_version"],
        **g,
        "requests_by_outcome": {k: m["request_totals"][k] for k in ("successful", "errored", "incomplete")},
        "request_throughput": m["requests_per_second"]["successful"]["mean"],
        "output_throughput": m["output_tokens_per_second"]["successful"]["mean"],
        "ttft_p50_s": ttft["percentiles"]["p50"] / 1e3,
        "ttft_p99_s": ttft["percentiles"]["p99"] / 1e3,
    }


def hf_tokenizer(path: str) -> None:
    """The byte tokenizer as a Hugging Face tokenizer directory (what guidellm loads)."""
    from laplace_jax.hf_files import END_TOKEN, byte_tokenizer_json

    os.makedirs(path, exist_ok=True)
    byte_tokenizer_json(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_TOKEN, "model_max_length": 2048}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def start(cmd: list[str], env: dict, log: str) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(120)


def run_setup(name: str, model: str, tmp: str, n: int, rate: float, guidellm_exe: str | None) -> dict:
    serve = ["--checkpoint", model, "--tokenizer", "byte", "--model-name", "tiny", "--max-num-seqs", "4"]
    serve += ["--max-model-len", "2048"]
    if name == "one_server":
        cmd = [sys.executable, "-m", "laplace_jax.serve.cli", *serve, "--devices", "2", "--port", str(PORT + 1)]
        proc, url, servers = start(cmd, env_with_devices(2), f"{tmp}/one.log"), f"http://127.0.0.1:{PORT + 1}", None
        wait(url + "/health")
        servers = [url]
    else:
        cmd = [sys.executable, "-m", "laplace_jax.serve.cluster", "--replicas", "2", "--port", str(PORT)]
        cmd += ["--log-dir", f"{tmp}/cluster", "--", *serve, "--devices", "1"]
        proc, url = start(cmd, env_with_devices(1), f"{tmp}/cluster.log"), f"http://127.0.0.1:{PORT}"
        wait(url + "/v1/models")
        servers = [f"http://127.0.0.1:{PORT + i}" for i in (1, 2)]
    try:
        res = {w: measure(url, servers, w, n, rate) for w in WORKLOADS}
        return {**res, "guidellm": guidellm(guidellm_exe, url, tmp, name)} if guidellm_exe else res
    finally:
        stop(proc)


BURST = """
import asyncio, httpx, sys, time
url, key = sys.argv[1], sys.argv[2]
async def big(c):
    body = '{"model":"tiny","prompt":"' + "a" * 1_000_000 + '","max_tokens":1}'
    h = {"content-type": "application/json", "authorization": "Bearer " + key}
    return (await c.post(url + "/v1/completions", content=body, headers=h, timeout=120)).status_code
async def health(c, out, stop):
    while not stop.is_set():
        t = time.perf_counter(); await c.get(url + "/health", timeout=60); out.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)
async def main():
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
        out, stop = [], asyncio.Event()
        h = asyncio.create_task(health(c, out, stop))
        codes = await asyncio.gather(*(big(c) for _ in range(24)))
        stop.set(); await h
        print(max(out), sorted(set(codes)))
asyncio.run(main())
"""


def health_under_burst(model: str, tmp: str, rounds: int = 3) -> dict:
    """The slowest /health answer while 24 concurrent ~1 MiB bodies with the API key arrive."""
    serve = ["--checkpoint", model, "--tokenizer", "byte", "--model-name", "tiny", "--api-key", "bench-key"]
    url = f"http://127.0.0.1:{PORT + 9}"
    cmd = [sys.executable, "-m", "laplace_jax.serve.cli", *serve, "--devices", "1", "--port", str(PORT + 9)]
    proc = start(cmd, env_with_devices(1), f"{tmp}/burst.log")
    try:
        wait(url + "/health")
        worst, codes = [], set()
        for _ in range(rounds):
            out = subprocess.run([sys.executable, "-c", BURST, url, "bench-key"], capture_output=True, text=True)
            seconds, status = out.stdout.split(maxsplit=1)
            worst.append(float(seconds))
            codes |= set(json.loads(status))
        return {"bursts": rounds, "bodies_per_burst": 24, "health_max_s": worst, "statuses": sorted(codes)}
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--guidellm", help="guidellm's executable: also run its benchmark against each setup")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench_cluster_")
    model = f"{tmp}/tiny"
    make_model(model)
    if a.guidellm:
        hf_tokenizer(f"{tmp}/hf_tokenizer")
    setups = ("one_server", "router")
    res = {"setups": {s: run_setup(s, model, tmp, a.num_prompts, a.request_rate, a.guidellm) for s in setups}}
    one, routed = res["setups"]["one_server"]["prefix_heavy"], res["setups"]["router"]["prefix_heavy"]
    res["prefix_hit_rate_router_over_one"] = routed["prefix_hit_rate"] / one["prefix_hit_rate"]
    res["health_under_burst"] = health_under_burst(model, tmp)
    write_result(res, "bench_cluster", argv, a.out)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
