"""Load a model for inference (serve.py, the eval CLI) from a train.py workdir or a model directory."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import jax
import jax.numpy as jnp

from laplace_jax.checkpoint import load_model, load_trained
from laplace_jax.config import ModelConfig
from laplace_jax.data.sources import tokenizer_spec
from laplace_jax.data.tokenizer import load_tokenizer
from laplace_jax.errors import UserError


def newest_workdir(root: str = "runs") -> str:
    """The most recently written train.py workdir under ``root`` (tiny's default first)."""
    candidates = [d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(os.path.join(d, "checkpoints"))]
    if not candidates:
        raise UserError(
            f"no trained checkpoint under {root}/; train one with: python train.py --config configs/tiny.py "
            "(or pass --checkpoint DIR, or a converted fla model with --tokenizer)"
        )
    return max(candidates, key=lambda d: os.path.getmtime(os.path.join(d, "checkpoints")))


def load_for_inference(
    path: str, tokenizer: str | None = None, *, exact: bool = False, step: int | None = None
) -> tuple[ModelConfig, Any, Any, str]:
    """(ModelConfig, params on one device, tokenizer, name) from a workdir (newest step, or
    ``step``) or a model directory.

    ``exact``: the ``--exact`` mode of serve.py and the eval CLI: compute in float32 (their entry
    point has called ``platform.set_exact()`` before JAX started)."""
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist; pass --checkpoint a train.py workdir or a model directory")
    try:
        if os.path.isdir(os.path.join(path, "checkpoints")):
            run_cfg, cfg, params = load_trained(path, step)
            data = run_cfg.get("data", {})
            spec = tokenizer or tokenizer_spec(data)
        else:
            if step is not None:
                raise UserError(f"--step picks a checkpoint of a train.py workdir; {path} is a model directory")
            cfg, params = load_model(path)
            spec = tokenizer
            if spec is None:
                raise UserError(
                    f"{path} is a model directory without a tokenizer; pass --tokenizer PATH/tokenizer.json"
                )
        tok = load_tokenizer(spec)
    except FileNotFoundError as e:
        raise UserError(str(e)) from e
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}")
    if exact:
        cfg = dataclasses.replace(cfg, dtype="float32")
    return cfg, params, tok, os.path.basename(os.path.normpath(path))


def cast_params(params: Any, dtype: str) -> Any:
    """Every floating weight in ``dtype``, once at load (the model casts to its compute dtype per
    use, so bf16 weights halve what each decode step reads; norms and biases included)."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
