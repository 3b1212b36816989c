"""Model facts without allocating anything: parameters, per-sequence state, KV-cache comparison.

    python -m laplace_jax.info --config configs/3b.py [--json] [--kv_tokens 8192]
    python -m laplace_jax.info --config configs/3b.py --devices 64 --muon   # Muon traffic report

Counts come from the abstract parameter and state trees (jax.eval_shape), dtypes included.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jax
import jax.numpy as jnp
from absl import flags

from laplace_jax.config import COMM_DTYPES, ModelConfig, RunConfig
from laplace_jax.models.gla_lm import abstract_params, count_params, init_state
from laplace_jax.optim.comm_report import format_comm_report, muon_comm_report, use_fake_cpu_devices
from laplace_jax.optim.muon import payload_dtype


def kv_cache_bytes(cfg: ModelConfig, tokens: int, bytes_per_elem: int = 2) -> int:
    """Bytes of the K and V caches of a softmax transformer of the same depth and width (bf16)."""
    return 2 * cfg.n_layers * cfg.d_model * tokens * bytes_per_elem


def state_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes per sequence of each part of the recurrent state, all layers (from the real state pytree)."""
    layers = jax.eval_shape(lambda: init_state(cfg, 1))
    keys = dict.fromkeys(k for s in layers for k in s)  # GLA layers' gla / conv_*, attention layers' k / v / pos
    return {k: sum(int(s[k].size) * jnp.dtype(s[k].dtype).itemsize for s in layers if k in s) for k in keys}


def model_report(cfg: ModelConfig, kv_tokens: int = 8192) -> dict[str, Any]:
    params = abstract_params(cfg)
    parts = state_bytes(cfg)
    total_state = sum(parts.values())
    kv = kv_cache_bytes(cfg, kv_tokens)
    return {
        "params": count_params(params),
        "param_bytes_fp32": 4 * count_params(params),
        "layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "heads": cfg.n_heads,
        "head_k_dim": cfg.head_k_dim,
        "head_v_dim": cfg.head_v_dim,
        "mlp_dim": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "state_bytes_per_sequence": total_state,
        "state_bytes_by_part": parts,
        "kv_cache_tokens": kv_tokens,
        "kv_cache_bytes_bf16": kv,
        "kv_cache_over_state": kv / total_state,
    }


def _human(n: float, unit: str = "B") -> str:
    if unit == "B":
        return f"{n:,.0f} B ({n / 1e6:,.2f} MB)" if n < 1e9 else f"{n:,.0f} B ({n / 1e9:,.3f} GB)"
    exp = int(math.log10(abs(n))) if n else 0
    return f"{n:,} ({n / 10**exp:.4f}e{exp})"


def format_report(rep: dict[str, Any]) -> str:
    rows = [
        ("parameters", _human(rep["params"], "")),
        ("layers x d_model", f"{rep['layers']} x {rep['d_model']}"),
        ("heads (dk, dv)", f"{rep['heads']} ({rep['head_k_dim']}, {rep['head_v_dim']})"),
        ("MLP width / vocab", f"{rep['mlp_dim']} / {rep['vocab_size']}"),
        ("state per sequence", _human(rep["state_bytes_per_sequence"])),
    ]
    rows += [(f"  {k}", _human(v)) for k, v in rep["state_bytes_by_part"].items()]
    rows += [
        (f"bf16 KV cache @ {rep['kv_cache_tokens']:,} tok", _human(rep["kv_cache_bytes_bf16"])),
        ("KV cache / state", f"{rep['kv_cache_over_state']:.1f}x"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str]) -> None:
    del argv
    FLAGS = flags.FLAGS
    if FLAGS.muon:
        use_fake_cpu_devices(FLAGS.devices)
    cfg = RunConfig.from_mapping(FLAGS.config).model
    rep = model_report(cfg, FLAGS.kv_tokens)
    if FLAGS.muon:
        rep["muon"] = muon_comm_report(cfg, FLAGS.devices, payload_dtype(FLAGS.comm_dtype))
    if FLAGS.json:
        print(json.dumps(rep, indent=2))
        return
    print(format_report(rep))
    if FLAGS.muon:
        print(f"\nDistributed Muon on {FLAGS.devices} fake CPU devices (compiled, nothing allocated):")
        print(format_comm_report(rep["muon"]))


if __name__ == "__main__":
    from ml_collections import config_flags

    from laplace_jax import cli

    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/3b.py.", lock_config=True)
    flags.mark_flag_as_required("config")
    flags.DEFINE_bool("json", False, "Print machine-readable JSON instead of a table.")
    flags.DEFINE_integer("kv_tokens", 8192, "Context length for the softmax KV-cache comparison.")
    flags.DEFINE_bool("muon", False, "Compile the distributed Muon update and report its communication.")
    flags.DEFINE_integer("devices", 64, "Fake CPU devices (mesh size) for --muon.")
    flags.DEFINE_enum("comm_dtype", "float32", list(COMM_DTYPES), "All-to-all payload dtype for --muon.")
    cli.run(main)
