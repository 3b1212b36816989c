"""A tiny byte-level GLA model that trains on CPU in minutes on the embedded stdlib corpus."""

from laplace_jax.defaults import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=256, d_model=128, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=64, max_seq_len=256
    )
    c.data.update(seq_len=256, global_batch=16)
    c.opt.update(lr=3e-3, warmup_steps=20)
    c.train.update(steps=300, eval_every=100, ckpt_every=100)
    return c
