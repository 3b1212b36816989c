"""Model configuration: a frozen dataclass built from the ``model`` block of an ml_collections config.

Field names follow this package; ``laplace_jax.convert`` maps them to and from fla's GLAConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from laplace_jax.errors import ConfigError

SUB_BLOCK = 16  # rows of the GLA kernels' exact-decay sub-blocks (the smallest side a Triton dot takes)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTN_IMPLS = ("chunk", "pallas", "recurrent", "auto")
# What a layer keeps for its backward (the rest is recomputed); see models/gla_lm.py REMAT_POLICIES.
REMAT = ("none", "full", "save_dots", "save_gla")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a GLA language model (fla ``GLAForCausalLM`` semantics).

    d_model: hidden size; expand_k / expand_v: key / value width as a fraction of d_model;
    n_kv_heads: None for one kv head per query head (GQA when smaller); mlp_dim: None for
    fla's rule 256 * ceil(int(d * 8/3) / 256); chunk_size: tokens per chunk of the chunkwise
    kernel; attn_impl: "chunk" (XLA chunk kernel, every backend), "pallas" (Pallas/Triton kernel:
    GPU, interpreted on CPU), "recurrent" (token scan, the oracle) or "auto" ("pallas" on GPU,
    "chunk" elsewhere); dtype: compute dtype (params stay float32, logits are float32); remat: what each
    layer keeps for the backward: "none" (everything), "full" (only its input), "save_dots"
    (matmul outputs), "save_gla" (the GLA kernel's inputs and chunk states). True / False are
    read as "full" / "none" (older configs); scan_layers: False unrolls the layer loop (same
    parameters; longer compiles, and XLA's cost analysis then counts every layer).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int | None = None
    expand_k: float = 0.5
    expand_v: float = 1.0
    mlp_dim: int | None = None
    hidden_ratio: float = 4.0
    use_short_conv: bool = False
    conv_size: int = 4
    norm_eps: float = 1e-6
    gate_logit_normalizer: float = 16.0
    gate_low_rank_dim: int = 16
    clamp_min: float | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    chunk_size: int = 128
    attn_impl: str = "chunk"
    dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = True
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT:
            raise ConfigError(f"model.remat must be one of {', '.join(REMAT)}; got {self.remat!r}")
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "conv_size", "gate_low_rank_dim", "chunk_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive; got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"model.attn_impl must be one of {', '.join(ATTN_IMPLS)}; got {self.attn_impl!r}")
        if self.attn_impl in ("pallas", "auto") and self.chunk_size % SUB_BLOCK:
            raise ConfigError(
                f"model.attn_impl={self.attn_impl!r} needs model.chunk_size a multiple of {SUB_BLOCK}; "
                f"got {self.chunk_size}"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})"
            )
        for name, width in (("expand_k", self.key_dim), ("expand_v", self.value_dim)):
            if width % self.n_heads:
                raise ConfigError(
                    f"model.{name}: width {width} = round(d_model * {name}) is not divisible by n_heads {self.n_heads}"
                )

    # Derived shapes (fla's rules).
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def key_dim(self) -> int:
        return int(self.d_model * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.d_model * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.n_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.n_heads

    @property
    def kv_groups(self) -> int:
        return self.n_heads // self.kv_heads

    @property
    def intermediate_size(self) -> int:
        if self.mlp_dim is not None:
            return self.mlp_dim
        return 256 * math.ceil(int(self.d_model * self.hidden_ratio * 2 / 3) / 256)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any], where: str = "model") -> ModelConfig:
        """Build from a dict / ConfigDict; unknown keys raise ConfigError with a suggestion."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = dict(cfg.items())
        for key in values:
            if key not in fields:
                hint = difflib.get_close_matches(key, fields, n=1)
                extra = f" Did you mean {where}.{hint[0]}?" if hint else ""
                raise ConfigError(f"Unknown config key {where}.{key}.{extra} Valid keys: {', '.join(sorted(fields))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config_file(path: str) -> Any:
    """Load an ml_collections config file (``configs/x.py`` or ``configs/x.py:arg``) outside absl."""
    file, _, arg = path.partition(":")
    if not os.path.isfile(file):
        raise ConfigError(f"config file {file!r} does not exist (expected e.g. configs/tiny.py)")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def model_config(cfg: Any) -> ModelConfig:
    """The ModelConfig of a full config (a ConfigDict with a ``model`` block)."""
    if "model" not in cfg:
        raise ConfigError("the config has no 'model' block; see configs/tiny.py for the layout")
    block = cfg.model
    return ModelConfig.from_mapping(block.to_dict() if hasattr(block, "to_dict") else block)
