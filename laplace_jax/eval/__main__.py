"""Evaluate checkpoints (train.py workdirs, or model directories with --tokenizer).

    python -m laplace_jax.eval recall --checkpoint runs/tiny --suite passkey --lengths 256 1024 --levels 0 0.5 1
    python -m laplace_jax.eval recall --checkpoint runs/recall_1x runs/recall_4x --suite mqar \\
        --lengths 256 1024 4096 --levels 4 16 64
    python -m laplace_jax.eval numerics --checkpoint runs/tiny [--exact]
    python -m laplace_jax.eval perplexity --checkpoint runs/tiny --data data/mine --split val

recall writes accuracy per (context length, level) to OUT/recall_<suite>_<name>.json, a heat map
per checkpoint to OUT/recall_<suite>.png and accuracy curves to OUT/recall_<suite>_curves.png.
Levels are N pairs for mqar and the needle's depth (0 = start, 1 = end) for passkey.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from laplace_jax.errors import DataError, UserError
from laplace_jax.tasks.recall import max_pairs, suite

# Modules that touch JAX are imported inside the commands: ``--exact`` must set XLA's flags
# (``platform.set_exact``) before JAX starts.


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "(default:" in text:
            return text
        return super()._get_help_string(action)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m laplace_jax.eval",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    helps = {
        "recall": "MQAR / passkey accuracy per (context length, level)",
        "numerics": "logit differences: jit vs eager, fp32 vs bf16, chunk vs recurrent, greedy decode",
        "perplexity": "loss, perplexity and tokens/s on a prepared dataset's split",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, formatter_class=_Defaults)
        p.add_argument(
            "--checkpoint", required=True, nargs="+" if name == "recall" else None, help="workdir or model dir"
        )
        p.add_argument("--tokenizer", default=None, help="tokenizer spec for model directories")
        p.add_argument("--step", type=int, default=None, help="checkpoint step of a workdir (default: newest)")
        p.add_argument("--out", default="eval_out", help="output directory")
        p.add_argument("--exact", action="store_true", help="float32 compute and XLA flags for reproducibility")
        if name == "recall":
            p.add_argument("--suite", choices=["mqar", "passkey"], default="mqar")
            p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024], help="context lengths (tokens)")
            p.add_argument(
                "--levels",
                type=float,
                nargs="+",
                default=None,
                help="N pairs (mqar: 4 16 64) or depths (passkey: 0 0.5 1)",
            )
            p.add_argument("--samples", type=int, default=16, help="samples per cell")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument(
                "--compare",
                nargs="+",
                default=[],
                metavar="JSON",
                help="results of earlier recall runs (their recall_<suite>_<name>.json) to plot beside these",
            )
        if name == "numerics":
            p.add_argument("--length", type=int, default=256, help="tokens per row (2 random rows)")
        if name == "perplexity":
            p.add_argument("--data", required=True, help="directory written by laplace_jax.data.prepare")
            p.add_argument("--split", default="val")
            p.add_argument("--batches", type=int, default=16, help="batches of 4 windows")
    a = ap.parse_args(argv)
    if a.cmd == "recall" and a.levels is None:
        a.levels = [4.0, 16.0, 64.0] if a.suite == "mqar" else [0.0, 0.5, 1.0]
    return a


def check_recall_args(a: argparse.Namespace, cfg) -> None:
    """Reject grids the model or the task cannot take, before any compile."""

    if min(a.lengths) < 16 or max(a.lengths) > cfg.max_seq_len:
        raise UserError(
            f"context lengths must lie in [16, {cfg.max_seq_len}] (the model's max_seq_len); got {a.lengths}. "
            "GLA has no positional limit: to probe further, raise model.max_seq_len in the checkpoint's config"
        )
    if a.suite == "mqar":
        bad = [x for x in a.levels if x < 1 or x != int(x) or x > max_pairs()]
        if bad:
            raise UserError(f"mqar levels are whole numbers of pairs in [1, {max_pairs()}]; got {bad}")
    elif any(not 0 <= x <= 1 for x in a.levels):
        raise UserError(f"passkey levels are depths in [0, 1]; got {a.levels}")
    if a.samples < 1:
        raise UserError("--samples must be at least 1")


def earlier_results(path: str) -> dict:
    """A results file an earlier ``recall`` wrote ({"length|level": {length, level, accuracy, n}})."""
    try:
        with open(path) as f:
            res = json.load(f)
        if not all({"length", "level", "accuracy", "n"} <= set(r) for r in res.values()):
            raise ValueError("a cell lacks length, level, accuracy or n")
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise UserError(f"--compare {path}: not a results file of this command ({e})") from None
    return res


def recall(a: argparse.Namespace, loaded: list) -> None:

    from laplace_jax.eval.recall import curves, heatmaps, model_answers, score
    from laplace_jax.serve.config import ServeConfig
    from laplace_jax.serve.engine import Engine

    results = {}
    for path in a.compare:
        name = os.path.splitext(os.path.basename(path))[0].removeprefix(f"recall_{a.suite}_")
        results[name] = earlier_results(path)
    for cfg, params, tok, name in loaded:
        check_recall_args(a, cfg)
        samples = suite(a.suite, a.seed, a.lengths, a.levels, a.samples, lambda s, tok=tok: len(tok.encode(s)))
        if not samples:
            raise UserError("no sample fits: every (length, N) cell needs more tokens than its length")

        def factory(cfg=cfg, params=params, tok=tok, samples=samples) -> Engine:
            serve = ServeConfig(
                prefill_chunk=256,
                max_queue=len(samples),  # offline: every prompt is queued up front
                prefix_cache_bytes=0,  # every prompt is different
            )
            return Engine(cfg, params, serve, eos_id=tok.eos_id)

        with tqdm(total=len(samples), desc=f"{name} {a.suite}", unit="prompt") as bar:
            res = score(samples, model_answers(factory, tok, on_done=lambda: bar.update(1)))
        results[name] = res
        with open(os.path.join(a.out, f"recall_{a.suite}_{name}.json"), "w") as f:
            json.dump(res, f, indent=2)
        for r in res.values():
            print(
                f"{name}  length {r['length']:>6}  level {r['level']:>6g}  accuracy {r['accuracy']:.2f}  (n={r['n']})"
            )
    heatmaps(results, os.path.join(a.out, f"recall_{a.suite}.png"), a.suite)
    curves(results, os.path.join(a.out, f"recall_{a.suite}_curves.png"), a.suite)
    print(f"wrote {a.out}/recall_{a.suite}*.json and .png")


def numerics(a: argparse.Namespace, cfg, params) -> None:
    from laplace_jax.eval.numerics import report

    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, a.length)).astype(np.int32)
    rep = {"exact": a.exact, **report(cfg, params, tokens)}
    print(json.dumps(rep, indent=2))
    with open(os.path.join(a.out, f"numerics{'_exact' if a.exact else ''}.json"), "w") as f:
        json.dump(rep, f, indent=2)


def perplexity(a: argparse.Namespace, cfg, params) -> None:
    import jax

    from laplace_jax.data.pipeline import eval_batches, store_windows
    from laplace_jax.train.step import eval_step

    try:
        batches = eval_batches(store_windows(a.data, a.split, min(cfg.max_seq_len, 1024)), 4, a.batches)
    except DataError as e:
        raise UserError(str(e)) from e
    fn = jax.jit(eval_step, static_argnums=0)
    fn(cfg, params, batches[0]).block_until_ready()
    t0 = time.perf_counter()
    losses = [float(fn(cfg, params, b)) for b in batches]
    dt = time.perf_counter() - t0
    tokens = sum(b[:, 1:].size for b in batches)
    loss = float(np.mean(losses))
    print(f"loss {loss:.4f} nats/token, perplexity {np.exp(loss):.2f}, {tokens:,} tokens, {tokens / dt:,.0f} tokens/s")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    # Imported here, not at the top: --exact's XLA flags must be set before JAX starts.
    if a.exact:
        from laplace_jax.platform import set_exact

        set_exact()
    from laplace_jax.loading import load_for_inference

    try:
        paths = a.checkpoint if isinstance(a.checkpoint, list) else [a.checkpoint]
        loaded = []
        for path in paths:
            cfg, params, tok, name = load_for_inference(path, a.tokenizer, exact=a.exact, step=a.step)
            loaded.append((cfg, params, tok, name))
        if len({x[3] for x in loaded}) < len(loaded):
            raise UserError("checkpoints must have different directory names (they name the outputs)")
        os.makedirs(a.out, exist_ok=True)
        if a.cmd == "recall":
            recall(a, loaded)
        elif a.cmd == "numerics":
            numerics(a, *loaded[0][:2])
        else:
            perplexity(a, *loaded[0][:2])
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
