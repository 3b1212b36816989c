"""Checkpoints (Orbax). A *model directory* holds ``config.json`` ({"model": ModelConfig fields})
and ``params/`` (an Orbax PyTree checkpoint of float32 parameters); it is what
``laplace_jax.convert`` writes and what inference code loads on one device.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from laplace_jax.config import ConfigError, ModelConfig
from laplace_jax.models.gla_lm import abstract_params


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or for another model; the message says what to do."""


def save_model(path: str, cfg: ModelConfig, params: Any) -> None:
    """Write a model directory. Refuses to overwrite an existing one."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "params")):
        raise CheckpointError(f"{path} already holds a model; choose a new output directory")
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), jax.tree.map(np.asarray, params))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model": cfg.to_dict()}, f, indent=2)


def load_model_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"{path} is not a laplace model directory: no config.json")
    with open(cfg_file) as f:
        try:
            return ModelConfig.from_mapping(json.load(f)["model"])
        except (KeyError, json.JSONDecodeError, ConfigError) as e:
            raise CheckpointError(f"{cfg_file} is not a laplace model config: {e}") from e


def load_model(path: str, device: jax.Device | None = None) -> tuple[ModelConfig, Any]:
    """Read a model directory onto one device (default: the first): (ModelConfig, params)."""
    path = os.path.abspath(path)
    cfg = load_model_config(path)
    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract_params(cfg))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(os.path.join(path, "params"), target)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"cannot restore {path}/params for the config in {path}/config.json: {e}") from e
    return cfg, params
