"""The pure train and eval steps.

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
from laplace_jax.loss import loss_fn, loss_terms
from laplace_jax.sharding import BATCH_AXES, CONTEXT

State = dict[str, Any]


def fsdp_value_and_grad(cfg: ModelConfig, mesh: Mesh, specs: Any) -> Any:
    """(params, batch_BxT1) -> (loss, grads) with the batch's rows split over the mesh's data
    and fsdp axes, each row's tokens over its context axis, and each device computing on its
    part in a ``shard_map``. Parameters enter as their shards (``specs``); the model all-gathers
    each weight where it is used (``parallel.gathered``), and the transpose of that gather
    reduce-scatters its gradient, so gradients leave the region as shards, never as full
    all-reduced arrays.

    Context parallelism (``mesh.context`` = P > 1): every device of a context group holds the
    group's whole rows [b, T + 1] (int32 ids: small) and takes its slice's window of T/P + 1, so
    inputs and shifted targets stay aligned across slice boundaries with no exchange; the model
    passes what crosses a boundary (``ops/gla/context.py``, the short convolution's last inputs)."""
    axes = mesh.axis_names
    slices = mesh.shape[CONTEXT]

    def local(params, batch_BxT1):
        if slices > 1:
            n = (batch_BxT1.shape[1] - 1) // slices
            start = jax.lax.axis_index(CONTEXT) * n
            batch_BxT1 = jax.lax.dynamic_slice_in_dim(batch_BxT1, start, n + 1, axis=1)

        # Every device differentiates its own part's share of the global mean; the gathers'
        # transposes sum the shares. check_vma=False: those sums are written out in ``gathered``,
        # which every parameter passes through, so JAX must not add its own.
        def share(p):
            total, count = loss_terms(cfg, p, batch_BxT1)
            count = jax.lax.stop_gradient(jax.lax.psum(count, axes))  # targets on every device
            return total / jnp.maximum(count, 1.0)

        mine, grads = jax.value_and_grad(share)(params)
        return jax.lax.psum(mine, axes), grads

    in_specs = (specs, P(BATCH_AXES))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(P(), specs), check_vma=False)


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
