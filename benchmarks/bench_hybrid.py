"""Recall of a hybrid model against its pure-GLA controls: the MQAR grid of train.py runs
(``configs/recall_tiny.py:hybrid`` and ``:control``, the control also with 3x the steps), with
what each run was, in one JSON.

    python -m benchmarks.bench_hybrid --runs hybrid=runs/recall_hybrid control=runs/recall_control \\
        control_3x=runs/recall_control_3x --out benchmarks/results/hybrid_recall.json --plots docs/images

Per run: parameters, per-sequence state bytes, the attention spec, the training recipe (steps,
windows, tokens) and final eval loss, and the accuracy of every (context length, pairs) cell,
scored by ``laplace_jax.eval recall`` through the serving engine; its heat maps and curves are
copied to ``--plots`` as hybrid_recall*.png. The window splits the grid: a context no longer
than the window is wholly visible to the attention layer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from benchmarks.common import write_result
from laplace_jax.checkpoint import load_trained
from laplace_jax.eval.__main__ import main as eval_main
from laplace_jax.info import state_bytes
from laplace_jax.models.gla_lm import count_params

LENGTHS = (128, 192, 256, 384, 512, 1024, 2048)
LEVELS = (1, 2, 4, 8, 16, 24, 32, 48)


def describe(workdir: str) -> dict:
    run_cfg, cfg, params = load_trained(workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    data, train = run_cfg["data"], run_cfg["train"]
    return {
        "params": count_params(params),
        "state_bytes": sum(state_bytes(cfg).values()),
        "attn": [spec.to_fla() for spec in cfg.attn or ()],
        "steps": train["steps"],
        "seq_len": data["seq_len"],
        "global_batch": data["global_batch"],
        "pairs": [data["mqar"]["min_pairs"], data["mqar"]["max_pairs"]],
        "eval_loss": evals[-1]["eval_loss"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs", nargs="+", required=True, metavar="NAME=WORKDIR",
        help="train.py workdirs by name: hybrid=..., control=... (same recipe), then any others",
    )  # fmt: skip
    ap.add_argument("--samples", type=int, default=16, help="samples per cell")
    ap.add_argument("--out", default=None, help="JSON to write")
    ap.add_argument("--plots", default=None, help="directory for the heat maps and curves")
    a = ap.parse_args(argv)
    runs = dict(r.split("=", 1) for r in a.runs)
    if list(runs)[:2] != ["hybrid", "control"]:
        ap.error("--runs starts with hybrid=WORKDIR control=WORKDIR")
    res: dict = {"lengths": list(LENGTHS), "levels": list(LEVELS), "samples": a.samples, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        links = []
        for name, run in runs.items():  # the eval names each result after its directory
            links.append(os.path.join(tmp, name))
            os.symlink(os.path.abspath(run), links[-1])
        out = os.path.join(tmp, "eval")
        os.makedirs(out)
        eval_args = ["recall", "--checkpoint", *links, "--suite", "mqar", "--out", out, "--samples", str(a.samples)]
        eval_main([*eval_args, "--lengths", *map(str, LENGTHS), "--levels", *map(str, LEVELS)])
        for name, run in runs.items():
            with open(os.path.join(out, f"recall_mqar_{name}.json")) as f:
                grid = json.load(f)
            res["runs"][name] = {**describe(run), "grid": list(grid.values())}
        if a.plots:
            for src, dst in (
                ("recall_mqar.png", "hybrid_recall_heatmap.png"),
                ("recall_mqar_curves.png", "hybrid_recall_curves.png"),
            ):
                shutil.copy(os.path.join(out, src), os.path.join(a.plots, dst))
    window = res["runs"]["hybrid"]["attn"][0]["window_size"]
    res["window"] = window
    acc = {name: {(c["length"], c["level"]): c["accuracy"] for c in r["grid"]} for name, r in res["runs"].items()}
    inside = [cell for cell in acc["hybrid"] if cell[0] <= window and cell[1] >= 16]
    res["inside_window_16_plus"] = [
        {"length": n, "level": p, **{name: a[(n, p)] for name, a in acc.items()}} for n, p in inside
    ]
    write_result(res, "bench_hybrid", argv, a.out)
    print(json.dumps(res["inside_window_16_plus"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
