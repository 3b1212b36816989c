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

DATA, FSDP = "data", "fsdp"  # the mesh axes: pure data parallelism, and FSDP (parameters sharded too)
AXES = (DATA, FSDP)


def make_mesh(mesh_cfg: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp) mesh over ``devices`` (default: all); -1 takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    data, fsdp = mesh_cfg.data, mesh_cfg.fsdp
    if data == -1:
        data = n // fsdp if fsdp > 0 and n % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = n // data if data > 0 and n % data == 0 else 0
    if data <= 0 or fsdp <= 0 or data * fsdp != n:
        raise UserError(
            f"mesh data={mesh_cfg.data} x fsdp={mesh_cfg.fsdp} does not fit the {n} available device(s) "
            f"({devices[0].platform}); set --config.mesh.fsdp / --config.mesh.data so their product is {n}, "
            "or use --plan to compile for a larger machine on fake CPU devices"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, fsdp)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def param_specs(cfg: ModelConfig, rule_set: tuple) -> Any:
    """PartitionSpecs (mesh axes) for every parameter."""
    return nn.logical_to_mesh(param_logical_axes(cfg), rule_set)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rule_set: tuple) -> Any:
    specs = param_specs(cfg, rule_set)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches [B, ...] split over every device (data x fsdp)."""
    return NamedSharding(mesh, P(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
