"""Evaluate a checkpoint (a train.py workdir, or a model directory with --tokenizer).

    python -m laplace_jax.eval recall --checkpoint runs/tiny --suite passkey --lengths 256 1024 --levels 0 0.5 1
    python -m laplace_jax.eval recall --checkpoint runs/tiny --suite mqar --lengths 256 1024 4096 --levels 4 16 64
    python -m laplace_jax.eval numerics --checkpoint runs/tiny
    python -m laplace_jax.eval perplexity --checkpoint runs/tiny --data data/mine --split val

Recall writes accuracy per (length, level) as JSON and a heat map PNG under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.eval", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("recall", "numerics", "perplexity"):
        p = sub.add_parser(name)
        p.add_argument("--checkpoint", required=True)
        p.add_argument("--tokenizer", default=None)
        p.add_argument("--out", default="eval_out")
        if name == "recall":
            p.add_argument("--suite", choices=["mqar", "passkey"], default="passkey")
            p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
            p.add_argument("--levels", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="N pairs or depths")
            p.add_argument("--samples", type=int, default=8)
            p.add_argument("--seed", type=int, default=0)
        if name == "perplexity":
            p.add_argument("--data", required=True)
            p.add_argument("--split", default="val")
            p.add_argument("--batches", type=int, default=16)
    a = ap.parse_args(argv)

    from laplace_jax.cli import UserError
    from laplace_jax.serve.loading import load_for_serving

    try:
        cfg, params, tok, name = load_for_serving(a.checkpoint, a.tokenizer)
        os.makedirs(a.out, exist_ok=True)
        if a.cmd == "recall":
            if max(a.lengths) > cfg.max_seq_len * 4:
                raise UserError(
                    f"context length {max(a.lengths)} is beyond 4x the model's max_seq_len {cfg.max_seq_len}"
                )
            from laplace_jax.eval.recall import heatmap, model_answers, score, suite
            from laplace_jax.serve.engine import Engine

            samples = suite(a.suite, a.seed, a.lengths, a.levels, a.samples, lambda s: len(tok.encode(s)))
            if not samples:
                raise UserError("no sample fits: every (length, N) cell needs more tokens than its length")

            def factory() -> Engine:
                return Engine(
                    cfg, params, eos_id=tok.eos_id, max_num_seqs=8, prefill_chunk=256, max_model_len=max(a.lengths) + 64
                )

            res = score(samples, model_answers(factory, tok))
            with open(os.path.join(a.out, f"recall_{a.suite}.json"), "w") as f:
                json.dump(res, f, indent=2)
            heatmap(res, os.path.join(a.out, f"recall_{a.suite}.png"), f"{name}: {a.suite} recall")
            for r in res.values():
                print(f"length {r['length']:>6}  level {r['level']:>6g}  accuracy {r['accuracy']:.2f}  (n={r['n']})")
        elif a.cmd == "numerics":
            from laplace_jax.eval.numerics import report

            tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 256)).astype(np.int32)
            rep = report(cfg, params, tokens)
            print(json.dumps(rep, indent=2))
            with open(os.path.join(a.out, "numerics.json"), "w") as f:
                json.dump(rep, f, indent=2)
        else:
            import jax

            from laplace_jax.data.pipeline import eval_batches, store_windows
            from laplace_jax.data.store import DataError
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
            print(f"loss {loss:.4f} nats/token, perplexity {np.exp(loss):.2f}, {tokens / dt:,.0f} tokens/s")
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
