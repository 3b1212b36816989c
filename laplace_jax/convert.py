"""Import and export flash-linear-attention GLA checkpoints (``save_pretrained`` directories).

    python -m laplace_jax.convert from-fla FLA_DIR OUT_DIR            # fla (sharded or not) -> laplace model
    python -m laplace_jax.convert to-fla RUN_OR_MODEL OUT_DIR [--step N]
                                                                      # a train.py run or model directory -> fla

An export from a run (or with ``--tokenizer``) is a Hugging Face model directory: tokenizer files,
token ids, a generation config and ``auto_map`` to fla's classes (``hf_files``), so
``AutoTokenizer`` and ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` load it.

An fla directory holds ``config.json`` (model_type "gla"; with ``attn``, a hybrid whose listed
layers are fla ``Attention``) and ``model.safetensors`` (or shards with
``model.safetensors.index.json``). torch Linear weights are [out, in]; ours are [in, out];
conv weights are [D, 1, W] in torch and [W, D] here; layer weights are stacked on axis 0 (per
group of layers in a hybrid: ``models.layout``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from laplace_jax import checkpoint
from laplace_jax.config import ModelConfig
from laplace_jax.errors import CheckpointFormatError, ConfigError, UserError
from laplace_jax.hf_files import write_hf_files
from laplace_jax.loading import load_for_inference
from laplace_jax.models.gla_lm import abstract_params, count_params, layer_weights, stack_layers

# fla GLAConfig key -> ModelConfig field.
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_heads": "n_heads",
    "num_kv_heads": "n_kv_heads",
    "expand_k": "expand_k",
    "expand_v": "expand_v",
    "intermediate_size": "mlp_dim",
    "hidden_ratio": "hidden_ratio",
    "use_short_conv": "use_short_conv",
    "conv_size": "conv_size",
    "norm_eps": "norm_eps",
    "clamp_min": "clamp_min",
    "tie_word_embeddings": "tie_embeddings",
    "initializer_range": "init_std",
    "max_position_embeddings": "max_seq_len",
    "gate_logit_normalizer": "gate_logit_normalizer",
    "gate_low_rank_dim": "gate_low_rank_dim",
}
# Options whose other values change the architecture in ways this package does not implement.
_REQUIRED = {
    "feature_map": None,
    "use_gk": True,
    "use_gv": False,
    "use_output_gate": True,
    "hidden_act": "swish",
    "elementwise_affine": True,
    "conv_bias": False,
}
_LINEARS = {
    "attn.q_proj": "attn/q_proj",
    "attn.k_proj": "attn/k_proj",
    "attn.v_proj": "attn/v_proj",
    "attn.g_proj": "attn/g_proj",
    "attn.o_proj": "attn/o_proj",
    "attn.gk_proj.0": "attn/gk_proj_0",
    "attn.gk_proj.1": "attn/gk_proj_1",
    "mlp.gate_proj": "mlp/gate_proj",
    "mlp.up_proj": "mlp/up_proj",
    "mlp.down_proj": "mlp/down_proj",
}
# A hybrid's softmax attention layer (fla ``Attention``): the same names without the gates;
# q / k / v carry biases with qkv_bias.
_ATTN_LINEARS = {k: v for k, v in _LINEARS.items() if k not in ("attn.g_proj", "attn.gk_proj.0", "attn.gk_proj.1")}
_ATTN_BIASES = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
_GAINS = {"attn_norm": "attn_norm", "mlp_norm": "mlp_norm"}
# The output gate's RMSNorm: fla names it "g_norm_swish_gate" (FusedRMSNormGated) when
# fuse_norm=True (its default) and "g_norm" (RMSNorm, then * swish(g)) when fuse_norm=False; the
# weight and the math are the same. Import takes whichever the checkpoint has; export writes the
# default name and fuse_norm=True.
_GATE_NORMS = ("attn.g_norm_swish_gate", "attn.g_norm")
_GATE_NORM_OURS = "attn/g_norm_swish_gate"
# fla 0.6 GLAConfig flags audited for parameter names: fuse_norm (above); use_short_conv (the
# q/k/v_conv1d tensors); attn (hybrid softmax layers: _ATTN_LINEARS at the layers it lists);
# conv_bias, use_output_gate=False, elementwise_affine=False, feature_map, use_gk/use_gv change
# names or the math and are refused by name (_REQUIRED); tie_word_embeddings drops lm_head;
# num_kv_heads changes shapes only; fuse_swiglu, fuse_cross_entropy, fuse_linear_cross_entropy,
# use_l2warp change kernels, not parameters.
_CONVS = ("q", "k", "v")


def config_from_fla(fla: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from an fla config.json dict; unsupported options raise CheckpointFormatError."""
    if fla.get("model_type") != "gla":
        raise CheckpointFormatError(
            f"config.json has model_type {fla.get('model_type')!r}; only 'gla' models are supported"
        )
    for key, want in _REQUIRED.items():
        if key in fla and fla[key] != want:
            raise CheckpointFormatError(
                f"config.json sets {key}={fla[key]!r}; laplace_jax implements only {key}={want!r} (fla's GLA default)"
            )
    fields = {ours: fla[theirs] for theirs, ours in _CONFIG_KEYS.items() if theirs in fla}
    if fla.get("attn") is not None:
        fields["attn"] = fla["attn"]
    try:
        return ModelConfig(**{**fields, **overrides})
    except (ConfigError, TypeError) as e:
        raise CheckpointFormatError(f"config.json describes a model laplace_jax cannot build: {e}") from e


