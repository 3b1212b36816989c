"""Muon communication report: compile the distributed Muon update for a model on N fake devices.

Nothing is allocated: inputs are ShapeDtypeStructs with shardings. Bytes come from the compiled
HLO (``laplace_jax.hlo_stats``); the gather-everything baseline is compiled the same way.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.hlo_stats import collective_bytes
from laplace_jax.models.gla_lm import abstract_params
from laplace_jax.optim.muon import label_params, scale_by_muon
from laplace_jax.optim.newton_schulz import make_plan
from laplace_jax.sharding import FSDP


def fake_mesh(n_devices: int, axis: str = FSDP) -> jax.sharding.Mesh:
    """A 1-D mesh over ``n_devices`` CPU devices (fake ones: see ``use_fake_cpu_devices``)."""
    devices = jax.devices("cpu")
    if len(devices) < n_devices:
        raise RuntimeError(
            f"{n_devices} devices requested but JAX sees {len(devices)}; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices} (or jax_num_cpu_devices) before JAX starts"
        )
    return jax.make_mesh((n_devices,), (axis,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n_devices])


def use_fake_cpu_devices(n_devices: int) -> None:
    """Ask for ``n_devices`` CPU devices; must run before JAX initialises its backends."""
    jax.config.update("jax_num_cpu_devices", n_devices)


def muon_comm_report(cfg: ModelConfig, n_devices: int, comm_dtype: Any = None, ns_steps: int = 5) -> dict[str, Any]:
    """Per-rank bytes of the two all-to-alls vs an all-gather baseline, and NS FLOP balance."""
    mesh = fake_mesh(n_devices)
    params = abstract_params(cfg)
    labels = label_params(params)
    hidden = [x for x, lab in zip(jax.tree.leaves(params), jax.tree.leaves(labels), strict=True) if lab == "muon"]

    def spec(x):
        return NamedSharding(mesh, P(*([None] * (x.ndim - 2)), FSDP, None))

    abstract = [jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=spec(x)) for x in hidden]
    tx = scale_by_muon(mesh=mesh, comm_dtype=comm_dtype, ns_steps=ns_steps)
    state = jax.eval_shape(tx.init, abstract)
    state = type(state)(
        [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=a.sharding) for s, a in zip(state[0], abstract, strict=True)]
    )
    muon_hlo = jax.jit(tx.update).lower(abstract, state).compile().as_text()
    replicated = NamedSharding(mesh, P())
    gather = jax.jit(lambda xs: [jax.lax.with_sharding_constraint(x, replicated) for x in xs], out_shardings=replicated)
    gather_hlo = gather.lower(abstract).compile().as_text()

    coll = collective_bytes(muon_hlo)
    base = collective_bytes(gather_hlo)["all-gather"]["bytes"]
    shapes = [x.shape[-2:] for x in hidden for _ in range(math.prod(x.shape[:-2]))]
    plan = make_plan(shapes, n_devices)
    loads = [f * ns_steps for f in plan.rank_flops()]
    a2a = coll["all-to-all"]["bytes"]
    elements = sum(math.prod(x.shape) for x in hidden)
    return {
        "devices": n_devices,
        "hidden_matrices": len(shapes),
        "hidden_elements": elements,
        "comm_dtype": jnp.dtype(comm_dtype or jnp.float32).name,
        "all_to_all_ops_per_step": coll["all-to-all"]["ops"],
        "all_to_all_bytes_per_rank": a2a,
        "other_collective_bytes_per_rank": sum(v["bytes"] for k, v in coll.items() if k != "all-to-all"),
        "ideal_all_to_all_bytes_per_rank": 2 * elements / n_devices * jnp.dtype(comm_dtype or jnp.float32).itemsize,
        "gather_baseline_bytes_per_rank": base,
        "reduction_vs_gather": base / a2a if a2a else float("inf"),
        "ns_flops_total": sum(loads),
        "ns_flops_busiest_rank": max(loads),
        "ns_flops_mean_rank": sum(loads) / n_devices,
        "ns_busiest_over_mean": max(loads) / (sum(loads) / n_devices),
        # every rank runs every group's slots (one program, no branch on the rank), padding included
        "ns_flops_executed_per_rank": plan.executed_flops() * ns_steps,
        "ns_executed_over_mean": plan.executed_flops() * ns_steps / (sum(loads) / n_devices),
    }


def format_comm_report(r: dict[str, Any]) -> str:
    gb = lambda b: f"{b / 1e9:.3f} GB"  # noqa: E731
    rows = [
        ("devices / hidden matrices", f"{r['devices']} / {r['hidden_matrices']} ({r['hidden_elements']:.4g} elements)"),
        ("payload dtype", r["comm_dtype"]),
        ("all-to-alls per step", f"{r['all_to_all_ops_per_step']:.0f}"),
        ("all-to-all bytes / rank / step", f"{gb(r['all_to_all_bytes_per_rank'])} (both exchanges)"),
        ("  ideal (perfect balance)", gb(r["ideal_all_to_all_bytes_per_rank"])),
        ("other collectives / rank", gb(r["other_collective_bytes_per_rank"])),
        ("gather-everything baseline / rank", gb(r["gather_baseline_bytes_per_rank"])),
        ("reduction vs baseline", f"{r['reduction_vs_gather']:.1f}x"),
        ("NS FLOPs / step (all ranks)", f"{r['ns_flops_total']:.3g}"),
        ("NS FLOPs busiest / mean rank", f"{r['ns_busiest_over_mean']:.3f}"),
        ("NS FLOPs run per rank / mean", f"{r['ns_executed_over_mean']:.3f} (padding slots of the one program)"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
