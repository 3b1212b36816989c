"""The full config layout with defaults, as the ml_collections ConfigDict that every
``configs/*.py`` starts from (``base_config()``) and that absl's ``--config.x.y=`` overrides edit.

Built from ``laplace_jax.config``'s typed blocks, which hold the defaults and what each field means:

model  ModelConfig   data  DataConfig (mqar: MqarConfig)   opt  OptConfig
train  TrainConfig   mesh  MeshConfig                      plan PlanConfig (--plan's target hardware)
"""

from __future__ import annotations

import dataclasses
import typing

from ml_collections import config_dict

from laplace_jax.config import RunConfig


def _as_config_dict(block: typing.Any) -> config_dict.ConfigDict:
    """A ConfigDict of a config block's values; a None default becomes a typed placeholder, so the
    command line can still set it."""
    out = config_dict.ConfigDict()
    hints = typing.get_type_hints(type(block))
    for f in dataclasses.fields(block):
        value = getattr(block, f.name)
        if dataclasses.is_dataclass(value):
            value = _as_config_dict(value)
        elif value is None:
            (kind,) = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            # a structured field (model.attn: a dict or list of dicts) stays an untyped None
            value = config_dict.placeholder(kind) if kind in (bool, int, float, str) else None
        setattr(out, f.name, value)
    return out


def base_config() -> config_dict.ConfigDict:
    """Every block at its defaults."""
    return _as_config_dict(RunConfig())
