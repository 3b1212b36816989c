"""The typed config: one frozen dataclass per block of an ml_collections config file.

``RunConfig.from_mapping(config)`` turns the ConfigDict that ``configs/*.py`` (and absl's
``--config.x.y=`` overrides) produce into ``RunConfig(model, data, opt, train, mesh, plan)``,
checking every key, type and allowed value first, so a typo in any block fails before anything
compiles, with the field's name and what it accepts. ``defaults.base_config`` builds the
ConfigDict from these dataclasses' defaults. Model field names follow this package;
``laplace_jax.convert`` maps them to and from fla's GLAConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from laplace_jax.errors import ConfigError
from laplace_jax.ops.gla.limits import IMPLS, chunk_size_problem
from laplace_jax.platform import PEAK_BF16_TFLOPS, PRNG_IMPLS

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# model.remat -> the jax.checkpoint policy of each layer: what it keeps for its backward (the rest
# is recomputed); "none" keeps everything (no remat).
REMAT_POLICIES = {
    "full": None,  # only the layer's input; the whole layer is recomputed
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # projection / MLP matmul outputs
    "save_gla": jax.checkpoint_policies.save_only_these_names("gla_inputs", "gla_states"),  # skips the GLA re-run
}
REMAT = ("none", *REMAT_POLICIES)
COMM_DTYPES = ("float32", "bfloat16")  # the Muon all-to-all payload
ADJUST_LR = ("match_rms_adamw", "original")  # Muon's per-matrix learning-rate scale


def choice(default: str, choices: tuple[str, ...]) -> Any:
    """A string field that only takes ``choices``."""
    return dataclasses.field(default=default, metadata={"choices": choices})


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if args and type(None) in args:
        return " or ".join("None" if a is type(None) else a.__name__ for a in args)
    return getattr(hint, "__name__", str(hint))


def _coerce(where: str, value: Any, hint: Any) -> Any:
    """``value`` as type ``hint`` (ints are floats too; a list is a tuple), or a ConfigError."""
    args, declared = typing.get_args(hint), hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint)
    if ok is None and typing.get_origin(hint) is tuple:
        ok = isinstance(value, (list, tuple))
        value = tuple(value) if ok else value
    if not ok:
        raise ConfigError(f"{where} must be {_describe(declared)}; got {value!r} ({type(value).__name__})")
    return float(value) if hint is float else value


def validate_fields(obj: Any, block: str) -> None:
    """Check (and coerce) every field of the frozen dataclass ``obj`` against its type hint and
    its allowed ``choices``; errors name the field as ``block.field``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        where, value = f"{block}.{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            if not isinstance(value, hints[f.name]):
                raise ConfigError(f"{where} must be a block of {', '.join(field_names(hints[f.name]))}")
            continue
        value = _coerce(where, value, hints[f.name])
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, choices))}; got {value!r}")
        object.__setattr__(obj, f.name, value)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _positive(obj: Any, block: str, names: tuple[str, ...], minimum: float = 1) -> None:
    for name in names:
        if getattr(obj, name) < minimum:
            raise ConfigError(f"{block}.{name} must be >= {minimum}; got {getattr(obj, name)}")


