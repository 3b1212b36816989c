"""What a train step costs: its model FLOPs per token and whether its compiled memory
(``hlo_stats.memory_report``) fits a device; the trainer's fit check, ``--plan`` and
``benchmarks/bench_train`` read them here."""

from __future__ import annotations

from laplace_jax.config import ModelConfig
from laplace_jax.errors import UserError


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token of ``seq_len``-token windows: 6 x (matmul parameters) + 3 x the
    mixers' forward FLOPs: the GLA chunk form per GLA layer, and per attention layer q k^T and
    p v over the keys a token sees on average (causal: (seq_len + 1) / 2, at most the window)."""
    matmul_params = n_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)  # lookup is free
    C, K, V = cfg.chunk_size, cfg.head_k_dim, cfg.head_v_dim
    specs = [spec for spec in cfg.attn or () for _ in spec.layers]  # one per attention layer
    gla = (cfg.n_layers - len(specs)) * cfg.n_heads * (4 * K * V + 2 * C * (K + V))
    attn = sum(4 * _keys_seen(seq_len, spec.window_size) * cfg.d_model for spec in specs)
    return 6.0 * matmul_params + 3.0 * (gla + attn)


def _keys_seen(T: int, window: int | None) -> float:
    """Keys a query sees on average in a causal T-token window: min(t + 1, w) summed over t, / T."""
    w = T if window is None else min(window, T)
    return (w * (w + 1) / 2 + (T - w) * w) / T


def fits(mem: dict[str, int], available: int) -> bool:
    """Whether a compiled step's memory leaves 5% of a device's ``available`` bytes free."""
    return mem["total"] <= 0.95 * available


def check_fit(mem: dict[str, int], available: int, n_devices: int) -> None:
    """Raise a UserError with advice when the step needs more than 95% of a device's memory."""
    if not fits(mem, available):
        raise UserError(
            f"the train step needs {mem['total'] / 2**30:.1f} GiB per device (arguments "
            f"{mem['arguments'] / 2**30:.1f}, temporaries {mem['temporaries'] / 2**30:.1f}) but a device has "
            f"{available / 2**30:.1f} GiB ({n_devices} devices). Use more devices (mesh.fsdp), a smaller "
            "data.global_batch with train.grad_accum, model.remat=full (or save_gla), long sequences split "
            "across devices (mesh.context), or inspect with --plan"
        )
