"""``train.py --plan``: compile the sharded step for the config's mesh with abstract inputs, read
its memory and collectives from the compiled HLO, and estimate the whole run's time and cost on
the target hardware (``config.plan``). Nothing is allocated.

The estimate is a roofline, not a measurement:
- compute: the step's model FLOPs (``accounting.flops_per_token`` x tokens) per device over the
  device's dense bf16 peak, i.e. the step time at 100% MFU;
- communication: the collectives' bytes on the wire per device (ring algorithms over each op's
  replica group of n: all-gather and all-to-all move (n-1)/n of their result, reduce-scatter
  (n-1) x its shard, all-reduce twice (n-1)/n of its result) over the device's share of the
  interconnect;
- a step takes max(compute, comm) if the two overlap perfectly and their sum if they do not.
"""

from __future__ import annotations

from typing import Any

from laplace_jax import platform
from laplace_jax.config import PlanConfig, RunConfig
from laplace_jax.hlo_stats import collective_bytes, collectives_by_source, gla_kernels, memory_report
from laplace_jax.optim import payload_dtype
from laplace_jax.optim.comm_report import muon_comm_report
from laplace_jax.sharding import CONTEXT, FSDP
from laplace_jax.train.accounting import fits, flops_per_token
from laplace_jax.train.trainer import Trainer

# The original team's measured 3B training throughput on one trn2.48xlarge (64 logical cores),
# Muon with the two all-to-alls (the original team's report; docs/model.md, "Figures for the 3B config").
SEED_TOKENS_PER_S = 119_934.0
SEED_PARAMS = 3.028e9


def is_seed_model(n_params: int) -> bool:
    """Whether a model is Laplace 3B (parameters within 1% of the original team's count)."""
    return abs(n_params / SEED_PARAMS - 1) < 0.01


def wire_bytes(collectives: dict[str, dict[str, float]]) -> dict[str, float]:
    """Bytes one device sends per step, by kind, for ``collective_bytes`` results: ring
    algorithms over each op's own replica group (a context group, an fsdp group, every device)."""
    return {kind: v["wire"] for kind, v in collectives.items() if v["ops"]}


def estimate_cost(
    hw: PlanConfig,
    *,
    flops_per_step: float,
    wire_bytes_per_device: float,
    devices: int,
    tokens_per_step: int,
    steps: int,
    with_seed: bool,
) -> dict[str, Any]:
    """Step time, tokens/s, days and instance-hours of the whole run on ``hw`` (``config.plan``);
    ``with_seed`` adds the original team's measured 3B run (same model, same hardware) beside it."""
    peak = hw.peak_tflops_per_device * 1e12
    link = hw.interconnect_gbps_per_device * 1e9
    compute_s = flops_per_step / devices / peak
    comm_s = wire_bytes_per_device / link
    rows = {}
    for name, step_s in zip(_ROWS, (max(compute_s, comm_s), compute_s + comm_s), strict=True):
        days = steps * step_s / 86_400
        rows[name] = {
            "step_s": step_s,
            "tokens_per_s": tokens_per_step / step_s,
            "days": days,
            "instance_hours": days * 24 * devices / hw.devices_per_instance,
        }
    out = {
        "hardware": hw.name,
        "peak_tflops_per_device": hw.peak_tflops_per_device,
        "interconnect_gbps_per_device": hw.interconnect_gbps_per_device,
        "usd_per_instance_hour": hw.usd_per_instance_hour,
        "compute_s_at_peak": compute_s,
        "comm_s": comm_s,
        "comm_over_compute": comm_s / compute_s,
        **rows,
    }
    if with_seed:
        seed_days = steps * tokens_per_step / SEED_TOKENS_PER_S / 86_400
        out["seed"] = {
            "tokens_per_s": SEED_TOKENS_PER_S,
            "step_s": tokens_per_step / SEED_TOKENS_PER_S,
            "days": seed_days,
            "instance_hours": seed_days * 24 * devices / hw.devices_per_instance,
            "mfu": SEED_TOKENS_PER_S * flops_per_step / tokens_per_step / (devices * peak),
        }
    return out


def plan(config: RunConfig) -> dict[str, Any]:
    """Compile the sharded step for the config's mesh on fake CPU devices; report memory, traffic and cost."""
    trainer = Trainer(config)
    compiled = trainer.compile()
    rep = step_report(config, trainer, compiled)
    rep["device_memory"] = platform.device_memory_bytes(config.train.device_memory_gib)
    rep["fits"] = fits(rep["memory_per_device"], rep["device_memory"])  # the training run's own fit check
    wire = sum(rep["wire_bytes_per_device"].values())
    rep["cost"] = estimate_cost(
        config.plan,
        flops_per_step=rep["flops_per_token"] * trainer.tokens_per_step,
        wire_bytes_per_device=wire,
        devices=rep["devices"],
        tokens_per_step=trainer.tokens_per_step,
        steps=trainer.steps,
        with_seed=is_seed_model(trainer.n_params),
    )
    return rep


