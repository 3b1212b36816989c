"""Laplace 3B on one trn2.48xlarge (64 logical NeuronCores).

Model: d 3072, 24 layers, 16 heads (dk 96, dv 192), short conv 4, MLP 8192, GPT-2 vocabulary
padded to 50,304, untied; bf16 compute, fp32 params, 2048-token sequences in 16 chunks of 128.
Recipe: FineWeb-Edu, 100e9 tokens = 190,735 steps of 256 x 2048 = 524,288 tokens.
Data: prepare FineWeb-Edu Parquet shards with GPT-2's tokenizer.json, then set data.path.
"""

from laplace_jax.defaults import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50304,
        d_model=3072,
        n_layers=24,
        n_heads=16,
        use_short_conv=True,
        mlp_dim=8192,
        chunk_size=128,
        dtype="bfloat16",
        remat="full",
        max_seq_len=2048,
    )
    c.data.update(seq_len=2048, global_batch=256, tokenizer="gpt2")
    c.opt.update(lr=3e-4, warmup_steps=2000, schedule="wsd", comm_dtype="bfloat16")
    c.train.update(steps=190_735, log_every=10, eval_every=1000, ckpt_every=1000, device_memory_gib=24.0)
    c.mesh.update(data=1, fsdp=64)
    return c
