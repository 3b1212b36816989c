"""flash-linear-attention on a CPU for the export tests: its Triton kernels (GLA, the fused norms,
SwiGLU, the short convolution, the rotary embedding) and the flash-attn call of its hybrid
``Attention`` layer swapped for plain PyTorch with the same definitions, so fla's own model
classes, loaded by transformers, run here. Only the paths a no-cache forward pass takes."""

import contextlib

import torch
import torch.nn.functional as F
from torch_gla import naive_recurrent_gla


def _rms(x, weight, bias, eps):
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    out = _rms(x, self.weight, self.bias, self.eps)
    return (out, x) if prenorm else out


def _gated_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    act = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}[self.activation]
    out = _rms(x, self.weight, self.bias, self.eps) * act(g.float()).to(x.dtype)
    return (out, x) if prenorm else out


def _conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, **kwargs):
    W = self.weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), self.weight, self.bias, groups=x.shape[-1]).transpose(1, 2)
    y = F.silu(y) if self.activation in ("silu", "swish") else y
    return (y if residual is None else y + residual), None


def _gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, gk=None, **kwargs):
    o, state = naive_recurrent_gla(q, k, v, gk if g is None else g, scale=scale)
    return o.to(q.dtype), (state if output_final_state else None)


def _flash_attn(q, k, v, causal=True, window_size=(-1, -1), **kwargs):
    """flash_attn_func's definition for equal-length q and k: causal, window (w - 1, 0), GQA."""
    T, S = q.shape[1], k.shape[1]
    G = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(G, dim=2) for x in (k, v))  # query head h reads kv head h // G
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    i, j = torch.arange(T)[:, None] + (S - T), torch.arange(S)[None, :]
    allowed = j <= i
    if window_size[0] >= 0:
        allowed &= j >= i - window_size[0]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype)


def _rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **kwargs):
    from fla.modules.rotary.ops import rotary_embedding_ref

    assert isinstance(seqlen_offsets, int) and cu_seqlens is None, "only a no-cache forward pass"
    T = x.shape[1]
    return rotary_embedding_ref(x, cos[seqlen_offsets : seqlen_offsets + T], sin[seqlen_offsets : seqlen_offsets + T])


@contextlib.contextmanager
def fla_on_cpu():
    import fla.layers.attn as attn_layer
    import fla.layers.gla as gla_layer
    import fla.modules.mlp as mlp
    import fla.modules.rotary.ops as rotary
    from fla.modules.causal_conv1d.ops import ShortConvolution
    from fla.modules.norm.fused_norm_gate import FusedRMSNormGated
    from fla.modules.norm.layernorm import RMSNorm

    patches = [
        (RMSNorm, "forward", _norm_forward),
        (FusedRMSNormGated, "forward", _gated_norm_forward),
        (ShortConvolution, "forward", _conv_forward),
        (mlp.SwiGLULinear, "forward", lambda self, x, y, weight, bias: F.linear(F.silu(x) * y, weight, bias)),
        (mlp, "swiglu", lambda x, y: F.silu(x) * y),
        (gla_layer, "chunk_gla", _gla),
        (gla_layer, "fused_chunk_gla", _gla),
        (gla_layer, "fused_recurrent_gla", _gla),
        (attn_layer, "flash_attn_func", _flash_attn),
        (rotary, "rotary_embedding", _rotary),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