def step_report(config: RunConfig, trainer: Trainer, compiled: Any) -> dict[str, Any]:
    """Memory and collectives of the compiled step (what both plans print)."""
    mem = memory_report(compiled)
    n = trainer.mesh.devices.size
    hlo = compiled.as_text()
    coll = collective_bytes(hlo)
    rep = {
        "devices": n,
        # the context axis only when it splits sequences: a context=1 report reads as before it existed
        "mesh": {k: v for k, v in trainer.mesh.shape.items() if k != CONTEXT or v > 1},
        "params": trainer.n_params,
        "tokens_per_step": trainer.tokens_per_step,
        "total_steps": trainer.steps,
        "total_tokens": trainer.tokens_per_step * trainer.steps,
        "memory_per_device": mem,
        "train_step_collectives_per_device": coll,
        "train_step_collectives_by_source": collectives_by_source(hlo),
        "flops_per_token": flops_per_token(trainer.model_cfg, trainer.n_params, trainer.config.data.seq_len),
        "wire_bytes_per_device": wire_bytes(coll),
        "gla_kernels": gla_kernels(hlo),  # what the compiled step runs, read from its HLO
    }
    if config.opt.optimizer == "muon" and trainer.mesh.shape[FSDP] > 1:
        comm = payload_dtype(config.opt.comm_dtype)
        rep["muon"] = muon_comm_report(trainer.model_cfg, trainer.mesh.shape[FSDP], comm)
    return rep


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


_ROWS = ("overlapped", "serial")


def _format_cost(c: dict[str, Any]) -> list[str]:
    usd = c["usd_per_instance_hour"]

    def row(name: str, r: dict[str, Any], mfu: str) -> str:
        cost = f"  ${r['instance_hours'] * usd:,.0f}" if usd > 0 else ""
        return (
            f"  {name:<28}{r['tokens_per_s']:>11,.0f} {r['step_s']:>8.2f} {r['days']:>7.1f} "
            f"{r['instance_hours']:>9,.0f} {mfu:>6}{cost}"
        )

    return [
        f"estimate on {c['hardware']} ({c['peak_tflops_per_device']:g} TFLOP/s bf16 and "
        f"{c['interconnect_gbps_per_device']:g} GB/s interconnect per device; plan.* in the config):",
        f"  compute at peak {c['compute_s_at_peak']:.3f} s/step, communication {c['comm_s']:.3f} s/step, "
        f"comm/compute {c['comm_over_compute']:.2f}",
        f"  {'':<28}{'tokens/s':>11} {'step s':>8} {'days':>7} {'inst-h':>9} {'MFU':>6}" + ("  cost" if usd else ""),
        *(row(f"roofline, comm {k}", c[k], f"{100 * c['compute_s_at_peak'] / c[k]['step_s']:.0f}%") for k in _ROWS),
        *([row("Laplace 3B, original team", c["seed"], f"{100 * c['seed']['mfu']:.0f}%")] if "seed" in c else []),
    ]


def format_collectives(rep: dict[str, Any]) -> list[str]:
    """Memory per device and the step's collectives (trip counts applied) as text lines."""
    mem, avail = rep["memory_per_device"], rep["device_memory"]
    lines = [
        "memory per device (compiled train step):",
        f"  arguments         {_gib(mem['arguments'])}",
        f"  outputs           {_gib(mem['outputs'])} ({_gib(mem['aliased'])} aliased to inputs)",
        f"  temporaries       {_gib(mem['temporaries'])}",
        f"  total             {_gib(mem['total'])} of {_gib(avail)} "
        f"({100 * mem['total'] / avail:.0f}%){'' if fits(mem, avail) else '  DOES NOT FIT (train.py refuses it)'}",
        "collectives per device per step (trip counts applied; bytes of each op's result):",
    ]
    by_source = rep["train_step_collectives_by_source"]
    wire = rep["wire_bytes_per_device"]
    for kind, v in rep["train_step_collectives_per_device"].items():
        if v["ops"]:
            lines.append(
                f"  {kind:<18}{v['ops']:>6.0f} ops  {v['bytes'] / 1e9:8.3f} GB  ({wire[kind] / 1e9:.3f} GB on the wire)"
            )
            for src, by_kind in sorted(by_source.items()):
                if kind in by_kind and len(by_source) > 1:
                    w = by_kind[kind]
                    lines.append(f"    from {src:<12}{w['ops']:>6.0f} ops  {w['bytes'] / 1e9:8.3f} GB")
    lines.append(f"  on the wire       {sum(wire.values()) / 1e9:8.3f} GB per device (ring algorithms)")
    if "muon" in rep:
        m = rep["muon"]
        lines.append(
            f"Muon all-to-alls    {m['all_to_all_bytes_per_rank'] / 1e9:.3f} GB/rank/step ({m['comm_dtype']}) vs "
            f"{m['gather_baseline_bytes_per_rank'] / 1e9:.2f} GB gather baseline: "
            f"{m['reduction_vs_gather']:.1f}x less; NS busiest/mean rank {m['ns_busiest_over_mean']:.3f}"
        )
    return lines


def format_plan(rep: dict[str, Any]) -> str:
    """The plan report as aligned text."""
    lines = [
        f"devices             {rep['devices']} (mesh {rep['mesh']})",
        f"parameters          {rep['params']:,}",
        f"tokens per step     {rep['tokens_per_step']:,}",
        f"total steps         {rep['total_steps']:,} ({rep['total_tokens'] / 1e9:.1f}e9 tokens)",
        f"GLA kernels         {', '.join(rep['gla_kernels']) or 'none'} (read from the compiled step)",
        *format_collectives(rep),
    ]
    return "\n".join(lines + _format_cost(rep["cost"]))
