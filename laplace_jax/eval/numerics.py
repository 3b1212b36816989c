"""Numerics report: how far the same checkpoint's logits move between execution modes.

(a) jitted vs op-by-op (``jax.disable_jit``), in fp32 and in bf16 compute, (b) fp32 vs bf16
compute, (c) chunked vs recurrent GLA, (d) greedy decode fp32 vs bf16. For each: max abs
difference, RMS relative error, argmax agreement; for (d) the first step where the two greedy
continuations differ; and jitted forward tokens/s in each dtype. The reference is always jitted
fp32. Run it once plainly and once with ``--exact`` (``platform.set_exact``) to see what the XLA
flags change: compiled bf16 may keep intermediates in fp32 (excess precision), which op-by-op
execution never does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.generate import sample
from laplace_jax.models.gla_lm import forward
from laplace_jax.platform import median_seconds


def compare(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return {
        "max_abs": float(np.max(np.abs(out - ref))),
        "rms_rel": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
        "argmax_agree": float(np.mean(np.argmax(out, -1) == np.argmax(ref, -1))),
    }


def report(cfg: ModelConfig, params: Any, tokens_BxT: np.ndarray, decode_steps: int = 32) -> dict[str, Any]:
    """All comparisons for ``tokens_BxT`` (int32 [B, T]); greedy decode continues row 0."""
    fp32 = dataclasses.replace(cfg, dtype="float32")
    bf16_cfg = dataclasses.replace(cfg, dtype="bfloat16")
    fwd = jax.jit(forward, static_argnums=0)
    ref = np.asarray(fwd(fp32, params, tokens_BxT))
    bf16 = np.asarray(fwd(bf16_cfg, params, tokens_BxT))
    with jax.disable_jit():
        eager = np.asarray(forward(fp32, params, tokens_BxT))
        eager16 = np.asarray(forward(bf16_cfg, params, tokens_BxT))
    rec = np.asarray(fwd(dataclasses.replace(fp32, attn_impl="recurrent"), params, tokens_BxT))
    prompt = tokens_BxT[0].tolist()
    g32 = sample(fp32, params, prompt, decode_steps, temperature=0.0)
    g16 = sample(bf16_cfg, params, prompt, decode_steps, temperature=0.0)
    first = next((i for i, (a, b) in enumerate(zip(g32, g16, strict=True)) if a != b), None)
    speed = {
        c.dtype: tokens_BxT.size / median_seconds(lambda c=c: fwd(c, params, tokens_BxT).block_until_ready(), 5, 1)
        for c in (fp32, bf16_cfg)
    }
    return {
        "tokens": list(tokens_BxT.shape),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jit_vs_eager": compare(ref, eager),
        "jit_vs_eager_bf16": compare(eager16, bf16),
        "fp32_vs_bf16": compare(ref, bf16),
        "chunk_vs_recurrent": compare(ref, rec),
        "greedy_fp32_vs_bf16": {
            "steps": decode_steps,
            "agree": float(np.mean(np.asarray(g32) == np.asarray(g16))),
            "first_divergence": first,
        },
        "forward_tokens_per_s": speed,
    }
