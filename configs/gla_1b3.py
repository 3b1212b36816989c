"""The public fla-hub GLA 1.3B shape (hidden 2048, 24 layers, 4 heads, Llama-2 32k vocabulary)."""

from laplace_jax.defaults import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000,
        d_model=2048,
        n_layers=24,
        n_heads=4,
        chunk_size=128,
        max_seq_len=2048,
        remat="full",
        dtype="bfloat16",
    )
    c.data.update(seq_len=2048, global_batch=256)
    c.opt.update(lr=6e-4, warmup_steps=1000)
    c.train.update(steps=190_735)  # 100e9 tokens
    return c
