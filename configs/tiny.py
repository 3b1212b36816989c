"""A tiny GLA model that trains on CPU in minutes (byte-level vocabulary)."""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.model = config_dict.ConfigDict(
        dict(
            vocab_size=256,
            d_model=128,
            n_layers=2,
            n_heads=2,
            n_kv_heads=config_dict.placeholder(int),
            expand_k=0.5,
            expand_v=1.0,
            mlp_dim=config_dict.placeholder(int),
            hidden_ratio=4.0,
            use_short_conv=True,
            conv_size=4,
            norm_eps=1e-6,
            gate_logit_normalizer=16.0,
            gate_low_rank_dim=16,
            clamp_min=config_dict.placeholder(float),
            tie_embeddings=False,
            init_std=0.02,
            chunk_size=64,
            attn_impl="chunk",
            dtype="float32",
            remat=False,
            max_seq_len=256,
        )
    )
    return c
