"""Checkpoints (Orbax); this module owns every read and write of model state.

* A *model directory* holds ``config.json`` ({"model": ModelConfig fields}) and ``params/``
  (float32 parameters): what ``laplace_jax.convert`` writes and inference loads on one device.
* A *training workdir* holds ``checkpoints/<step>/`` written by ``TrainCheckpointer``: one
  Orbax CheckpointManager (async, keep-N, interval) with three items: ``state`` (params,
  optimizer state, step, counters), ``data`` (the grain iterator position) and ``config`` (the
  full run config as JSON). Orbax finalises a step directory only when every item is written,
  so an interrupted save is never restored.
"""

from __future__ import annotations

import json
import os
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from laplace_jax.config import ModelConfig
from laplace_jax.errors import CheckpointError, ConfigError
from laplace_jax.models.gla_lm import abstract_params


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


def _on_one_device(cfg: ModelConfig, device: jax.Device | None) -> Any:
    """Abstract parameters of ``cfg`` placed on ``device`` (default: the first): a restore target."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract_params(cfg))


def load_model(path: str, device: jax.Device | None = None) -> tuple[ModelConfig, Any]:
    """Read a model directory onto one device (default: the first): (ModelConfig, params)."""
    path = os.path.abspath(path)
    cfg = load_model_config(path)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(os.path.join(path, "params"), _on_one_device(cfg, device))
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"cannot restore {path}/params for the config in {path}/config.json: {e}") from e
    return cfg, params


class TrainCheckpointer:
    """Save / restore training state under ``workdir/checkpoints``."""

    def __init__(self, workdir: str, keep: int = 3, every: int = 100):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every, create=True)
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def saved_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def save(self, step: int, state: Any, data_iter: Any, config: dict, force: bool = False) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iter),
            config=ocp.args.JsonSave(config),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
        """State onto the shardings in ``abstract_state``; ``data_iter`` is moved to the saved position."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iter)
        )
        return self.manager.restore(step, args=args)["state"]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters, onto the shardings in ``abstract_params`` (e.g. one device)."""
        item = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def load_trained(
    workdir: str, step: int | None = None, device: jax.Device | None = None
) -> tuple[dict, ModelConfig, Any]:
    """(run config dict, ModelConfig, params on one device) from a train.py workdir (newest step by default)."""
    ckpt = TrainCheckpointer(workdir)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(
            f"no checkpoint in {workdir}; train one first: python train.py --config configs/tiny.py --workdir {workdir}"
        )
    run_cfg = ckpt.saved_config(step)
    cfg = ModelConfig.from_mapping(run_cfg["model"])
    params = ckpt.restore_params(step, _on_one_device(cfg, device))
    ckpt.close()
    return run_cfg, cfg, params
