"""An independent PyTorch reference of fla's GLAForCausalLM (plain torch ops, token recurrence).

Written from the equations in the GLA paper and fla's conventions: parameter names match
fla's state_dict so ``model.state_dict()`` is a valid fla checkpoint. Used only as a test oracle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def naive_recurrent_gla(q, k, v, g, scale=None, initial_state=None):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V] -> (o [B, T, H, V], state [B, H, K, V]).

    Computes in float64 when q is float64 (the oracle for error figures), else in float32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    S = torch.zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt).clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t][..., None] * v[:, t][..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, 1), S


def _wide(x):
    """x in float32, or float64 if it already is (fla computes norms and gates in fp32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = _wide(x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GatedNorm(RMSNorm):
    def forward(self, x, g):
        return super().forward(x) * F.silu(_wide(g))


class ShortConv(nn.Conv1d):
    def __init__(self, dim, width):
        super().__init__(dim, dim, width, groups=dim, padding=width - 1, bias=False)

    def forward(self, x):  # [B, T, D]
        return F.silu(super().forward(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))


class GLAAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, H = c["hidden_size"], c["num_heads"]
        self.H = H
        self.normalizer = c.get("gate_logit_normalizer", 16)
        self.G = H // (c.get("num_kv_heads") or H)
        key_dim, value_dim = int(d * c["expand_k"]), int(d * c["expand_v"])
        self.dk, self.dv = key_dim // H, value_dim // H
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim // self.G, bias=False)
        self.v_proj = nn.Linear(d, value_dim // self.G, bias=False)
        self.g_proj = nn.Linear(d, value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d, 16, bias=False), nn.Linear(16, key_dim // self.G, bias=True))
        self.o_proj = nn.Linear(value_dim, d, bias=False)
        self.fused_norm = c.get("fuse_norm", True)  # fla: FusedRMSNormGated "g_norm_swish_gate", else "g_norm"
        if self.fused_norm:
            self.g_norm_swish_gate = GatedNorm(self.dv, c["norm_eps"])
        else:
            self.g_norm = RMSNorm(self.dv, c["norm_eps"])
        self.use_conv = c.get("use_short_conv", False)
        if self.use_conv:
            W = c.get("conv_size", 4)
            self.q_conv1d = ShortConv(key_dim, W)
            self.k_conv1d = ShortConv(key_dim // self.G, W)
            self.v_conv1d = ShortConv(value_dim // self.G, W)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_conv:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        gk = self.gk_proj(x)
        q = q.view(B, T, self.H, self.dk)
        k = k.view(B, T, -1, self.dk).repeat_interleave(self.G, dim=2)
        gk = gk.view(B, T, -1, self.dk).repeat_interleave(self.G, dim=2)
        v = v.view(B, T, -1, self.dv).repeat_interleave(self.G, dim=2)
        o, _ = naive_recurrent_gla(q, k, v, F.logsigmoid(_wide(gk)) / self.normalizer)
        g = self.g_proj(x).view(B, T, self.H, self.dv)
        if self.fused_norm:
            return self.o_proj(self.g_norm_swish_gate(o, g).reshape(B, T, -1))
        return self.o_proj(self.g_norm(o).reshape(B, T, -1) * F.silu(_wide(g.reshape(B, T, -1))))


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c, hidden):
        super().__init__()
        self.attn_norm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.attn = GLAAttention(c)
        self.mlp_norm = RMSNorm(c["hidden_size"], c["norm_eps"])
        self.mlp = MLP(c["hidden_size"], hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["hidden_size"]
        hidden = c.get("intermediate_size") or 256 * math.ceil(int(d * c.get("hidden_ratio", 4) * 2 / 3) / 256)
        self.embeddings = nn.Embedding(c["vocab_size"], d)
        self.layers = nn.ModuleList(Block(c, hidden) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(d, c["norm_eps"])


class GLAForCausalLM(nn.Module):
    """fla-named reference model; ``c`` is an fla config.json dict."""

    def __init__(self, c, std=0.02):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" not in name:
                nn.init.normal_(p, std=std)

    def forward(self, tokens):
        x = self.model.embeddings(tokens)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))
