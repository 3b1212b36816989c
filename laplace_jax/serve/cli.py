"""``python serve.py``: flags (generated from ``ServeConfig``), load the model, print what is
served, run uvicorn until a signal, say how the shutdown went."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys

from laplace_jax.serve.config import ServeConfig, SettingError, add_flags, flag, from_flags

EXAMPLES = """examples:
  python serve.py                                   # newest train.py run under runs/
  python serve.py --checkpoint runs/tiny --port 8000 --max-num-seqs 16
  python serve.py --checkpoint out/gla-1.3B --tokenizer llama/tokenizer.json
  python serve.py --devices 8 --max-num-seqs 20 --weights-dtype bfloat16   # 8 x 20 slots
"""


def parser() -> argparse.ArgumentParser:
    """serve.py's flags: one per ``ServeConfig`` field."""
    from laplace_jax.cli import HelpFormatter

    class Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    ap = argparse.ArgumentParser(
        prog="python serve.py",
        description="Serve a GLA model with an OpenAI-compatible API (fixed per-sequence state, bucketed decode\n"
        "widths). Every executable is compiled before /health reports ready; with --compile-cache-dir\n"
        "a restart compiles nothing.",
        epilog=EXAMPLES,
        formatter_class=Formatter,
    )
    add_flags(ap)
    return ap


def parse(argv: list[str] | None = None) -> ServeConfig:
    """The ``ServeConfig`` of serve.py's command line; a bad value exits with the flag's name."""
    ap = parser()
    try:
        return from_flags(ap.parse_args(argv))
    except SettingError as e:
        ap.error(f"{flag(e.name)}: {str(e).removeprefix(e.name + ' ')}")


def _load(cfg: ServeConfig):
    """(path, model config, params, tokenizer, name, weights dtype); raises ``UserError``."""
    from laplace_jax.loading import cast_params, load_for_inference, newest_workdir

    path = cfg.checkpoint or newest_workdir()
    model, params, tok, name = load_for_inference(path, cfg.tokenizer, exact=cfg.exact, step=cfg.step)
    if cfg.attn_impl is not None:
        model = dataclasses.replace(model, attn_impl=cfg.attn_impl)
    weights_dtype = "float32" if cfg.exact else (cfg.weights_dtype or model.dtype)
    return path, model, cast_params(params, weights_dtype), tok, name, weights_dtype


def weights_id(path: str, step: int | None) -> str:
    """What identifies the served weights' bytes: the digest of their checkpoint's checksums.json
    (written when it was saved), else the resolved path and step."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        steps = [int(d) for d in os.listdir(os.path.join(path, "checkpoints")) if d.isdigit()]
        step = step if step is not None else max(steps, default=0)
        record = os.path.join(path, "checkpoints", str(step), "checksums.json")
    else:
        record = os.path.join(path, "params", "checksums.json")
    if os.path.isfile(record):
        with open(record, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return f"{os.path.realpath(path)}:{step}"


def _banner(cfg: ServeConfig, path: str, engine, server, weights_dtype: str) -> None:
    import jax

    from laplace_jax.ops.gla import kernel_for
    from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES

    url = f"http://{cfg.host}:{cfg.port}"
    exact = ", exact" if cfg.exact else ""
    print(
        f"serving {path} as {server.model_name!r} on {url} ({engine.cfg.dtype} compute, {weights_dtype} weights{exact})"
    )
    print(
        f"  {engine.n_devices} device(s) x {engine.slots_per_device} slots; state per sequence "
        f"{engine.state_bytes:,} B, {engine.state_bytes * engine.slots_per_device:,} B reserved per device"
    )
    kernel, why = kernel_for(engine.cfg.attn_impl, jax.default_backend(), engine.cfg.chunk_size)
    print(f"  GLA kernel over prompts: {kernel} ({why}); every kernel compiled is listed when ready")
    buckets = engine.buckets or "exact (compiled on demand)"
    print(f"  decode buckets (per device) {buckets}; prefill chunk {engine.prefill_chunk}")
    if engine.prefix is not None:
        print(
            f"  prefix cache: {cfg.prefix_cache_bytes:,} B per device = {engine.prefix.capacity:,} states "
            f"of {engine.state_bytes:,} B (+ {ENTRY_OVERHEAD_BYTES:,} B host bookkeeping each); "
            f"block {engine.prefix.block} tokens (--prefix-cache-bytes 0 turns it off)"
        )
    else:
        print("  prefix cache: off" + (" (budget below one state)" if cfg.prefix_cache_bytes else ""))
    guarded = "/v1/* and /metrics" if cfg.protect_metrics else "/v1/*"
    print(f"  auth: {f'API key required on {guarded}' if cfg.api_key else 'off (no --api-key)'}")
    if cfg.profile_dir:
        print(f"  profiling: POST /start_profile and /stop_profile write traces to {cfg.profile_dir}")
    print(f"  access log: {'on' if cfg.access_log else 'off (--access-log turns it on)'}")
    print(f"  compiling {len(engine.programs.programs(engine.buckets or []))} programs; /health answers 503 until then")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    # Imported here, not at the top: --exact's XLA flags must be set before JAX starts.
    if cfg.exact:
        from laplace_jax.platform import set_exact

        set_exact()
    if cfg.compile_cache_dir:
        from laplace_jax.platform import set_compile_cache

        set_compile_cache(cfg.compile_cache_dir)
    from laplace_jax.errors import UserError
    from laplace_jax.serve.engine import Engine
    from laplace_jax.serve.launch import make_uvicorn
    from laplace_jax.serve.metrics import ServeMetrics
    from laplace_jax.serve.routes import Server

    try:
        path, model, params, tok, name, weights_dtype = _load(cfg)
        engine = Engine(model, params, cfg, eos_id=tok.eos_id, metrics=ServeMetrics())
        del params  # the engine placed its own copy (per layer on a megacore TPU): free the loaded one
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    url = f"http://{cfg.host}:{cfg.port}"
    log = lambda line: print(f"{line} ({url})", flush=True)  # noqa: E731
    server = Server(engine, tok, cfg.model_name or name, log=log, weights_id=weights_id(path, cfg.step))
    _banner(cfg, path, engine, server, weights_dtype)
    make_uvicorn(server, cfg.host, cfg.port, log_level="info" if cfg.access_log else "warning").run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