class Block:
    """Base of every config block: a frozen dataclass whose fields are checked against their type
    hints and ``choices`` on construction, then by ``check`` (ranges, relations)."""

    BLOCK: typing.ClassVar[str] = ""  # the block's dotted name in the config file ("model", "data.mqar")

    def __post_init__(self) -> None:
        validate_fields(self, self.BLOCK)
        self.check()

    def check(self) -> None:
        """Ranges and relations between fields (a ConfigError names the field)."""

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> Any:
        """Built from a dict / ConfigDict block; an unknown key raises a ConfigError that suggests
        the nearest field and lists them all; nested blocks are built likewise."""
        values = dict(cfg.items())
        fields, hints = field_names(cls), typing.get_type_hints(cls)
        for key, value in values.items():
            if key not in fields:
                near = difflib.get_close_matches(key, fields, n=1)
                extra = f" Did you mean {cls.BLOCK}.{near[0]}?" if near else ""
                raise ConfigError(
                    f"unknown config key {cls.BLOCK}.{key}.{extra} Valid keys: {', '.join(sorted(fields))}"
                )
            if dataclasses.is_dataclass(hints[key]) and hasattr(value, "items"):
                values[key] = hints[key].from_mapping(value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    """Softmax attention at some layers (fla 0.6's ``AttentionSpec``, same fields and defaults):
    each listed layer's GLA mixer becomes causal softmax attention with rotary embeddings on q and
    k. layers: indices (no layer in two specs); num_heads: query heads (head_dim = d_model /
    num_heads); num_kv_heads: None for num_heads (GQA when smaller); qkv_bias: biases on the q / k /
    v projections; window_size: None for full causal attention, w for each token seeing itself and
    the w - 1 before it; rope_theta: the rotary base."""

    layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int | None = None
    qkv_bias: bool = False
    window_size: int | None = None
    rope_theta: float = 10000.0

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def to_fla(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layers": list(self.layers), "num_kv_heads": self.kv_heads}


def parse_attn(attn: Any, n_layers: int, d_model: int) -> tuple[AttnSpec, ...] | None:
    """``model.attn`` (None, a dict or a list of dicts, as fla's ``attn``; or AttnSpecs) checked as
    fla's ``parse_attention_config`` checks it, plus what the layer needs (whole heads, even
    head_dim), as a tuple of AttnSpec."""
    if attn is None:
        return None
    if isinstance(attn, AttnSpec):
        attn = [attn]
    if not isinstance(attn, (Mapping, list, tuple)):
        raise ConfigError(f"model.attn must be None, a dictionary, or a list of dictionaries; got {attn!r}")
    single = isinstance(attn, Mapping)
    specs: list[AttnSpec] = []
    assigned: dict[int, int] = {}
    for i, raw in enumerate([attn] if single else attn):
        where = "model.attn" if single else f"model.attn[{i}]"
        raw = dataclasses.asdict(raw) if isinstance(raw, AttnSpec) else raw
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a dictionary; got {raw!r}")
        raw = dict(raw)
        unknown = sorted(set(raw) - set(field_names(AttnSpec)))
        if unknown:
            raise ConfigError(f"{where} has unknown field(s) {unknown}; fields: {', '.join(field_names(AttnSpec))}")
        for name in ("layers", "num_heads"):
            if name not in raw:
                raise ConfigError(f"{where} field {name!r} is required")
        layers = raw["layers"]
        if not isinstance(layers, (list, tuple)):
            raise ConfigError(f"{where}.layers must be a list of integer layer indices; got {layers!r}")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ConfigError(f"{where}.layers must contain only integer layer indices; got {layer!r}")
            if not 0 <= layer < n_layers:
                raise ConfigError(f"{where}.layers holds layer {layer}, out of range: expected [0, {n_layers})")
            if layer in assigned:
                if assigned[layer] == i:
                    raise ConfigError(f"{where}.layers holds layer {layer} twice; got {list(layers)}")
                raise ConfigError(f"{where} assigns layer {layer}, which model.attn[{assigned[layer]}] already assigns")
            assigned[layer] = i
        for name in ("num_heads", "num_kv_heads"):
            value = raw.get(name, 1)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{where}.{name} must be a positive integer; got {value!r}")
        if not isinstance(raw.get("qkv_bias", False), bool):
            raise ConfigError(f"{where}.qkv_bias must be a Boolean; got {raw['qkv_bias']!r}")
        window = raw.get("window_size")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ConfigError(f"{where}.window_size must be None or a positive integer; got {window!r}")
        theta = raw.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ConfigError(f"{where}.rope_theta must be positive and finite; got {theta!r}")
        kv = raw.get("num_kv_heads")
        spec = AttnSpec(
            **{**raw, "layers": tuple(layers), "rope_theta": float(theta), "num_kv_heads": kv or raw["num_heads"]}
        )
        if d_model % spec.num_heads or (d_model // spec.num_heads) % 2:
            raise ConfigError(
                f"{where}.num_heads={spec.num_heads}: head_dim = d_model / num_heads must be a whole, even number "
                f"(rotary embeddings rotate pairs); d_model is {d_model}"
            )
        if spec.num_heads % spec.kv_heads:
            raise ConfigError(
                f"{where}.num_heads ({spec.num_heads}) must be a multiple of num_kv_heads ({spec.kv_heads})"
            )
        specs.append(spec)
    return tuple(specs)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Block):
    """Shape and numerics of a GLA language model (fla ``GLAForCausalLM`` semantics).

    d_model: hidden size; expand_k / expand_v: key / value width as a fraction of d_model;
    n_kv_heads: None for one kv head per query head (GQA when smaller); mlp_dim: None for
    fla's rule 256 * ceil(int(d * 8/3) / 256); chunk_size: tokens per chunk of the chunkwise
    kernel; attn_impl: "chunk" (XLA chunk kernel, every backend), "pallas" (Pallas/Triton kernel:
    GPU, interpreted on CPU), "mosaic" (Pallas TPU kernels: TPU, interpreted on CPU; in decode also
    the GLA and short-conv step kernels where they apply), "recurrent"
    (token scan, the oracle) or "auto" (per compile target: "mosaic" on TPU, "pallas" on GPU, "chunk"
    on CPU and Neuron, or "chunk" where the faster kernel does not take chunk_size); dtype: compute dtype
    (params stay float32, logits are float32); remat: what each
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
    attn_impl: str = choice("auto", IMPLS)
    dtype: str = choice("float32", tuple(DTYPES))
    remat: str = choice("none", REMAT)
    scan_layers: bool = True
    max_seq_len: int = 2048
    attn: tuple[AttnSpec, ...] | None = None
    BLOCK: typing.ClassVar[str] = "model"

    def __post_init__(self) -> None:
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if isinstance(self.n_layers, int) and isinstance(self.d_model, int):
            object.__setattr__(self, "attn", parse_attn(self.attn, self.n_layers, self.d_model))
        super().__post_init__()

    def attn_spec(self, layer: int) -> AttnSpec | None:
        """The softmax attention spec of ``layer``, or None for a GLA layer."""
        return next((spec for spec in self.attn or () if layer in spec.layers), None)

    def check(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "conv_size", "gate_low_rank_dim", "chunk_size")
        _positive(self, "model", positive)
        kernel = {"auto": "chunk", "recurrent": None}.get(self.attn_impl, self.attn_impl)  # auto falls back to chunk
        if kernel is not None and (problem := chunk_size_problem(kernel, self.chunk_size)) is not None:
            raise ConfigError(f"model.attn_impl={self.attn_impl!r}: {problem}")
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


@dataclasses.dataclass(frozen=True)
class MqarConfig(Block):
    """The synthetic recall mixture: key-value pairs per training window, uniform in [min_pairs, max_pairs]."""

    min_pairs: int = 4
    max_pairs: int = 24
    BLOCK: typing.ClassVar[str] = "data.mqar"

    def check(self) -> None:
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ConfigError(f"data.mqar needs 1 <= min_pairs <= max_pairs; got {self.min_pairs}, {self.max_pairs}")


def parse_sources(entries: tuple[str, ...]) -> list[tuple[str, float]]:
    """``("data/fw=0.9", "mqar=0.1")`` -> [(location, weight)]; a bare location weighs 1."""
    parsed = []
    for entry in entries:
        where, sep, weight = entry.rpartition("=")
        if not sep:
            where, weight = entry, "1"
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"data.sources entry {entry!r}: the weight after '=' must be a number") from None
        if not where or not w > 0:
            raise ConfigError(f"data.sources entry {entry!r} must be PATH=WEIGHT with a weight > 0 (or mqar=WEIGHT)")
        parsed.append((where, w))
    return parsed


@dataclasses.dataclass(frozen=True)
class DataConfig(Block):
    """Where the tokens come from. source: "text" (``path``, or the embedded stdlib corpus when
    ``path`` is "") or "mqar" (the synthetic recall mixture); path: a dataset written by
    ``laplace_jax.data.prepare`` (a directory or a tensorstore URL: gs://, s3://); sources: a
    weighted mixture instead, entries "PATH=WEIGHT" (prepared datasets) or "mqar=WEIGHT", e.g.
    ("data/fineweb=0.9", "mqar=0.1"); tokenizer: for the embedded corpus and mqar ("byte" or a
    tokenizer.json path; prepared data records its own); seq_len: tokens per training window;
    global_batch: windows per step, all devices; eval_batches: batches per evaluation;
    embedded_max_chars: how much of the embedded corpus to tokenize."""

    source: str = choice("text", ("text", "mqar"))
    path: str = ""
    sources: tuple[str, ...] = ()
    tokenizer: str = "byte"
    seq_len: int = 256
    global_batch: int = 16
    seed: int = 0
    eval_batches: int = 4
    embedded_max_chars: int = 3_000_000
    mqar: MqarConfig = dataclasses.field(default_factory=MqarConfig)
    BLOCK: typing.ClassVar[str] = "data"

    def check(self) -> None:
        _positive(self, "data", ("seq_len", "global_batch", "eval_batches", "embedded_max_chars"))
        if self.sources and (self.path or self.source != "text"):
            raise ConfigError("data.sources is a mixture on its own: leave data.path empty and data.source 'text'")
        parse_sources(self.sources)


@dataclasses.dataclass(frozen=True)
class OptConfig(Block):
    """Optimizer and learning-rate schedule. optimizer: "muon" (Muon on hidden matrices, AdamW on
    the rest) or "adamw"; schedule: "cosine" (linear warmup, cosine to min_lr_ratio * lr) or "wsd"
    (warmup, stable, then a linear decay over the last decay_fraction of the steps); beta, nesterov,
    adjust_lr: Muon's momentum and per-matrix scale; b1, b2, eps: AdamW's; clip_norm: global-norm
    clipping; comm_dtype: the Muon all-to-all payload ("bfloat16" halves its bytes)."""

    optimizer: str = choice("muon", ("muon", "adamw"))
    lr: float = 3e-3
    schedule: str = choice("cosine", ("cosine", "wsd"))
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta: float = 0.95
    nesterov: bool = True
    adjust_lr: str = choice("match_rms_adamw", ADJUST_LR)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    comm_dtype: str = choice("float32", COMM_DTYPES)
    BLOCK: typing.ClassVar[str] = "opt"

    def check(self) -> None:
        _positive(self, "opt", ("warmup_steps", "weight_decay"), minimum=0)
        for name in ("lr", "eps", "clip_norm"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"opt.{name} must be > 0; got {getattr(self, name)}")
        for name in ("min_lr_ratio", "decay_fraction", "beta", "b1", "b2"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"opt.{name} must be in [0, 1]; got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Block):
    """The training loop. grad_accum: micro-batches per step; log_every / eval_every / ckpt_every:
    intervals in steps (eval_every 0: only at the end); keep_checkpoints: how many to keep;
    max_nonfinite: stop after this many non-finite steps in a row; peak_tflops: per-device peak
    for MFU (0: the platform table; CPU: a measured matmul); device_memory_gib: per-device memory
    for the fit check (0: ask the device); prng_impl: "auto" is rbg on Neuron, threefry2x32 elsewhere."""

    steps: int = 300
    grad_accum: int = 1
    log_every: int = 10
    eval_every: int = 100
    ckpt_every: int = 100
    keep_checkpoints: int = 3
    max_nonfinite: int = 5
    peak_tflops: float = 0.0
    device_memory_gib: float = 0.0
    prng_impl: str = choice("auto", PRNG_IMPLS)
    BLOCK: typing.ClassVar[str] = "train"

    def check(self) -> None:
        at_least_one = ("steps", "grad_accum", "log_every", "ckpt_every", "keep_checkpoints", "max_nonfinite")
        _positive(self, "train", at_least_one)
        _positive(self, "train", ("eval_every", "peak_tflops", "device_memory_gib"), minimum=0)


# Logical axis -> mesh axis. Flax assigns each mesh axis once per array, first rule first, so
# every hidden matrix has exactly one of its two axes on "fsdp"; Muon reads which from the specs.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "fsdp"),
    ("mlp", "fsdp"),
    ("vocab", "fsdp"),
    ("layers", None),
    ("length", None),
    ("act_embed", None),
    ("act_vocab", None),
    ("norm", None),
    ("rank", None),
    ("conv", None),
    ("context", "context"),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig(Block):
    """The (data, fsdp, context) device mesh: axis sizes and the logical axis rules that bind the
    model's axis names to it (model code names no mesh axis). ``data`` and ``fsdp`` split a
    batch's rows (fsdp shards the parameters too; -1: all remaining devices); ``context`` splits
    each sequence into that many consecutive slices, one per device (context parallelism: the
    train step's per-device activations shrink by that factor; data.seq_len must be a multiple of
    context x model.chunk_size)."""

    data: int = 1
    fsdp: int = -1
    context: int = 1
    rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES
    BLOCK: typing.ClassVar[str] = "mesh"

    def check(self) -> None:
        for name in ("data", "fsdp"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise ConfigError(f"mesh.{name} must be a positive size or -1 (the rest); got {getattr(self, name)}")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("mesh.data and mesh.fsdp cannot both be -1")
        _positive(self, "mesh", ("context",))
        for rule in self.rules:
            if len(rule) != 2 or not isinstance(rule[0], str):
                raise ConfigError(f"mesh.rules holds (logical name, mesh axis or axes or None) pairs; got {rule!r}")
        object.__setattr__(
            self, "rules", tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in self.rules)
        )


@dataclasses.dataclass(frozen=True)
class PlanConfig(Block):
    """The target hardware of ``train.py --plan``'s time-and-cost estimate; by default one logical
    NeuronCore (LNC=2) of a trn2.48xlarge, from AWS's Trainium2 specifications (sources in
    docs/training.md): a chip has 667 dense bf16 TFLOP/s and 1.28 TB/s of NeuronLink-v3 and is four
    logical cores; an instance is 16 chips = 64 logical cores. usd_per_instance_hour 0: the
    estimate gives instance-hours only."""

    name: str = "trn2.48xlarge (LNC=2)"
    peak_tflops_per_device: float = PEAK_BF16_TFLOPS["Trainium2"][0]
    interconnect_gbps_per_device: float = 1280.0 / 4
    devices_per_instance: int = 64
    usd_per_instance_hour: float = 0.0
    BLOCK: typing.ClassVar[str] = "plan"

    def check(self) -> None:
        for name in ("peak_tflops_per_device", "interconnect_gbps_per_device", "devices_per_instance"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"plan.{name} must be > 0; got {getattr(self, name)}")
        _positive(self, "plan", ("usd_per_instance_hour",), minimum=0)


@dataclasses.dataclass(frozen=True)
class RunConfig(Block):
    """A whole run: ``model``, ``data``, ``opt``, ``train``, ``mesh`` and ``plan`` blocks."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    opt: OptConfig = dataclasses.field(default_factory=OptConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    BLOCK: typing.ClassVar[str] = "config"

    def check(self) -> None:
        cp, chunk, seq = self.mesh.context, self.model.chunk_size, self.data.seq_len
        if cp == 1:
            return
        if seq % (cp * chunk):
            raise ConfigError(
                f"mesh.context={cp} splits each sequence into {cp} slices of whole chunks, so data.seq_len ({seq}) "
                f"must be a multiple of context x model.chunk_size = {cp * chunk}; "
                f"e.g. data.seq_len={max(1, round(seq / (cp * chunk))) * cp * chunk}"
            )
        if self.model.use_short_conv and seq // cp < self.model.conv_size:
            raise ConfigError(
                f"each slice ({seq // cp} tokens) must hold at least model.conv_size={self.model.conv_size} tokens"
            )
        if self.model.attn_impl == "recurrent":
            raise ConfigError(
                "mesh.context > 1 runs the chunk kernels; set model.attn_impl to chunk, pallas, mosaic or auto"
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> RunConfig:
        """The typed config of a ConfigDict (a file's ``get_config()``, overrides applied) or of a
        dict (a checkpoint's saved config); every block is checked."""
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg
        if "model" not in cfg:
            raise ConfigError("the config has no 'model' block; see configs/tiny.py for the layout")
        return super().from_mapping(cfg)


def load_config_file(path: str) -> Any:
    """Load an ml_collections config file (``configs/x.py`` or ``configs/x.py:arg``) outside absl."""
    file, _, arg = path.partition(":")
    if not os.path.isfile(file):
        raise ConfigError(f"config file {file!r} does not exist (expected e.g. configs/tiny.py)")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def load_run_config(path: str) -> RunConfig:
    """The checked RunConfig of a config file (``configs/x.py`` or ``configs/x.py:arg``)."""
    return RunConfig.from_mapping(load_config_file(path))
