"""The TPU compiler's view of the programs users run, as JSON (no TPU: ``laplace_jax.tpu``).

    python -m benchmarks.bench_tpu --out benchmarks/results/tpu_programs.json
    python -m benchmarks.bench_tpu --only kernel,decode --out /tmp/quick.json

Rows (each compiled by the real TPU compiler for a deviceless topology; every time is the
compiler's estimate, not a measurement):
- kernel:   both TPU GLA kernels, ``chunk_gla`` (XLA) and ``mosaic_gla`` (Pallas TPU), at the 3B
            layer (B4 T4096 H16 K96 V192, bf16, chunk 128) on v5e and v5p, forward and forward +
            backward, against the memory and FLOP limits (Mosaic kernels: ``tpu.MOSAIC_LABEL``);
- decode:   3B ``decode_step`` at W=256 on one v5p chip, bf16 weights as plain arrays and packed,
            and serving's decode program at W=256 (4 tokens per call; the row adds per-token time);
            then the plain-weights and serving rows again with ``model.attn_impl=mosaic`` (the Mosaic
            GLA and short-conv step kernels);
- prefill:  3B ``prefill`` of one prompt of 128, 512 and 2048 tokens on one v5p chip: tokens/s
            against the FLOP limit;
- train:    ``configs/gla_340m.py`` at 16 x 2048 tokens, bf16, on v5e:2x2, and ``configs/3b.py``
            (Muon, FSDP over 16 chips) on v5p:2x2x4, each with the default kernel (``auto``: the
            Pallas TPU kernels on TPU) and with ``model.attn_impl=mosaic``: step time, tokens/s,
            MFU, memory per chip;
- calibration (``--only calibration``): an 8192^3 bf16 matmul and a 1 GiB-in, 1 GiB-out fp32
            elementwise op on v5e and v5p, as shares of the chip's published peak and bandwidth,
            and the same matmul as a Pallas TPU kernel, timed as Mosaic kernels are;
- remat (``--only remat``): the 3B train step on v5p:2x2x4 with the Mosaic kernel under each
            ``model.remat`` policy that fits (``none`` does not).
Each row keeps the report's headline figures and its top sources; ``--full`` keeps every field.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.common import write_result

ROWS = ("kernel", "decode", "prefill", "train")
PREFILL_LENGTHS = (128, 512, 2048)
SERVE_STEPS = 4  # serving's default tokens per decode call
EXTRA = ("calibration", "remat")  # not in the default set: their own JSONs (tpu_calibration.json, tpu_remat.json)
REMAT = ("full", "save_gla", "save_dots")
_340M = {"data": {"global_batch": 16}, "model": {"dtype": "bfloat16"}}
TRAIN = (  # (config, topology, overrides)
    ("configs/gla_340m.py", "v5e:2x2", _340M),
    ("configs/gla_340m.py", "v5e:2x2", {"data": _340M["data"], "model": {**_340M["model"], "attn_impl": "mosaic"}}),
    ("configs/3b.py", "v5p:2x2x4", {}),
    ("configs/3b.py", "v5p:2x2x4", {"model": {"attn_impl": "mosaic"}}),
)


def _headline(rep: dict[str, Any], top: int, full: bool) -> dict[str, Any]:
    if full:
        return rep
    est = rep["estimate"]
    return {
        "program": rep["program"],
        "chip": rep["chip"],
        "estimate_s": est["seconds"],
        "label": est["label"],
        "limit_s": rep["limit"]["seconds"],
        "limit": {k: rep["limit"][k] for k in ("flops", "bytes", "compute_s", "memory_s", "bound")},
        "estimate_over_limit": rep["estimate_over_limit"],
        "memory": rep["memory"],
        "loops": est["loops"],
        "top_sources": est["by_source"][:top],
        "unestimated": est["unestimated"],
        "mosaic": est["mosaic"],
    }


def _override(config, overrides: dict):
    """``config`` with {block: {field: value}} replaced."""
    import dataclasses

    for block, values in overrides.items():
        config = dataclasses.replace(config, **{block: dataclasses.replace(getattr(config, block), **values)})
    return config


def _train_row(config_path: str, topology: str, overrides: dict, top: int, full: bool) -> dict[str, Any]:
    from laplace_jax.config import load_run_config
    from laplace_jax.train.tpu_plan import tpu_plan

    config = _override(load_run_config(config_path), overrides)
    rep = tpu_plan(config, topology)
    row = _headline(rep["tpu"], top, full)
    row.update(
        config=config_path, topology=topology, overrides=overrides, mesh=rep["mesh"], run=rep["tpu_run"],
        params=rep["params"], tokens_per_step=rep["tokens_per_step"], seed=rep.get("seed"),
    )  # fmt: skip
    return row


def _calibration() -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from laplace_jax.tpu import estimate, tpu_devices

    out = []
    n, m = 8192, 2**28
    for topology in ("v5e:1x1", "v5p:1x1x1"):
        chip, devices = tpu_devices(topology)
        s = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
        for name, fn, shapes, work in (
            ("matmul 8192^3 bf16", jnp.matmul, [((n, n), jnp.bfloat16)] * 2, 2 * n**3),
            ("elementwise 1 GiB in + 1 GiB out fp32", lambda x: x * 2.0 + 1.0, [((m,), jnp.float32)], 8 * m),
        ):
            args = [jax.ShapeDtypeStruct(sh, dt, sharding=s) for sh, dt in shapes]
            est = estimate(jax.jit(fn).lower(*args).compile().as_text(), chip)
            rate = work / est["seconds"]
            peak = chip.peak_bf16_tflops * 1e12 if "matmul" in name else chip.hbm_gbps * 1e9
            out.append(
                {"program": name, "chip": chip.name, "estimate_s": est["seconds"], "rate": rate, "share": rate / peak}
            )
        out.append(_mosaic_calibration(chip))
    return out


def _mosaic_calibration(chip) -> dict[str, Any]:
    """The calibration matmul as a Pallas TPU kernel, its static schedule read in a child process
    (``tools/mosaic_profile``), as the reports read the GLA kernels'."""
    from laplace_jax.tpu import run_mosaic_profile

    res = run_mosaic_profile("--chip", chip.name, "--calibration")
    seconds = res["cycles"] / (chip.clock_ghz * 1e9)
    rate = res["flops"] / seconds
    return {"program": res["program"], "chip": chip.name, "estimate_s": seconds, "rate": rate,
            "share": rate / (chip.peak_bf16_tflops * 1e12)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS + EXTRA)}")
    ap.add_argument("--top", type=int, default=8, help="top sources kept per program")
    ap.add_argument("--full", action="store_true", help="keep every field of every report")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 16)  # Muon's traffic report for the 16-chip plan
    from laplace_jax.config import load_run_config
    from laplace_jax.tools.tpu_check import (
        SHAPES,
        WEIGHT_FORMS,
        decode_reports,
        kernel_reports,
        prefill_reports,
        serve_reports,
    )
    from laplace_jax.tpu import tpu_devices

    only = set(a.only.split(","))
    res: dict[str, Any] = {"jax": jax.__version__, "rows": {}}
    import importlib.metadata

    res["libtpu"] = importlib.metadata.version("libtpu")
    t0 = time.perf_counter()
    if "kernel" in only:
        res["rows"]["kernel"] = []
        for topology in ("v5e:1x1", "v5p:1x1x1"):
            chip, devices = tpu_devices(topology)
            reps = kernel_reports(chip, devices, SHAPES["3b"], 128)
            res["rows"]["kernel"] += [_headline(r, a.top, a.full) for r in reps]
    if "decode" in only:
        chip, devices = tpu_devices("v5p:1x1x1")
        res["rows"]["decode"] = []
        for overrides in ({}, {"model": {"attn_impl": "mosaic"}}):  # the config's XLA steps, then the Mosaic ones
            config_3b = _override(load_run_config("configs/3b.py"), overrides)
            suffix = ", model.attn_impl=mosaic" if overrides else ""
            forms = WEIGHT_FORMS[:1] if overrides else WEIGHT_FORMS  # packed and per-layer: once
            reps = decode_reports(chip, devices, config_3b, 256, forms)
            res["rows"]["decode"] += [dict(_headline(r, a.top, a.full), program=r["program"] + suffix) for r in reps]
            serve = serve_reports(chip, devices, config_3b, 256, ["256"], 512, SERVE_STEPS, programs=("decode",))
            (rep,) = [r for r in serve if r["program"] == "decode W=256"]
            row = _headline(rep, a.top, a.full)
            row.update(program="serving decode W=256" + suffix, steps_per_call=SERVE_STEPS)
            row["per_token_s"] = rep["estimate"]["seconds"] / SERVE_STEPS  # the dearest call
            row["per_token_optional_skipped_s"] = rep["estimate"]["optional_skipped_seconds"] / SERVE_STEPS
            res["rows"]["decode"].append(row)
    if "prefill" in only:
        chip, devices = tpu_devices("v5p:1x1x1")
        config_3b = load_run_config("configs/3b.py")
        reps = [
            rep
            for form in (WEIGHT_FORMS[0], WEIGHT_FORMS[2])  # as initialised; serving's TPU form
            for rep in prefill_reports(chip, devices, config_3b, list(PREFILL_LENGTHS), form)
        ]
        res["rows"]["prefill"] = [
            dict(_headline(r, a.top, a.full), tokens=r["tokens"], tokens_per_s=r["tokens_per_s"]) for r in reps
        ]
    if "calibration" in only:
        res["rows"]["calibration"] = _calibration()
    if "train" in only:
        res["rows"]["train"] = [_train_row(*row, a.top, a.full) for row in TRAIN]
    if "remat" in only:
        res["rows"]["remat"] = [
            _train_row("configs/3b.py", "v5p:2x2x4", {"model": {"attn_impl": "mosaic", "remat": p}}, a.top, a.full)
            for p in REMAT
        ]
    res["seconds"] = time.perf_counter() - t0
    write_result(res, "bench_tpu", argv, a.out)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