def config_to_fla(cfg: ModelConfig) -> dict[str, Any]:
    out = {"model_type": "gla", "architectures": ["GLAForCausalLM"], "attn_mode": "chunk"}
    out.update({theirs: getattr(cfg, ours) for theirs, ours in _CONFIG_KEYS.items()})
    out.update(_REQUIRED)
    out["fuse_norm"] = True  # names the gate norm "g_norm_swish_gate", as exported
    specs = [spec.to_fla() for spec in cfg.attn or ()]
    out["attn"] = None if not specs else specs[0] if len(specs) == 1 else specs  # fla's dict form for one spec
    return out


class LazyStateDict(Mapping[str, np.ndarray]):
    """Tensor name -> numpy array, read from its safetensors file only when asked (safetensors'
    memory-mapped reader): an import holds one source tensor at a time, not every shard."""

    def __init__(self, files: list[str]):
        self._where: dict[str, str] = {}
        for path in files:
            try:
                with safe_open(path, framework="numpy") as f:
                    self._where.update(dict.fromkeys(f.keys(), path))
            except (OSError, SafetensorError) as e:
                raise CheckpointFormatError(f"{path} is not a readable safetensors file: {e}") from e

    def __getitem__(self, key: str) -> np.ndarray:
        path = self._where[key]
        try:
            with safe_open(path, framework="numpy") as f:
                return f.get_tensor(key)
        except (OSError, SafetensorError) as e:
            raise CheckpointFormatError(f"{path}: tensor {key!r} cannot be read: {e}") from e

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_state_dict(path: str) -> LazyStateDict:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        raise CheckpointFormatError(
            f"{path} holds pytorch_model.bin; re-save it with save_pretrained(safe_serialization=True)"
        )
    else:
        raise CheckpointFormatError(f"{path} has no model.safetensors or model.safetensors.index.json")
    return LazyStateDict([os.path.join(path, name) for name in files])


def _node(tree: dict, path: str, create: bool = False) -> dict:
    """The subtree at ``path`` ("attn/q_proj") of one layer's weights (made on the way with ``create``)."""
    for part in path.split("/"):
        tree = tree.setdefault(part, {}) if create else tree[part]
    return tree


def _layer_from_fla(cfg: ModelConfig, i: int, take, has) -> dict:
    """Layer ``i``'s weights ([in, out], unstacked) from fla tensor names."""
    pre = f"model.layers.{i}."
    layer: dict[str, Any] = {}

    def put(path: str, leaf: str, value: np.ndarray) -> None:
        _node(layer, path, create=True)[leaf] = value

    spec = cfg.attn_spec(i)
    for theirs, ours in (_LINEARS if spec is None else _ATTN_LINEARS).items():
        put(ours, "kernel", take(pre + theirs + ".weight").T)
    for theirs, ours in _GAINS.items():
        put(ours, "weight", take(pre + theirs + ".weight"))
    if spec is not None:
        if spec.qkv_bias:
            for theirs in _ATTN_BIASES:
                put(_ATTN_LINEARS[theirs], "bias", take(pre + theirs + ".bias"))
        return layer
    put("attn/gk_proj_1", "bias", take(pre + "attn.gk_proj.1.bias"))
    present = [n for n in _GATE_NORMS if has(pre + n + ".weight")]
    if len(present) > 1:
        raise CheckpointFormatError(f"checkpoint has both {present[0]} and {present[1]} weights; expected one of them")
    gate_norm = present[0] if present else _GATE_NORMS[0]  # missing: the error names fla's default
    put(_GATE_NORM_OURS, "weight", take(pre + gate_norm + ".weight"))
    if cfg.use_short_conv:
        for c in _CONVS:
            put(f"attn/{c}_conv1d", "kernel", take(pre + f"attn.{c}_conv1d.weight")[:, 0, :].T)
    return layer


