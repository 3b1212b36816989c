"""``train.py --plan --topology v5p:2x2x4``: the real sharded train step compiled by the TPU
compiler for that topology (no TPU needed, ``laplace_jax.tpu``), with its memory per chip, its
collectives, and the compiler's estimated step time turned into tokens/s, MFU, the run's days
and its cost, beside the original team's measured Trainium2 run.

The step time is the compiler's estimate (its cost model), not a measurement; collectives and
asynchronous copies carry no estimate and are listed as such (the report's ``unestimated``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from laplace_jax.config import RunConfig
from laplace_jax.errors import UserError
from laplace_jax.tpu import LABEL, format_report, out_of_memory, report, tpu_devices
from laplace_jax.train.plan import SEED_TOKENS_PER_S, format_collectives, is_seed_model, step_report
from laplace_jax.train.trainer import Trainer

SEED_CHIPS = 16  # one trn2.48xlarge: 16 Trainium2 chips (64 logical NeuronCores)
KNOBS = "model.remat=full, more chips (a larger topology: mesh.fsdp), or a smaller micro-batch (train.grad_accum)"


def reserve_cpu_devices(topology: str) -> None:
    """Ask for as many fake CPU devices as the topology has chips, before JAX starts its backends:
    Muon's traffic report (``optim.comm_report``) compiles its all-to-alls on them."""
    import math

    from laplace_jax.tpu import parse_topology

    jax.config.update("jax_num_cpu_devices", math.prod(parse_topology(topology)[1]))


def sized_mesh(config: RunConfig, chips: int) -> tuple[RunConfig, str]:
    """The config with its mesh sized to ``chips`` when its own sizes do not multiply to that
    (context and data kept where they divide, fsdp taking the rest), and a note saying what
    changed. A size of -1 takes the chips the other axes leave, as on real devices."""
    m = config.mesh
    context = m.context if chips % m.context == 0 else 1
    rows = chips // context  # the chips data x fsdp share
    data = m.data if m.data > 0 else (rows // m.fsdp if rows % m.fsdp == 0 else 1)
    fsdp = m.fsdp if m.fsdp > 0 else rows // data
    if data * fsdp * m.context == chips:
        return config, ""
    new_data = data if rows % data == 0 else 1
    mesh = dataclasses.replace(m, data=new_data, fsdp=rows // new_data, context=context)
    note = (
        f"mesh sized to the {chips} chips: data={new_data} x fsdp={rows // new_data} x context={context} "
        f"(config: {m.data} x {m.fsdp} x {m.context})"
    )
    return dataclasses.replace(config, mesh=mesh), note


def _does_not_fit(topology: str, need: str, knobs: str = KNOBS) -> UserError:
    return UserError(f"the train step does not fit {topology}: {need.rstrip('.')}. Try {knobs}")


def tpu_plan(config: RunConfig, topology: str, usd_per_chip_hour: float = 0.0) -> dict[str, Any]:
    """Compile the train step for ``topology`` and report memory, collectives and the estimate."""
    chip, devices = tpu_devices(topology)
    config, note = sized_mesh(config, len(devices))
    trainer = Trainer(config, devices)
    state = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state)
    )
    if state > chip.hbm_bytes:  # parameters and optimizer state alone: no need to compile to know
        need = f"parameters and optimizer state alone take {state / 2**30:.1f} GiB per chip of {chip.hbm_gib:g} GiB HBM"
        raise _does_not_fit(topology, need, "more chips (a larger topology: mesh.fsdp shards the state)")
    try:
        compiled = trainer.compile()  # the kernels follow the compile target (platform.per_platform)
    except Exception as e:  # the TPU compiler refuses a program that cannot fit its HBM
        oom = out_of_memory(e)
        if oom is None:
            raise
        raise _does_not_fit(topology, f"the compiler says: {oom}") from None
    rep = step_report(config, trainer, compiled)
    n, tokens = len(devices), trainer.tokens_per_step
    flops_step = rep["flops_per_token"] * tokens
    tpu = report(compiled, chip, "train step", flops=flops_step / n)
    mem = tpu["memory"]
    if not mem["fits"]:
        need = f"{mem['total'] / 2**30:.1f} GiB per chip (arguments {mem['arguments'] / 2**30:.1f}, temporaries "
        raise _does_not_fit(topology, need + f"{mem['temporaries'] / 2**30:.1f}) of {chip.hbm_gib:g} GiB HBM")
    step_s = tpu["estimate"]["seconds"]
    days = trainer.steps * step_s / 86_400
    chip_hours = days * 24 * n
    rep.update(
        topology=topology,
        mesh_note=note,
        device_memory=chip.hbm_bytes,
        tpu=tpu,
        tpu_run={
            "label": LABEL,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_chip": tokens / step_s / n,
            "mfu": flops_step / (n * chip.peak_bf16_tflops * 1e12 * step_s),
            "days": days,
            "chip_hours": chip_hours,
            "usd_per_chip_hour": usd_per_chip_hour,
            "usd": chip_hours * usd_per_chip_hour,
        },
    )
    if is_seed_model(trainer.n_params):
        rep["seed"] = {
            "tokens_per_s": SEED_TOKENS_PER_S,
            "chips": SEED_CHIPS,
            "tokens_per_s_per_chip": SEED_TOKENS_PER_S / SEED_CHIPS,
            "hardware": "trn2.48xlarge (16 Trainium2 chips), measured by the original team",
        }
    return rep


def format_tpu_plan(rep: dict[str, Any]) -> str:
    """The TPU plan as text: mesh, memory and collectives, the compiler's report, the run."""
    run = rep["tpu_run"]
    lines = [
        f"topology            {rep['topology']} ({rep['devices']} chips, mesh {rep['mesh']})",
        *([f"  {rep['mesh_note']}"] if rep["mesh_note"] else []),
        f"parameters          {rep['params']:,}",
        f"tokens per step     {rep['tokens_per_step']:,}",
        f"total steps         {rep['total_steps']:,} ({rep['total_tokens'] / 1e9:.1f}e9 tokens)",
        *format_collectives(rep),
        format_report(rep["tpu"]),
        f"the run on {rep['topology']} [{LABEL}]:",
        f"  step {run['step_s']:.3f} s, {run['tokens_per_s']:,.0f} tokens/s ({run['tokens_per_s_per_chip']:,.0f} per "
        f"chip), MFU {100 * run['mfu']:.1f}%",
        f"  {run['days']:.1f} days, {run['chip_hours']:,.0f} chip-hours"
        + (f", ${run['usd']:,.0f} at ${run['usd_per_chip_hour']:g}/chip-hour" if run["usd_per_chip_hour"] else ""),
    ]
    if "seed" in rep:
        s = rep["seed"]
        lines.append(
            f"  original team: {s['tokens_per_s']:,.0f} tokens/s on {s['hardware']} "
            f"({s['tokens_per_s_per_chip']:,.0f} per chip); this estimate is "
            f"{run['tokens_per_s'] / s['tokens_per_s']:.2f}x that"
        )
    return "\n".join(lines)
