"""Serving benchmarks on this machine: throughput and TPOT vs concurrency, decode against the
memory-bandwidth roofline per bucket, context-length flatness, compile share with buckets vs
exact widths, cold vs warm time to ready, the prefix-state cache on vs off.

    python -m benchmarks.bench_serve [--configs tiny small_100m] --out benchmarks/results/serve_cpu.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.bench_serve --configs tiny \\
        --devices 8 --sections concurrency roofline --out benchmarks/results/serve_cpu_8dev.json
    python -m benchmarks.bench_serve --sections prefix --out benchmarks/results/prefix_cache_cpu.json

Roofline: one compiled decode call per bucket W (``steps_per_call`` tokens for W slots on each of
D devices) must read every device's weights and read + write each slot's state once per token;
those bytes over the median call time, against the read bandwidth of a 1 GiB sum measured in
the same run (fake CPU devices share the host's memory, so the roofline is the host's). Weights
that fit in the CPU's caches (the tiny model) can beat it; the ~100M model cannot.

Models have random weights (throughput does not depend on them); requests use random token ids
with ignore_eos so every request produces exactly output_len tokens. Each server runs in this
process on a loopback port; the load comes from laplace_jax.serve.bench.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import numpy as np
import portpicker

from benchmarks.common import every_slot_live, write_result
from laplace_jax.checkpoint import save_model
from laplace_jax.config import load_run_config
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.models.gla_lm import init_params
from laplace_jax.serve import bench
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.launch import BackgroundServer
from laplace_jax.serve.metrics import ServeMetrics, sample_sum
from laplace_jax.serve.routes import Server

DEVICES = 1  # set from --devices


def start(cfg, params, **kw) -> BackgroundServer:
    serve = ServeConfig(**{"devices": DEVICES, "prefix_cache_bytes": 0, "max_model_len": 2048, **kw})
    engine = Engine(cfg, params, serve, eos_id=0, metrics=ServeMetrics())
    return BackgroundServer(Server(engine, ByteTokenizer(), "m"), portpicker.pick_unused_port())


def load(srv: BackgroundServer, **kw) -> dict:
    args = bench.parse(
        ["--base-url", srv.url, "--model", "m"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    )
    return asyncio.run(bench.run(args))


def metric_sum(srv: BackgroundServer, name: str, **labels: str) -> float:
    return sample_sum(httpx.get(srv.url + "/metrics").text, name, **labels)


def concurrency_sweep(cfg, params, levels, out_len) -> dict:
    per_device = -(-max(levels) // DEVICES)
    print(f"  {DEVICES} device(s) x {per_device} slots")
    srv = start(cfg, params, max_num_seqs=per_device, prefill_chunk=128, steps_per_call=8, max_model_len=4096)
    res = {}
    for c in levels:
        r = load(srv, num_prompts=max(8, 2 * c), input_len=128, output_len=out_len, max_concurrency=c)
        res[c] = {k: r[k] for k in ("output_throughput", "tpot_s", "ttft_s", "completed", "failed")}
        print(
            f"  concurrency {c:>3}: {r['output_throughput']:8.1f} out tok/s, TPOT p50 "
            f"{1e3 * r['tpot_s']['median']:.1f} ms p99 {1e3 * r['tpot_s']['p99']:.1f} ms"
        )
    srv.close()
    return res


def context_flatness(cfg, params, out_len) -> dict:
    srv = start(cfg, params, max_num_seqs=1, prefill_chunk=512, steps_per_call=8, max_model_len=8192 + out_len)
    res = {}
    for n in (128, 2048, 8192):
        r = load(srv, num_prompts=3, input_len=n, output_len=out_len, max_concurrency=1)
        res[n] = {
            "tpot_median_s": r["tpot_s"]["median"],
            "e2el_median_s": r["e2el_s"]["median"],
            "cost_per_output_token_s": r["e2el_s"]["median"] / out_len,
        }
        print(
            f"  prompt {n:>5}: TPOT p50 {1e3 * r['tpot_s']['median']:.2f} ms, cost/output token "
            f"{1e3 * res[n]['cost_per_output_token_s']:.2f} ms (incl. prefill)"
        )
    res["tpot_ratio_8192_vs_128"] = res[8192]["tpot_median_s"] / res[128]["tpot_median_s"]
    res["tpot_ratio_8192_vs_2048"] = res[8192]["tpot_median_s"] / res[2048]["tpot_median_s"]
    res["cost_ratio_8192_vs_2048"] = res[8192]["cost_per_output_token_s"] / res[2048]["cost_per_output_token_s"]
    srv.close()
    return res


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a jitted sum streams from memory (decode traffic is mostly weight reads)."""
    import jax.numpy as jnp

    from laplace_jax.platform import median_seconds

    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    return n_bytes / median_seconds(lambda: f(x), repeats)


