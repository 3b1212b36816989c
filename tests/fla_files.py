"""fla checkpoints written by the PyTorch reference (tests/torch_gla.py): the fla config dict and
a ``save_pretrained``-style directory of its weights, for the tests that import them."""

import json

import torch
from safetensors.torch import save_file
from torch_gla import GLAForCausalLM


def fla_config(**kw):
    c = dict(
        model_type="gla",
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=4,
        num_kv_heads=None,
        expand_k=0.5,
        expand_v=1.0,
        hidden_ratio=4,
        intermediate_size=None,
        use_short_conv=False,
        conv_size=4,
        norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        feature_map=None,
        use_gk=True,
        use_gv=False,
        use_output_gate=True,
        hidden_act="swish",
        attn=None,
        fuse_norm=True,
    )
    c.update(kw)
    return c


def write_fla_checkpoint(path, c, seed=0, std=0.1, gate_bias=None):
    torch.manual_seed(seed)
    model = GLAForCausalLM(c, std=std).eval()
    if gate_bias is not None:
        for block in model.model.layers:
            torch.nn.init.constant_(block.attn.gk_proj[1].bias, gate_bias)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    return model
