"""Find and load what serve.py serves: a train.py workdir or a model directory (e.g. converted fla)."""

from __future__ import annotations

import glob
import os
from typing import Any

import jax
import jax.numpy as jnp

from laplace_jax.checkpoint import CheckpointError, load_model, load_trained
from laplace_jax.cli import UserError
from laplace_jax.config import ModelConfig
from laplace_jax.data.store import read_meta
from laplace_jax.data.tokenizer import load_tokenizer


def newest_workdir(root: str = "runs") -> str:
    """The most recently written train.py workdir under ``root`` (tiny's default first)."""
    candidates = [d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(os.path.join(d, "checkpoints"))]
    if not candidates:
        raise UserError(
            f"no trained checkpoint under {root}/; train one with: python train.py --config configs/tiny.py "
            "(or pass --checkpoint DIR, or a converted fla model with --tokenizer)"
        )
    return max(candidates, key=lambda d: os.path.getmtime(os.path.join(d, "checkpoints")))


def load_for_serving(path: str, tokenizer: str | None = None) -> tuple[ModelConfig, Any, Any, str]:
    """(ModelConfig, params on one device, tokenizer, name) from a workdir or a model directory."""
    try:
        if os.path.isdir(os.path.join(path, "checkpoints")):
            run_cfg, cfg, params = load_trained(path)
            data = run_cfg.get("data", {})
            spec = tokenizer or (read_meta(data["path"])["tokenizer"] if data.get("path") else data.get("tokenizer"))
        else:
            cfg, params = load_model(path)
            spec = tokenizer
            if spec is None:
                raise UserError(
                    f"{path} is a model directory without a tokenizer; pass --tokenizer PATH/tokenizer.json"
                )
        tok = load_tokenizer(spec)
    except (CheckpointError, FileNotFoundError) as e:
        raise UserError(str(e)) from e
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer has {tok.vocab_size} ids but the model only {cfg.vocab_size}")
    return cfg, params, tok, os.path.basename(os.path.normpath(path))


def cast_params(params: Any, dtype: str) -> Any:
    """Every floating weight in ``dtype``, once at load (the model casts to its compute dtype per
    use, so bf16 weights halve what each decode step reads; norms and biases included)."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
