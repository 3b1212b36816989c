"""The public fla-hub GLA 340M shape (hidden 1024, 24 layers, 4 heads, Llama-2 32k vocabulary)."""

from laplace_jax.defaults import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000, d_model=1024, n_layers=24, n_heads=4, chunk_size=128, max_seq_len=2048, remat="save_gla"
    )
    c.data.update(seq_len=2048, global_batch=256)
    c.opt.update(lr=1e-3, warmup_steps=1000, comm_dtype="bfloat16")  # Muon's exchange in bf16, as the 3B's
    c.train.update(steps=28_610)  # 15e9 tokens
    return c
