"""The trainer: one config's mesh, shardings, optimizer and jitted train/eval steps.

``Trainer(config)`` allocates nothing; ``compile()`` lowers the step with abstract inputs (so
``plan`` and the fit check read its memory first), ``init``/a checkpoint restore make the state.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import RunConfig
from laplace_jax.errors import UserError
from laplace_jax.models.gla_lm import abstract_params, count_params, init_params
from laplace_jax.optim.from_config import make_optimizer
from laplace_jax.platform import prng_impl
from laplace_jax.sharding import (
    BATCH_AXES,
    DATA,
    FSDP,
    batch_sharding,
    make_mesh,
    param_shardings,
    param_specs,
    replicated,
)
from laplace_jax.train.step import eval_step, init_state, train_step


def state_shardings(state_shapes: Any, param_shardings: Any, fallback: NamedSharding) -> Any:
    """Every state leaf that mirrors a parameter (its path ends with the parameter's path and it
    has at least the sharding's rank: params, Muon momentum, Adam moments) gets that parameter's
    sharding; scalars and anything else get ``fallback``. XLA's own propagation would replicate
    optimizer state."""
    leaves = jax.tree_util.tree_leaves_with_path(param_shardings)
    by_path = dict(sorted(((jax.tree_util.keystr(p), s) for p, s in leaves), key=lambda kv: -len(kv[0])))

    def pick(path, leaf):
        key = jax.tree_util.keystr(path)
        for ppath, sharding in by_path.items():
            if key.endswith(ppath) and len(sharding.spec) <= leaf.ndim:
                return sharding
        return fallback

    return jax.tree_util.tree_map_with_path(pick, state_shapes)


def _abstract(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


class Trainer:
    """The jitted train step of ``config`` on ``devices`` (default: all), with every sharding.

    Attributes: ``model_cfg`` (ModelConfig), ``mesh``, ``param_shardings``, ``state_shardings``,
    ``abstract_state``, ``batch_sharding``, ``abstract_batch`` ([grad_accum, micro, seq + 1]
    int32), ``step_fn`` (state, batch) -> (state, metrics), ``steps``, ``n_params``,
    ``tokens_per_step``."""

    def __init__(self, config: RunConfig, devices: list | None = None):
        self.config = config
        self.model_cfg = config.model
        self.prng_impl = prng_impl(config.train.prng_impl)
        t, micro = config.train, self._micro_batch(config)
        self.steps = t.steps
        self.mesh = make_mesh(config.mesh, devices)
        rows = self.mesh.shape[DATA] * self.mesh.shape[FSDP]
        if micro % rows:
            raise UserError(
                f"micro-batch {micro} (global_batch / grad_accum) is not divisible by data x fsdp = {rows} devices; "
                "change data.global_batch or train.grad_accum"
            )
        self.rules = config.mesh.rules
        self.param_shardings = param_shardings(self.model_cfg, self.mesh, self.rules)
        specs = param_specs(self.model_cfg, self.rules)
        self.tx, self.sched = make_optimizer(config.opt, self.steps, self.mesh, specs)
        params_abs = _abstract(abstract_params(self.model_cfg), self.param_shardings)
        shapes = jax.eval_shape(functools.partial(init_state, tx=self.tx), params_abs)
        self.state_shardings = state_shardings(shapes, self.param_shardings, replicated(self.mesh))
        self.abstract_state = _abstract(shapes, self.state_shardings)
        self.batch_sharding = NamedSharding(self.mesh, P(None, BATCH_AXES, None))  # rows whole on context
        seq = config.data.seq_len
        self.abstract_batch = jax.ShapeDtypeStruct(
            (t.grad_accum, micro, seq + 1), jnp.int32, sharding=self.batch_sharding
        )
        self.n_params = count_params(abstract_params(self.model_cfg))
        self.tokens_per_step = config.data.global_batch * seq

        def step(state, batch):
            # the model's constraints and gathers use logical names; the rules bind them to the mesh
            with nn.logical_axis_rules(self.rules):
                return train_step(self.model_cfg, self.tx, self.sched, state, batch, self.mesh, specs)

        out = (self.state_shardings, replicated(self.mesh))
        self.step_fn = jax.jit(
            step, in_shardings=(self.state_shardings, self.batch_sharding), out_shardings=out, donate_argnums=0
        )
        self._init_fn = jax.jit(functools.partial(init_state, tx=self.tx), out_shardings=self.state_shardings)
        self._eval_fn = jax.jit(functools.partial(eval_step, self.model_cfg))

    @staticmethod
    def _micro_batch(config: RunConfig) -> int:
        if config.data.global_batch % config.train.grad_accum:
            raise UserError(
                f"data.global_batch {config.data.global_batch} is not divisible by train.grad_accum "
                f"{config.train.grad_accum}"
            )
        return config.data.global_batch // config.train.grad_accum

    def compile(self) -> Any:
        """AOT-compile the step (abstract inputs) and return the Compiled object."""
        with jax.set_mesh(self.mesh):
            return self.step_fn.lower(self.abstract_state, self.abstract_batch).compile()

    def init(self, seed: int) -> dict:
        """A fresh state: parameters from ``seed``, created directly in their shardings."""
        init = jax.jit(lambda k: init_params(self.model_cfg, k), out_shardings=self.param_shardings)
        return self._init_fn(init(jax.random.key(seed, impl=self.prng_impl)))

    def batch(self, rows: np.ndarray) -> jax.Array:
        """This process's rows of a global batch [global_batch / processes, seq + 1] as the step's input."""
        rows = rows.reshape(self.config.train.grad_accum, -1, rows.shape[-1])
        return jax.make_array_from_process_local_data(self.batch_sharding, rows)

    def eval_loss(self, params: Any, batches: list[np.ndarray]) -> float:
        """Mean loss over eval batches (global [B, seq + 1] arrays; each process takes its rows)."""
        losses, sharding = [], batch_sharding(self.mesh)
        rank, n = jax.process_index(), jax.process_count()
        for b in batches:
            rows = b.shape[0] // n
            mine = b[rank * rows : (rank + 1) * rows]
            arr = jax.make_array_from_process_local_data(sharding, mine) if b.shape[0] % self.mesh.size == 0 else b
            losses.append(float(self._eval_fn(params, arr)))
        return float(np.mean(losses))
