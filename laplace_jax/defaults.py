"""The full config layout with defaults; every ``configs/*.py`` starts from ``base_config()``.

model  ModelConfig fields (laplace_jax.config)
data   source ('text' | 'mqar'), path ('' = embedded stdlib corpus), seq_len, global_batch, eval, seed
opt    optimizer, schedule, Muon/AdamW hyperparameters, clipping
train  steps, accumulation, logging/eval/checkpoint intervals, non-finite policy
mesh   data / fsdp axis sizes (-1: all remaining devices) and logical axis rules
plan   the target hardware for --plan's time-and-cost estimate (default: trn2.48xlarge, LNC=2)
"""

from __future__ import annotations

import dataclasses

from ml_collections import config_dict

from laplace_jax.config import ModelConfig
from laplace_jax.platform import PEAK_BF16_TFLOPS

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
)


def _model_block() -> config_dict.ConfigDict:
    block = config_dict.ConfigDict()
    for f in dataclasses.fields(ModelConfig):
        value = f.default
        if value is None:  # Optional fields stay overridable from the command line
            value = config_dict.placeholder(float if f.name == "clamp_min" else int)
        setattr(block, f.name, value)
    return block


def base_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.model = _model_block()
    c.data = config_dict.ConfigDict(
        dict(
            source="text",  # 'text' (data.path, or the embedded corpus) or 'mqar' (synthetic recall mixture)
            path="",  # a directory written by laplace_jax.data.prepare; '' = embedded stdlib corpus
            tokenizer="byte",  # for the embedded corpus; prepared data records its own tokenizer
            seq_len=256,
            global_batch=16,
            seed=0,
            eval_batches=4,
            embedded_max_chars=3_000_000,
            mqar=config_dict.ConfigDict(dict(min_pairs=4, max_pairs=24)),  # pairs per training window
        )
    )
    c.opt = config_dict.ConfigDict(
        dict(
            optimizer="muon",  # 'muon' (Muon + AdamW) or 'adamw'
            lr=3e-3,
            schedule="cosine",  # 'cosine' (warmup + cosine) or 'wsd' (warmup-stable-decay)
            warmup_steps=20,
            min_lr_ratio=0.1,
            decay_fraction=0.2,  # wsd: final fraction of steps that decays linearly
            weight_decay=0.1,
            beta=0.95,
            nesterov=True,
            adjust_lr="match_rms_adamw",
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            clip_norm=1.0,
            comm_dtype="float32",  # Muon all-to-all payload: 'float32' or 'bfloat16'
        )
    )
    c.train = config_dict.ConfigDict(
        dict(
            steps=300,
            grad_accum=1,
            log_every=10,
            eval_every=100,
            ckpt_every=100,
            keep_checkpoints=3,
            max_nonfinite=5,  # stop after this many non-finite steps in a row
            peak_tflops=0.0,  # per-device peak for MFU; 0 = platform table (CPU: measured matmul)
            device_memory_gib=0.0,  # per-device memory for the fit check; 0 = query the device
            prng_impl="auto",  # 'auto' (rbg on Neuron, threefry2x32 elsewhere), 'threefry2x32', 'rbg', 'unsafe_rbg'
        )
    )
    c.mesh = config_dict.ConfigDict(dict(data=1, fsdp=-1, rules=DEFAULT_RULES))
    c.plan = trn2_48xlarge()
    return c


def trn2_48xlarge() -> config_dict.ConfigDict:
    """One logical NeuronCore (LNC=2) of a trn2.48xlarge, from AWS's Trainium2 specifications
    (sources in README.md): a chip has 667 dense bf16 TFLOP/s and 1.28 TB/s of NeuronLink-v3
    and is four logical cores; an instance is 16 chips = 64 logical cores."""
    return config_dict.ConfigDict(
        dict(
            name="trn2.48xlarge (LNC=2)",
            peak_tflops_per_device=PEAK_BF16_TFLOPS["Trainium2"][0],
            interconnect_gbps_per_device=1280.0 / 4,
            devices_per_instance=64,
            usd_per_instance_hour=0.0,  # set to your price to get a dollar figure; 0 = instance-hours only
        )
    )