def decode_roofline(cfg, params, widths, steps=8, repeats=10) -> dict:
    """Decode tok/s and the fraction of the bandwidth roofline per bucket W (see module doc)."""
    from laplace_jax.platform import median_seconds

    buckets = ",".join(map(str, widths))
    serve = ServeConfig(
        max_num_seqs=max(widths), decode_buckets=buckets, steps_per_call=steps, devices=DEVICES, prefix_cache_bytes=0
    )
    eng = Engine(cfg, params, serve, eos_id=0)
    eng.warmup()
    bw = read_bandwidth()
    weights = sum(x.nbytes for x in jax.tree.leaves(eng.programs.params))  # all replicas
    out = {"read_bandwidth_bytes_per_s": bw, "weights_bytes_all_devices": weights, "buckets": {}}
    print(f"  roofline: read bandwidth {bw / 1e9:.1f} GB/s; weights {weights / 1e6:.1f} MB over {DEVICES} device(s)")
    every_slot_live(eng)
    for W in widths:
        t = median_seconds(lambda W=W: eng.programs.decode(W)[0], repeats=repeats, warmup=2)
        moved = steps * (weights + 2 * eng.state_bytes * W * DEVICES)
        r = out["buckets"][W] = {
            "call_s": t,
            "tokens_per_s": steps * W * DEVICES / t,
            "min_bytes_per_call": moved,
            "fraction_of_bandwidth": moved / t / bw,
        }
        print(
            f"  W={W:>3} per device: {r['tokens_per_s']:9.0f} tok/s, {1e3 * t / steps:.2f} ms/token step, "
            f"{100 * r['fraction_of_bandwidth']:.1f}% of the bandwidth roofline"
        )
    return out


def decode_step_vs_context(cfg, params, width=4, repeats=30) -> dict:
    """Median time of one compiled decode call (steps_per_call tokens, ``width`` rows) after prompts
    of 128 vs 8,192 tokens: the state has the same size, so the time should not move."""
    import numpy as np

    from laplace_jax.platform import median_seconds
    from laplace_jax.serve.request import Request, SamplingParams

    out = {}
    for n in (128, 8192):
        serve = ServeConfig(
            max_num_seqs=width,
            decode_buckets=str(width),
            prefill_chunk=512,
            steps_per_call=8,
            max_model_len=n + 10_000,
            devices=1,
            prefix_cache_bytes=0,
        )
        eng = Engine(cfg, params, serve, eos_id=0)
        eng.warmup()
        for _ in range(width):
            ids = np.random.default_rng(n).integers(1, 256, n).tolist()
            eng.submit(Request(ids, SamplingParams(max_tokens=10_000, ignore_eos=True), lambda *_: None))
        while eng.step().admission is not None:  # prefill every prompt into the slots (host thread, no server)
            pass

        def call(eng=eng, width=width):
            return eng.programs.decode(width)[0]

        out[n] = median_seconds(call, repeats=repeats, warmup=3)
        print(f"  decode call after {n:>5}-token prompts: {1e3 * out[n]:.3f} ms (8 tokens x {width} rows)")
    out["ratio_8192_vs_128"] = out[8192] / out[128]
    return out


def compile_share(cfg, params, mode) -> dict:
    srv = start(
        cfg, params, max_num_seqs=16, decode_buckets=mode, prefill_chunk=64, steps_per_call=4, max_model_len=1024
    )
    r = load(srv, num_prompts=48, input_len=64, output_len=48, request_rate=12, burstiness=1)
    compile_s = metric_sum(srv, "laplace:compile_seconds_total", phase="serving")
    step_s = metric_sum(srv, "laplace:decode_step_seconds_sum")
    steps = metric_sum(srv, "laplace:decode_steps_total")
    compiles = metric_sum(srv, "laplace:compiles_total", phase="serving")
    srv.close()
    out = {
        "serving_compiles": compiles,
        "serving_compile_s": compile_s,
        "decode_s": step_s,
        "compile_share_of_decode_time": compile_s / step_s if step_s else 0.0,
        "decode_steps": steps,
        "tpot_p50_s": r["tpot_s"]["median"],
        "tpot_p99_s": r["tpot_s"]["p99"],
        "ttft_p99_s": r["ttft_s"]["p99"],
    }
    print(
        f"  buckets={mode}: {compiles:.0f} serving compiles, {100 * out['compile_share_of_decode_time']:.1f}% of "
        f"decode time compiling; TPOT p99 {1e3 * r['tpot_s']['p99']:.1f} ms"
    )
    return out


