"""What ``model.attn_impl=auto`` (the default) compiles to for a TPU, against the kernels named
explicitly, as JSON (no TPU: every time is the TPU compiler's estimate, not a measurement).

    python -m benchmarks.bench_auto_tpu --out benchmarks/results/auto_tpu.json

Each program is compiled by the real TPU compiler for a deviceless topology with a plain
``jax.jit(...).lower(...)`` on TPU devices from this CPU host (no context manager: the kernel
follows the compile target), once per ``model.attn_impl``: "auto", "mosaic" and "chunk" (the XLA
kernel, which Neuron runs). Rows: the GLA kernel at the 3B layer on v5e (forward, forward +
backward), the 3B ``decode_step`` at W=256 on v5p, the 340M train step (16 x 2048, bf16) on
v5e:2x2 and the 3B train step (Muon, fsdp 16) on v5p:2x2x4. Each row keeps the estimate, the
memory per chip, the MFU of train steps and the GLA kernels read from the compiled HLO
(``hlo_stats.gla_kernels``): "auto" must compile to the Mosaic kernels at the same estimate and
memory as "mosaic" (the dispatch costs nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.common import write_result

IMPLS = ("auto", "mosaic", "chunk")
_340M = {"data": {"global_batch": 16}, "model": {"dtype": "bfloat16"}}
TRAIN = (("configs/gla_340m.py", "v5e:2x2", _340M), ("configs/3b.py", "v5p:2x2x4", {}))
PROGRAMS = ("kernel", "decode", "train")


def _row(rep: dict[str, Any], impl: str, **extra: Any) -> dict[str, Any]:
    return {
        "program": rep["program"],
        "attn_impl": impl,
        "chip": rep["chip"],
        "gla_kernels": rep["gla_kernels"],
        "estimate_s": rep["estimate"]["seconds"],
        "label": rep["estimate"]["label"],
        "limit_s": rep["limit"]["seconds"],
        "estimate_over_limit": rep["estimate_over_limit"],
        "memory_total": rep["memory"]["total"],
        "memory_temporaries": rep["memory"]["temporaries"],
        **extra,
    }


def _with_impl(config, impl: str, overrides: dict):
    import dataclasses

    for block, values in {**overrides, "model": {**overrides.get("model", {}), "attn_impl": impl}}.items():
        config = dataclasses.replace(config, **{block: dataclasses.replace(getattr(config, block), **values)})
    return config


def kernel_rows() -> list[dict[str, Any]]:
    from laplace_jax.tools.tpu_check import SHAPES, kernel_reports
    from laplace_jax.tpu import tpu_devices

    chip, devices = tpu_devices("v5e:1x1")
    reps = kernel_reports(chip, devices, SHAPES["3b"], 128, impls=IMPLS)
    return [_row(r, impl) for r, impl in zip(reps, [i for i in IMPLS for _ in range(2)], strict=True)]


def decode_rows() -> list[dict[str, Any]]:
    from laplace_jax.config import load_run_config
    from laplace_jax.tools.tpu_check import WEIGHT_FORMS, decode_reports
    from laplace_jax.tpu import tpu_devices

    chip, devices = tpu_devices("v5p:1x1x1")
    rows = []
    for impl in IMPLS:
        config = _with_impl(load_run_config("configs/3b.py"), impl, {})
        (rep,) = decode_reports(chip, devices, config, 256, WEIGHT_FORMS[:1])  # bf16 weights as initialised
        rows.append(_row(rep, impl, floor_share=1 / rep["estimate_over_limit"]))
    return rows


def train_rows() -> list[dict[str, Any]]:
    from laplace_jax.config import load_run_config
    from laplace_jax.train.tpu_plan import tpu_plan

    rows = []
    for path, topology, overrides in TRAIN:
        for impl in IMPLS:
            rep = tpu_plan(_with_impl(load_run_config(path), impl, overrides), topology)
            run = rep["tpu_run"]
            rows.append(
                _row(rep["tpu"], impl, config=path, topology=topology, mfu=run["mfu"], tokens_per_s=run["tokens_per_s"])
            )
            print(f"{path} {impl}: MFU {100 * run['mfu']:.1f}%, {rep['tpu']['gla_kernels']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(PROGRAMS), help=f"comma-separated subset of {','.join(PROGRAMS)}")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 16)  # Muon's traffic report for the 16-chip plan
    import importlib.metadata

    res: dict[str, Any] = {"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu"), "rows": {}}
    t0 = time.perf_counter()
    for name, fn in (("kernel", kernel_rows), ("decode", decode_rows), ("train", train_rows)):
        if name in a.only.split(","):
            res["rows"][name] = fn()
    res["seconds"] = time.perf_counter() - t0
    write_result(res, "bench_auto_tpu", argv, a.out)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