def params_from_state_dict(cfg: ModelConfig, sd: Mapping[str, np.ndarray]) -> dict:
    """fla state_dict (numpy, any float dtype; a ``LazyStateDict`` is read tensor by tensor) ->
    laplace params (float32 numpy, [in, out], stacked per group of layers: ``models.layout``)."""
    used: set[str] = set()

    def take(key: str) -> np.ndarray:
        if key not in sd:
            raise CheckpointFormatError(f"checkpoint is missing tensor {key!r} required by its config.json")
        used.add(key)
        return np.asarray(sd[key], np.float32)

    layers = [_layer_from_fla(cfg, i, take, sd.__contains__) for i in range(cfg.n_layers)]
    params = {
        "embeddings": {"embedding": take("model.embeddings.weight")},
        **stack_layers(cfg, layers),
        "norm": {"weight": take("model.norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": take("lm_head.weight").T}
    leftover = sorted(set(sd) - used)
    if leftover:
        raise CheckpointFormatError(
            f"checkpoint has {len(leftover)} tensors its config does not explain (first: {leftover[:3]}); "
            "the config.json and weights disagree or the model uses an unsupported option"
        )
    _check_shapes(cfg, params)
    return params


def _check_shapes(cfg: ModelConfig, params: dict) -> None:
    want = abstract_params(cfg)
    got_paths = {jax.tree_util.keystr(p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(params)}
    for path, ref in jax.tree_util.tree_leaves_with_path(want):
        key = jax.tree_util.keystr(path)
        if got_paths.get(key) != ref.shape:
            raise CheckpointFormatError(
                f"parameter {key}: checkpoint shape {got_paths.get(key)} != config shape {ref.shape}"
            )


def params_to_state_dict(cfg: ModelConfig, params: dict, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """laplace params -> fla state_dict (numpy in ``dtype``, torch layouts)."""
    p = params
    sd = {"model.embeddings.weight": np.asarray(p["embeddings"]["embedding"], np.float32)}
    for i in range(cfg.n_layers):
        lay = layer_weights(cfg, p, i)
        get = lambda path, leaf, lay=lay: np.asarray(_node(lay, path)[leaf], np.float32)  # noqa: E731
        pre = f"model.layers.{i}."
        spec = cfg.attn_spec(i)
        for theirs, ours in (_LINEARS if spec is None else _ATTN_LINEARS).items():
            sd[pre + theirs + ".weight"] = get(ours, "kernel").T
        for theirs, ours in _GAINS.items():
            sd[pre + theirs + ".weight"] = get(ours, "weight")
        if spec is not None:
            for theirs in _ATTN_BIASES if spec.qkv_bias else ():
                sd[pre + theirs + ".bias"] = get(_ATTN_LINEARS[theirs], "bias")
            continue
        sd[pre + "attn.gk_proj.1.bias"] = get("attn/gk_proj_1", "bias")
        sd[pre + _GATE_NORMS[0] + ".weight"] = get(_GATE_NORM_OURS, "weight")
        if cfg.use_short_conv:
            for c in _CONVS:
                sd[pre + f"attn.{c}_conv1d.weight"] = get(f"attn/{c}_conv1d", "kernel").T[:, None, :]
    sd["model.norm.weight"] = np.asarray(p["norm"]["weight"], np.float32)
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = np.asarray(p["lm_head"]["kernel"], np.float32).T
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in sd.items()}


def load_fla(path: str, **overrides: Any) -> tuple[ModelConfig, dict]:
    """Read an fla GLA ``save_pretrained`` directory: (ModelConfig, float32 numpy params).

    ``overrides`` set ModelConfig fields fla does not store (e.g. dtype, chunk_size).
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointFormatError(f"{path} is not an fla checkpoint directory: no config.json")
    try:
        with open(cfg_file) as f:
            fla = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{cfg_file} is not valid JSON: {e}") from e
    cfg = config_from_fla(fla, **overrides)
    return cfg, params_from_state_dict(cfg, _read_state_dict(path))


def save_fla(path: str, cfg: ModelConfig, params: dict, dtype: Any = np.float32) -> None:
    """Write ``config.json`` + ``model.safetensors`` in fla's ``save_pretrained`` layout."""
    os.makedirs(path, exist_ok=True)
    save_file(params_to_state_dict(cfg, params, dtype), os.path.join(path, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_fla(cfg), f, indent=2)


def _export_source(src: str, step: int | None, tokenizer: str | None):
    """(cfg, params, tokenizer or None) of a train.py workdir or a laplace model directory."""
    if os.path.isdir(os.path.join(src, "checkpoints")) or tokenizer is not None:
        cfg, params, tok, _ = load_for_inference(src, tokenizer, step=step)
        return cfg, params, tok
    if step is not None:
        raise UserError(f"--step picks a checkpoint of a train.py workdir; {src} is a model directory")
    return (*checkpoint.load_model(src), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.convert", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("from-fla", help="fla save_pretrained directory -> laplace model directory")
    a.add_argument("src")
    a.add_argument("out")
    a.add_argument("--dtype", default="float32", help="compute dtype recorded in the model config")
    b = sub.add_parser("to-fla", help="train.py run or laplace model directory -> fla / Hugging Face directory")
    b.add_argument("src", help="a train.py workdir (newest checkpoint, or --step) or a laplace model directory")
    b.add_argument("out")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="stored weight dtype")
    b.add_argument("--step", type=int, default=None, help="checkpoint step of a workdir (default: the newest)")
    b.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json (default: the run's own)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "from-fla":
            cfg, params = load_fla(args.src, dtype=args.dtype)
            checkpoint.save_model(args.out, cfg, params)
        else:
            cfg, params, tok = _export_source(args.src, args.step, args.tokenizer)
            save_fla(args.out, cfg, params, np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32))
            if tok is None:
                print(f"note: {args.src} names no tokenizer; pass --tokenizer to add tokenizer files")
            else:
                write_hf_files(args.out, cfg, tok)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({count_params(params):,} parameters, {cfg.n_layers} layers, d_model {cfg.d_model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
