"""Serve a GLA model with an OpenAI-compatible API (fixed per-sequence state, bucketed decode widths).

    python serve.py                                   # newest train.py run under runs/
    python serve.py --checkpoint runs/tiny --port 8000 --max-num-seqs 16
    python serve.py --checkpoint out/gla-1.3B --tokenizer llama/tokenizer.json
    python serve.py --devices 8 --max-num-seqs 20 --weights-dtype bfloat16   # 8 x 20 slots

A prefix-state cache (--prefix-cache-bytes) resumes a prompt from the state after its longest
cached prefix. Every executable (prefill chunk, insert, one decode loop per bucket width, row
move, state snapshot) is compiled
before /health reports ready; with --compile-cache-dir a restart compiles nothing.
"""

from __future__ import annotations

import argparse
import os
import sys


def byte_size(text: str) -> int:
    """ "1073741824", "512M", "1G" -> bytes (K, M, G: powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes like 1073741824, 512M or 1G; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text!r}")
    return value


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from laplace_jax.cli import HelpFormatter
    from laplace_jax.platform import PRNG_IMPLS  # importing jax reads no XLA flags; backends start later
    from laplace_jax.serve import settings

    ap = argparse.ArgumentParser(
        prog="python serve.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--checkpoint", default=None, help="train.py workdir or model directory (default: newest in runs/)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step of a workdir (default: the newest)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer spec for model directories ('byte' or tokenizer.json)")
    ap.add_argument("--model-name", default=None, help="model id clients send (default: directory name)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on")
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=settings.MAX_NUM_SEQS,
        help="decode slots per device (sequences decoded together)",
    )
    ap.add_argument(
        "--devices",
        type=int,
        default=None,
        help="local devices to spread the slots over, along a 'data' mesh axis with the weights replicated "
        "on each (default: all local devices)",
    )
    ap.add_argument(
        "--decode-buckets",
        default="pow2",
        help="'pow2' (1, 2, 4, ... and max-num-seqs), 'exact' (compile each width on demand), or '1,4,8'",
    )
    ap.add_argument(
        "--prefill-chunk", type=int, default=settings.PREFILL_CHUNK, help="tokens per prefill call (one executable)"
    )
    ap.add_argument(
        "--steps-per-call", type=int, default=settings.STEPS_PER_CALL, help="decode tokens per device dispatch"
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (default: model's)")
    ap.add_argument("--max-queue", type=int, default=settings.MAX_QUEUE, help="waiting requests before 429")
    ap.add_argument(
        "--prefix-cache-bytes",
        type=byte_size,
        default=settings.PREFIX_CACHE_BYTES,
        help="prefix-state cache budget per device (bytes; K/M/G suffixes are powers of 1024; 0 turns it off): "
        "states after shared prompt blocks and after finished requests, so a shared prefix or a chat's next "
        "turn prefills only what is new. One entry is one sequence's state (29.5 MB for the 3B model)",
    )
    ap.add_argument(
        "--prefix-block",
        type=int,
        default=None,
        help="prefix-cache block in tokens (default and unit: lcm of the model's chunk_size and --prefill-chunk)",
    )
    ap.add_argument(
        "--exact",
        action="store_true",
        help="reproducibility over speed: float32 compute, no excess precision, deterministic XLA ops",
    )
    ap.add_argument(
        "--weights-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype the weights are cast to once at load (default: the model's compute dtype; --exact: float32)",
    )
    ap.add_argument(
        "--prng-impl",
        default="auto",
        choices=PRNG_IMPLS,
        help="sampling keys: auto = rbg on Neuron (its threefry support is incomplete), threefry2x32 elsewhere",
    )
    ap.add_argument(
        "--profile-dir",
        default=None,
        help="enable POST /start_profile and /stop_profile: a jax.profiler trace written here "
        "(view: tensorboard --logdir DIR, profile tab)",
    )
    ap.add_argument("--compile-cache-dir", default=None, help="persistent compile cache (JAX; Neuron's on Neuron)")
    ap.add_argument("--temperature", type=float, default=1.0, help="default sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="default top-p")
    ap.add_argument("--max-tokens", type=int, default=16, help="default max_tokens")
    ap.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(default: $LAPLACE_API_KEY; unset = no auth)",
    )
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    ap.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=settings.DRAIN_TIMEOUT_S,
        help="SIGTERM bound in seconds: new requests are refused at once, running ones finish or end with "
        "finish_reason 'length' before this, then the process exits",
    )
    ap.add_argument(
        "--max-body-bytes", type=int, default=settings.MAX_BODY_BYTES, help="request body cap (413 above it)"
    )
    ap.add_argument(
        "--body-timeout", type=float, default=settings.BODY_TIMEOUT_S, help="seconds for a request body to arrive (408)"
    )
    ap.add_argument(
        "--header-timeout",
        type=float,
        default=settings.HEADER_TIMEOUT_S,
        help="seconds for a connection to send a request head",
    )
    ap.add_argument(
        "--keep-alive",
        type=float,
        default=settings.KEEP_ALIVE_S,
        help="seconds an idle kept-alive connection stays open",
    )
    ap.add_argument(
        "--max-connections",
        type=int,
        default=settings.MAX_CONNECTIONS,
        help="open connections; more are closed as they arrive",
    )
    a = ap.parse_args(argv)
    a.api_key = a.api_key or os.environ.get("LAPLACE_API_KEY") or None
    limits = ("drain_timeout", "max_body_bytes", "body_timeout", "header_timeout", "keep_alive", "max_connections")
    for name in limits:
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive; got {getattr(a, name)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # Imported here, not at the top: --exact's XLA flags must be set before JAX starts.
    if a.exact:
        from laplace_jax.platform import set_exact

        set_exact()
    if a.compile_cache_dir:
        from laplace_jax.platform import set_compile_cache

        set_compile_cache(a.compile_cache_dir)
    import jax

    from laplace_jax.errors import UserError
    from laplace_jax.loading import cast_params, load_for_inference, newest_workdir
    from laplace_jax.serve.engine import Engine
    from laplace_jax.serve.launch import make_uvicorn
    from laplace_jax.serve.metrics import ServeMetrics
    from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES
    from laplace_jax.serve.request import SamplingParams
    from laplace_jax.serve.routes import Server

    try:
        path = a.checkpoint or newest_workdir()
        cfg, params, tok, name = load_for_inference(path, a.tokenizer, exact=a.exact, step=a.step)
        weights_dtype = "float32" if a.exact else (a.weights_dtype or cfg.dtype)
        params = cast_params(params, weights_dtype)
        buckets = a.decode_buckets if a.decode_buckets in ("pow2", "exact") else a.decode_buckets.split(",")
        local = jax.local_devices()
        if a.devices is not None and not 1 <= a.devices <= len(local):
            raise UserError(f"--devices must lie in 1..{len(local)} (the local {local[0].platform} devices)")
        engine = Engine(
            cfg,
            params,
            eos_id=tok.eos_id,
            max_num_seqs=a.max_num_seqs,
            buckets=buckets,
            prefill_chunk=a.prefill_chunk,
            steps_per_call=a.steps_per_call,
            max_model_len=a.max_model_len or cfg.max_seq_len,
            max_queue=a.max_queue,
            metrics=ServeMetrics(),
            devices=local[: a.devices or len(local)],
            prng=a.prng_impl,
            prefix_cache_bytes=a.prefix_cache_bytes,
            prefix_block=a.prefix_block,
        )
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = Server(
        engine,
        tok,
        a.model_name or name,
        SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p),
        api_key=a.api_key,
        protect_metrics=a.protect_metrics,
        max_body_bytes=a.max_body_bytes,
        body_timeout=a.body_timeout,
        drain_timeout=a.drain_timeout,
        profile_dir=a.profile_dir,
        log=lambda line: print(f"{line} (http://{a.host}:{a.port})", flush=True),
    )
    print(
        f"serving {path} as {server.model_name!r} on http://{a.host}:{a.port} ({cfg.dtype} compute, "
        f"{weights_dtype} weights{', exact' if a.exact else ''})"
    )
    print(
        f"  {engine.n_devices} device(s) x {engine.slots_per_device} slots; "
        f"state per sequence {engine.state_bytes:,} B, "
        f"{engine.state_bytes * engine.slots_per_device:,} B reserved per device"
    )
    buckets = engine.buckets or "exact (compiled on demand)"
    print(f"  decode buckets (per device) {buckets}; prefill chunk {engine.prefill_chunk}")
    if engine.prefix is not None:
        print(
            f"  prefix cache: {a.prefix_cache_bytes:,} B per device = {engine.prefix.capacity:,} states "
            f"of {engine.state_bytes:,} B (+ {ENTRY_OVERHEAD_BYTES:,} B host bookkeeping each); "
            f"block {engine.prefix.block} tokens (--prefix-cache-bytes 0 turns it off)"
        )
    else:
        print("  prefix cache: off" + (" (budget below one state)" if a.prefix_cache_bytes else ""))
    guarded = "/v1/* and /metrics" if a.protect_metrics else "/v1/*"
    print(f"  auth: {f'API key required on {guarded}' if a.api_key else 'off (no --api-key)'}")
    if a.profile_dir:
        print(f"  profiling: POST /start_profile and /stop_profile write traces to {a.profile_dir}")
    limits = {"header_timeout": a.header_timeout, "keep_alive": a.keep_alive, "max_connections": a.max_connections}
    make_uvicorn(server, a.host, a.port, log_level="info" if a.access_log else "warning", **limits).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
