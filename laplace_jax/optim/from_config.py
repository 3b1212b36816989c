"""The training optimizer of a config's ``opt`` block: the learning-rate schedule, global-norm
clipping, then Muon + AdamW (or AdamW alone)."""

from __future__ import annotations

from typing import Any

import optax
from jax.sharding import Mesh

from laplace_jax.config import OptConfig
from laplace_jax.optim.muon import muon, payload_dtype
from laplace_jax.sharding import FSDP


def make_schedule(opt: OptConfig, steps: int) -> optax.Schedule:
    """Linear warmup, then cosine to min_lr_ratio * lr ('cosine') or flat then linear decay ('wsd').

    Step s (0-based) uses the schedule at s + 1, so the first step already moves (lr / warmup).
    """
    lr, warm = opt.lr, opt.warmup_steps
    floor = lr * opt.min_lr_ratio
    if opt.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1), floor)
    else:  # "wsd"
        decay = max(1, int(steps * opt.decay_fraction))
        stable = max(0, steps - warm - decay)
        parts = [
            optax.linear_schedule(0.0, lr, warm),
            optax.constant_schedule(lr),
            optax.linear_schedule(lr, floor, decay),
        ]
        base = optax.join_schedules(parts, [warm, warm + stable])
    return lambda count: base(count + 1)


def make_optimizer(
    opt: OptConfig, steps: int, mesh: Mesh | None = None, specs: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then Muon + AdamW (or AdamW alone)."""
    sched = make_schedule(opt, steps)
    if opt.optimizer == "muon":
        core = muon(
            sched,
            beta=opt.beta,
            nesterov=opt.nesterov,
            weight_decay=opt.weight_decay,
            adjust_lr=opt.adjust_lr,
            adam_b1=opt.b1,
            adam_b2=opt.b2,
            adam_eps=opt.eps,
            mesh=mesh if mesh is not None and mesh.shape[FSDP] > 1 else None,
            shard_axis=FSDP,
            param_specs=specs,
            comm_dtype=payload_dtype(opt.comm_dtype),
        )
    else:  # "adamw"
        core = optax.adamw(sched, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), core), sched
