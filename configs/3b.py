"""Laplace 3B: d 3072, 24 layers, 16 heads (dk 96, dv 192), short conv 4, MLP 8192, GPT-2 vocab padded to 50,304.

bf16 compute (accelerators), fp32 params, 2048-token sequences in 16 chunks of 128."""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.model = config_dict.ConfigDict(
        dict(
            vocab_size=50304,
            d_model=3072,
            n_layers=24,
            n_heads=16,
            n_kv_heads=config_dict.placeholder(int),
            expand_k=0.5,
            expand_v=1.0,
            mlp_dim=8192,
            hidden_ratio=4.0,
            use_short_conv=True,
            conv_size=4,
            norm_eps=1e-6,
            gate_logit_normalizer=16.0,
            gate_low_rank_dim=16,
            clamp_min=config_dict.placeholder(float),
            tie_embeddings=False,
            init_std=0.02,
            chunk_size=128,
            attn_impl="chunk",
            dtype="bfloat16",
            remat=True,
            max_seq_len=2048,
        )
    )
    return c