def time_to_ready(cfg, params) -> dict:
    root = tempfile.mkdtemp()
    save_model(os.path.join(root, "model"), cfg, params)
    cache = os.path.join(root, "cache")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = {}
    for label in ("cold", "warm"):
        port = portpicker.pick_unused_port()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [
                sys.executable,
                "serve.py",
                "--checkpoint",
                os.path.join(root, "model"),
                "--tokenizer",
                "byte",
                "--port",
                str(port),
                "--compile-cache-dir",
                cache,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        out[label] = time.perf_counter() - t0
        proc.terminate()
        proc.wait(60)
        print(f"  {label} start to ready: {out[label]:.1f} s")
    return out


def prefix_cache(cfg, params, repeats: int = 5) -> dict:
    """The prefix-state cache, on (1 GiB) and off, two servers side by side: a 2,048-id shared
    prefix + 32-id suffix one request at a time (TTFT of hits vs misses), 3-turn chats (ids
    prefilled per turn, from the engine's counter), and a no-sharing workload (output throughput,
    the two servers alternated ``repeats`` times)."""
    common = {"max_num_seqs": 8, "prefill_chunk": 128, "steps_per_call": 8, "max_model_len": 4096}
    servers = {"off": start(cfg, params, prefix_cache_bytes=0, **common)}
    servers["on"] = start(cfg, params, prefix_cache_bytes=1 << 30, **common)
    res: dict = {"off": {}, "on": {}}
    K = 2
    for label, srv in servers.items():
        r = load(
            srv,
            workload="shared-prefix",
            num_prompts=12,
            num_prefixes=K,
            prefix_len=2048,
            input_len=32,
            output_len=4,
            max_concurrency=1,
        )
        ttft = r["ttft_by_request_s"]
        res[label]["shared_prefix"] = {"ttft_first_k_s": ttft[:K], "ttft_rest_median_s": float(np.median(ttft[K:]))}
        chats = load(srv, workload="multi-turn", num_prompts=4, turns=3, input_len=64, output_len=32)
        res[label]["multi_turn"] = chats["turns"]
        print(
            f"  cache {label}: shared-prefix TTFT after the first {K}: {1e3 * np.median(ttft[K:]):.0f} ms; "
            f"prefilled per turn {[t['prefilled_tokens'] for t in chats['turns']]}"
        )
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for label, srv in servers.items():
            r = load(srv, num_prompts=32, input_len=128, output_len=64, max_concurrency=16)
            rates[label].append(r["output_throughput"])
    for label, srv in servers.items():
        res[label]["no_sharing_output_throughput"] = rates[label]
        res[label]["compiles_after_warmup"] = metric_sum(srv, "laplace:compiles_total", phase="serving")
        res[label]["prefix_cache"] = {
            k: metric_sum(srv, f"laplace:prefix_cache_{k}")
            for k in ("hits_total", "misses_total", "tokens_total", "evictions_total", "bytes")
        }
        srv.close()
    on, off = res["on"], res["off"]
    res["ttft_hit_over_miss"] = on["shared_prefix"]["ttft_rest_median_s"] / off["shared_prefix"]["ttft_rest_median_s"]
    res["throughput_on_over_off"] = float(np.median(rates["on"]) / np.median(rates["off"]))
    print(
        f"  TTFT hit / miss {res['ttft_hit_over_miss']:.3f}; no-sharing throughput on / off "
        f"{res['throughput_on_over_off']:.3f}"
    )
    return res


SECTIONS = ("concurrency", "roofline", "context", "compile", "ready", "prefix")


def main(argv: list[str] | None = None) -> None:
    global DEVICES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small_100m"])
    ap.add_argument("--devices", type=int, default=1, help="devices the engine spreads its slots over")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    DEVICES = a.devices
    res = {"device": jax.devices()[0].device_kind, "devices": DEVICES, "configs": {}}
    for name in a.configs:
        cfg = load_run_config(f"configs/{name}.py").model
        params = init_params(cfg, jax.random.key(0))
        print(f"{name}:")
        r = res["configs"][name] = {}
        tiny = name == "tiny"
        if "concurrency" in a.sections:
            levels = ([1, 4, 16, 32] if DEVICES == 1 else [1, 4, 8, 16, 32, 64]) if tiny else [1, 4, 16]
            r["concurrency"] = concurrency_sweep(cfg, params, levels, 64 if tiny else 32)
        if "roofline" in a.sections:
            r["roofline"] = decode_roofline(cfg, params, [1, 4, 16] if tiny else [1, 4])
        if tiny and "context" in a.sections:
            r["decode_step_vs_context"] = decode_step_vs_context(cfg, params)
            r["context"] = context_flatness(cfg, params, 128)
        if tiny and "compile" in a.sections:
            r["compile_share"] = {m: compile_share(cfg, params, m) for m in ("pow2", "exact")}
        if tiny and "ready" in a.sections:
            r["time_to_ready"] = time_to_ready(cfg, params)
        if "prefix" in a.sections:
            r["prefix_cache"] = prefix_cache(cfg, params)
    write_result(res, "bench_serve", argv, a.out)


if __name__ == "__main__":
    main()
