"""Small configs for training tests (seconds per run on CPU)."""

from laplace_jax.config import RunConfig
from laplace_jax.defaults import base_config


def micro_config(**sections):
    """The typed config of a 2-layer d=64 byte model on a slice of the embedded corpus; ``sections``
    update config blocks (dicts, as a config file would)."""
    c = base_config()
    c.model.update(
        vocab_size=256, d_model=64, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=16, max_seq_len=64
    )
    c.data.update(seq_len=64, global_batch=8, eval_batches=2, embedded_max_chars=300_000)
    c.opt.update(lr=3e-3, warmup_steps=5)
    c.train.update(steps=20, log_every=1, eval_every=0, ckpt_every=5, peak_tflops=1.0)
    for name, values in sections.items():
        getattr(c, name).update(values)
    return RunConfig.from_mapping(c)
