"""The optimizer, the learning-rate schedule and the pure train / eval steps.

state = {"step", "params", "opt_state", "nonfinite" (consecutive skipped steps), "skipped" (total)}.
The train step takes a batch [grad_accum, micro_batch, seq_len + 1] int32, accumulates
gradients over the first axis with a scan, clips by global norm, and skips (keeps the old
state, counts) any step whose loss or gradient norm is not finite.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from laplace_jax.config import ModelConfig
from laplace_jax.errors import UserError
from laplace_jax.loss import loss_fn, loss_terms
from laplace_jax.optim import muon, payload_dtype
from laplace_jax.sharding import FSDP

State = dict[str, Any]


def make_schedule(opt: Any, steps: int) -> optax.Schedule:
    """Linear warmup, then cosine to min_lr_ratio * lr ('cosine') or flat then linear decay ('wsd').

    Step s (0-based) uses the schedule at s + 1, so the first step already moves (lr / warmup).
    """
    lr, warm = float(opt.lr), int(opt.warmup_steps)
    floor = lr * float(opt.min_lr_ratio)
    if opt.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1), floor)
    elif opt.schedule == "wsd":
        decay = max(1, int(steps * float(opt.decay_fraction)))
        stable = max(0, steps - warm - decay)
        parts = [
            optax.linear_schedule(0.0, lr, warm),
            optax.constant_schedule(lr),
            optax.linear_schedule(lr, floor, decay),
        ]
        base = optax.join_schedules(parts, [warm, warm + stable])
    else:
        raise UserError(f"opt.schedule must be 'cosine' or 'wsd'; got {opt.schedule!r}")
    return lambda count: base(count + 1)


def make_optimizer(opt: Any, steps: int, mesh: jax.sharding.Mesh | None = None, specs: Any = None):
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
    elif opt.optimizer == "adamw":
        core = optax.adamw(sched, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        raise UserError(f"opt.optimizer must be 'muon' or 'adamw'; got {opt.optimizer!r}")
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), core), sched


def fsdp_value_and_grad(cfg: ModelConfig, mesh: Mesh, specs: Any) -> Any:
    """(params, batch_BxT1) -> (loss, grads) with the batch split over every device of ``mesh``
    and each device computing on its rows in a ``shard_map``. Parameters enter as their shards
    (``specs``); the model all-gathers each weight where it is used (``parallel.gathered``),
    and the transpose of that gather reduce-scatters its gradient, so gradients leave the region
    as shards, never as full all-reduced arrays."""
    axes = mesh.axis_names

    def local(params, batch_BxT1):
        # Every device differentiates its own rows' share of the global mean; the gathers'
        # transposes sum the shares. check_vma=False: those sums are written out in ``gathered``,
        # which every parameter passes through, so JAX must not add its own.
        def share(p):
            total, count = loss_terms(cfg, p, batch_BxT1)
            count = jax.lax.stop_gradient(jax.lax.psum(count, axes))  # targets on every device
            return total / jnp.maximum(count, 1.0)

        mine, grads = jax.value_and_grad(share)(params)
        return jax.lax.psum(mine, axes), grads

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axes)), out_specs=(P(), specs), check_vma=False)


def init_state(params: Any, tx: optax.GradientTransformation) -> State:
    zero = jnp.zeros((), jnp.int32)
    return {"step": zero, "params": params, "opt_state": tx.init(params), "nonfinite": zero, "skipped": zero}


def train_step(
    cfg: ModelConfig,
    tx,
    sched,
    state: State,
    batch_AxBxT1: jax.Array,
    mesh: Mesh | None = None,
    param_specs: Any = None,
) -> tuple[State, dict]:
    """One optimizer step over ``grad_accum`` micro-batches. Returns (state, metrics).

    With a ``mesh`` of more than one device (and the parameters' ``param_specs`` on it), each
    micro-batch's loss and gradients come from ``fsdp_value_and_grad``."""
    params = state["params"]
    if mesh is not None and mesh.size > 1:
        grad_fn = fsdp_value_and_grad(cfg, mesh, param_specs)
    else:
        grad_fn = jax.value_and_grad(lambda p, b: loss_fn(cfg, p, b))

    def micro(carry, batch):
        loss, grads = grad_fn(params, batch)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(micro, zeros, batch_AxBxT1)
    n = batch_AxBxT1.shape[0]
    loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    new_state = {
        "step": state["step"] + 1,
        "params": keep(new_params, params),
        "opt_state": keep(opt_state, state["opt_state"]),
        "nonfinite": jnp.where(ok, 0, state["nonfinite"] + 1),
        "skipped": state["skipped"] + (~ok).astype(jnp.int32),
    }
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "update_norm": optax.tree.norm(updates),
        "lr": sched(state["step"]),
        "finite": ok,
        "nonfinite": new_state["nonfinite"],
    }
    return new_state, metrics


def eval_step(cfg: ModelConfig, params: Any, batch_BxT1: jax.Array) -> jax.Array:
    return loss_fn(cfg, params, batch_BxT1)


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters) + 3 x the GLA chunk-form FLOPs."""
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)  # lookup is free
    C, K, V = cfg.chunk_size, cfg.head_k_dim, cfg.head_v_dim
    gla = cfg.n_layers * cfg.n_heads * (4 * K * V + 2 * C * (K + V))
    return 6.0 * matmul_params + 3.0 * gla
