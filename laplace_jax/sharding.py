"""Device mesh and shardings from the config: logical axis rules live in config, not in the model."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from laplace_jax.config import MeshConfig, ModelConfig
from laplace_jax.errors import UserError
from laplace_jax.models.gla_lm import param_logical_axes

DATA, FSDP, CONTEXT = "data", "fsdp", "context"  # pure data parallelism, FSDP, sequence slices
AXES = (DATA, FSDP, CONTEXT)
BATCH_AXES = (DATA, FSDP)  # the axes that split a batch's rows; CONTEXT splits each row's tokens


def make_mesh(mesh_cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, context) mesh over ``devices`` (default: all); -1 takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    data, fsdp, context = mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.context
    rows = n // context if n % context == 0 else 0  # the devices left for data x fsdp
    if data == -1:
        data = rows // fsdp if fsdp > 0 and rows % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = rows // data if data > 0 and rows % data == 0 else 0
    if data <= 0 or fsdp <= 0 or data * fsdp * context != n:
        raise UserError(
            f"mesh data={mesh_cfg.data} x fsdp={mesh_cfg.fsdp} x context={context} does not fit the {n} available "
            f"device(s) ({devices[0].platform}); set --config.mesh.fsdp / --config.mesh.data / "
            f"--config.mesh.context so their product is {n}, "
            "or use --plan to compile for a larger machine on fake CPU devices"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, fsdp, context)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def param_specs(cfg: ModelConfig, rule_set: tuple) -> Any:
    """PartitionSpecs (mesh axes) for every parameter."""
    return nn.logical_to_mesh(param_logical_axes(cfg), rule_set)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rule_set: tuple) -> Any:
    specs = param_specs(cfg, rule_set)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches [B, ...] split over every device (data x fsdp x context): pure data parallelism
    (the eval step's; the train step splits rows over data x fsdp and tokens over context)."""
    return NamedSharding(mesh, P(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
