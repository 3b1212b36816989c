"""flash-linear-attention on a CPU for the export tests: its Triton kernels (GLA, the fused norms,
SwiGLU, the short convolution) swapped for plain PyTorch with the same definitions, so fla's own
model classes, loaded by transformers, run here. Only the paths a no-cache forward pass takes."""

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


@contextlib.contextmanager
def fla_on_cpu():
    import fla.layers.gla as gla_layer
    import fla.modules.mlp as mlp
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
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
