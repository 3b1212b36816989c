"""A ~100M-parameter byte-level GLA model (d 768, 14 layers, 6 heads) for CPU benchmarks."""

from laplace_jax.defaults import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=256, d_model=768, n_layers=14, n_heads=6, use_short_conv=True, chunk_size=128, max_seq_len=512
    )
    c.data.update(seq_len=512, global_batch=8)
    c.opt.update(lr=2e-3, warmup_steps=100)
    c.train.update(steps=2000, eval_every=200, ckpt_every=200)
    return c
