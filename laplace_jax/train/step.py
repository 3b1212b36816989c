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

from laplace_jax.cli import UserError
from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import forward
from laplace_jax.optim import muon

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
        comm = {"float32": None, "bfloat16": jnp.bfloat16}.get(opt.comm_dtype, "bad")
        if comm == "bad":
            raise UserError(f"opt.comm_dtype must be 'float32' or 'bfloat16'; got {opt.comm_dtype!r}")
        core = muon(
            sched,
            beta=opt.beta,
            nesterov=opt.nesterov,
            weight_decay=opt.weight_decay,
            adjust_lr=opt.adjust_lr,
            adam_b1=opt.b1,
            adam_b2=opt.b2,
            adam_eps=opt.eps,
            mesh=mesh if mesh is not None and mesh.shape["fsdp"] > 1 else None,
            shard_axis="fsdp",
            param_specs=specs,
            comm_dtype=comm,
        )
    elif opt.optimizer == "adamw":
        core = optax.adamw(sched, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        raise UserError(f"opt.optimizer must be 'muon' or 'adamw'; got {opt.optimizer!r}")
    return optax.chain(optax.clip_by_global_norm(opt.clip_norm), core), sched


NO_LOSS = 1 << 30  # a data source ORs this into a token id to keep it out of the loss as a target


def loss_fn(model: ModelConfig, params: Any, batch_BxT1: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (fp32) of windows [B, T + 1] over the targets without ``NO_LOSS``.

    Text corpora flag nothing (every target counts); synthetic tasks such as MQAR flag their prompt
    tokens so that only answers are trained. The model always sees the plain ids.
    """
    tokens_BxT1 = batch_BxT1 & (NO_LOSS - 1)
    logits = forward(model, params, tokens_BxT1[:, :-1])
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxT1[:, 1:])
    weight_BxT = ((batch_BxT1[:, 1:] & NO_LOSS) == 0).astype(ce_BxT.dtype)
    return (ce_BxT * weight_BxT).sum() / jnp.maximum(weight_BxT.sum(), 1.0)


def init_state(params: Any, tx: optax.GradientTransformation) -> State:
    zero = jnp.zeros((), jnp.int32)
    return {"step": zero, "params": params, "opt_state": tx.init(params), "nonfinite": zero, "skipped": zero}


def train_step(
    model: ModelConfig, tx, sched, state: State, batch_AxBxT1: jax.Array, param_shardings: Any = None
) -> tuple[State, dict]:
    """One optimizer step over ``grad_accum`` micro-batches. Returns (state, metrics).

    ``param_shardings``: where the parameters live; each micro-batch's gradients are constrained
    to them, so they are reduced to shards (reduce-scatter) rather than all-reduced in full."""
    params = state["params"]

    def grad_fn(p, b):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, b))(p)
        if param_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        return loss, grads

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


def eval_step(model: ModelConfig, params: Any, batch_BxT1: jax.Array) -> jax.Array:
    return loss_fn(model, params, batch_BxT1)


def flops_per_token(model: ModelConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters) + 3 x the GLA chunk-form FLOPs."""
    matmul_params = n_params - (0 if model.tie_embeddings else model.vocab_size * model.d_model)  # lookup is free
    C, K, V = model.chunk_size, model.head_k_dim, model.head_v_dim
    gla = model.n_layers * model.n_heads * (4 * K * V + 2 * C * (K + V))
    return 6.0 * matmul_params + 3.0 * gla
