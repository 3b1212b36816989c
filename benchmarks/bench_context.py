"""Context parallelism at 3B: ``train.py --plan`` for long sequences with and without
``mesh.context``, and the context collectives read from each compiled step against the formula.

    python -m benchmarks.bench_context --out benchmarks/results/context_plans.json   # 64 fake CPU devices
    python -m benchmarks.bench_context --topology v5p:4x4x8 --out benchmarks/results/context_plans_tpu.json

Each row compiles the real sharded train step of ``configs/3b_32k.py`` (with overrides) in its own
process and keeps: memory per device and whether train.py's fit check passes, the context
all-gather per op (what each device receives, against (P - 1) x rows x H x K x (V + 1) x 4 bytes:
the states and decays of the other slices, fp32), the neighbour exchanges, and the plan's time
estimate. The CPU rows are the Neuron plan (24 GiB per logical NeuronCore, XLA:CPU's memory
view); the TPU rows are the TPU compiler's memory and its cost model's estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import write_result
from laplace_jax.config import RunConfig, load_config_file

CONFIG = "configs/3b_32k.py"
LONG = {"data.seq_len": 131_072, "model.max_seq_len": 131_072}
ROWS = {  # name -> overrides of configs/3b_32k.py (same 524,288 tokens per step unless said)
    "32k, context 8 x fsdp 8": {},
    "32k, fsdp 64 (no context; 64 sequences: the fewest 64 devices can split)": {
        "mesh.context": 1,
        "mesh.fsdp": 64,
        "data.global_batch": 64,
    },
    "128k, context 16 x fsdp 4": {**LONG, "data.global_batch": 4, "mesh.context": 16, "mesh.fsdp": 4},
}
# 128 chips: with fewer than 16 fsdp ranks the TPU compiler outgrows a 24 GiB host (each rank's
# share of Muon's Newton-Schulz grows; docs/context.md)
TPU_ROWS = {"32k, context 8 x fsdp 16": {"mesh.fsdp": 16}}


def _config(overrides: dict) -> RunConfig:
    c = load_config_file(CONFIG)
    for key, value in overrides.items():
        block, field = key.rsplit(".", 1)
        node = c
        for part in block.split("."):
            node = getattr(node, part)
        setattr(node, field, value)
    return RunConfig.from_mapping(c)


def _plan(overrides: dict, topology: str | None) -> dict:
    cmd = [sys.executable, "train.py", "--config", CONFIG, "--plan", "--json"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd += ["--topology", topology] if topology else []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        return {"refused": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    return json.loads(proc.stdout)


def row(name: str, overrides: dict, topology: str | None) -> dict:
    cfg = _config(overrides)
    m, P = cfg.model, cfg.mesh.context
    rows = cfg.data.global_batch // (cfg.mesh.data * (cfg.mesh.fsdp if cfg.mesh.fsdp > 0 else 1))
    out = {"name": name, "overrides": overrides, "seq_len": cfg.data.seq_len, "context": P}
    out["tokens_per_device"] = rows * cfg.data.seq_len // P
    rep = _plan(overrides, topology)
    if "refused" in rep:
        return {**out, **rep}
    out.update(mesh=rep["mesh"], memory=rep["memory_per_device"], device_memory=rep["device_memory"])
    out["fits"] = rep["fits"] if "fits" in rep else rep["tpu"]["memory"]["fits"]
    ctx = rep["train_step_collectives_by_source"].get("context", {})
    if P > 1:
        gather = ctx["all-gather"]
        formula = (P - 1) * rows * m.n_heads * m.head_k_dim * (m.head_v_dim + 1) * 4
        out["context_all_gather"] = {
            "ops": gather["ops"],  # 2 per layer under remat=full: the forward and its recompute
            "received_bytes_per_op": gather["wire"] / gather["ops"],
            "formula_bytes": formula,
            "over_formula": gather["wire"] / gather["ops"] / formula,
        }
        out["context_permute_bytes"] = ctx["collective-permute"]["bytes"]
        out["context_wire_bytes"] = sum(v["wire"] for v in ctx.values())
    out["wire_bytes"] = sum(rep["wire_bytes_per_device"].values())
    if topology:
        out["tpu_run"] = rep["tpu_run"]
    else:
        cost = rep["cost"]
        out["cost"] = {k: cost[k] for k in ("compute_s_at_peak", "comm_s")}
        out["cost"]["tokens_per_s"] = cost["overlapped"]["tokens_per_s"]
    return out


def kernel_row(topology: str, rows: int = 2, slice_len: int = 4096) -> dict:
    """The GLA kernel alone at the 3B layer (H16 K96 V192, bf16, chunk 128), forward + backward:
    one sequence slice per chip over every chip of ``topology`` (``context_gla``) against one chip
    running the same per-chip shape from a zero state (``chunk_gla``): what context parallelism
    adds per layer, on the TPU compiler's estimate."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from laplace_jax.hlo_stats import collectives_by_source
    from laplace_jax.ops.gla import chunk_gla, context_gla
    from laplace_jax.tpu import report, tpu_devices

    chip, devices = tpu_devices(topology)
    n, (H, K, V) = len(devices), (16, 96, 192)

    def shapes(T, sharding):
        dims = (K, K, V, K)
        dtypes = (jnp.bfloat16,) * 3 + (jnp.float32,)
        return [jax.ShapeDtypeStruct((rows, T, H, d), t, sharding=sharding) for d, t in zip(dims, dtypes, strict=True)]

    def grad_of(fwd):
        return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))

    mesh = Mesh(np.asarray(devices), ("context",))
    seq = P(None, "context")
    split = jax.shard_map(
        lambda q, k, v, g: context_gla(q, k, v, g, axis="context", chunk_size=128)[0],
        mesh=mesh, in_specs=(seq,) * 4, out_specs=seq, check_vma=False,
    )  # fmt: skip
    one = Mesh(np.asarray(devices[:1]), ("x",))
    cp = jax.jit(grad_of(split)).lower(*shapes(n * slice_len, NamedSharding(mesh, seq))).compile()
    alone = jax.jit(grad_of(lambda *a: chunk_gla(*a, chunk_size=128)[0]))
    alone = alone.lower(*shapes(slice_len, NamedSharding(one, P()))).compile()
    a, b = report(cp, chip, "context_gla"), report(alone, chip, "chunk_gla")
    return {
        "name": f"kernel fwd + bwd, {n} slices of {rows} x {slice_len} tokens, H{H} K{K} V{V} bf16",
        "chips": n,
        "context_s": a["estimate"]["seconds"],
        "one_chip_s": b["estimate"]["seconds"],
        "overhead": a["estimate"]["seconds"] / b["estimate"]["seconds"] - 1,
        "context_temporaries": a["memory"]["temporaries"],
        "one_chip_temporaries": b["memory"]["temporaries"],
        "collectives": collectives_by_source(cp.as_text()),  # the backward's sum has no op name on TPU
        "formula_bytes": (n - 1) * rows * H * K * (V + 1) * 4,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default=None, help="compile for this TPU topology instead (needs jax[tpu])")
    ap.add_argument("--kernel-topology", default="v5p:2x2x2", help="with --topology: the kernel row's chips")
    ap.add_argument("--out", default=None, help="JSON file to write (e.g. benchmarks/results/context_plans.json)")
    a = ap.parse_args(argv)
    res = {"config": CONFIG, "topology": a.topology, "rows": []}
    if a.topology:
        from laplace_jax.train.tpu_plan import reserve_cpu_devices

        os.environ["JAX_PLATFORMS"] = "cpu"
        reserve_cpu_devices(a.kernel_topology)
        res["kernel"] = kernel_row(a.kernel_topology)
        print(json.dumps(res["kernel"]), flush=True)
    for name, overrides in (TPU_ROWS if a.topology else ROWS).items():
        res["rows"].append(row(name, overrides, a.topology))
        print(json.dumps(res["rows"][-1]), flush=True)
    write_result(res, "bench_context", argv, a.out)


if __name__ == "__main__":
    main()
