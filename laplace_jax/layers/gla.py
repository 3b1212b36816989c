"""The Gated Linear Attention layer (fla ``GatedLinearAttention`` semantics and parameter names)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.config import ModelConfig
from laplace_jax.layers.common import (
    VERIFY_INPUTS,
    VERIFY_STATES,
    GatedRMSNorm,
    Linear,
    ShortConv,
    Weight,
    WeightAndBias,
    log_decay,
    projections,
    row_kernels,
    trace_of,
)
from laplace_jax.ops.gla import context_gla, gla, gla_decode, gla_states
from laplace_jax.ops.norm import takes as norm_takes
from laplace_jax.parallel import context_axis

Array = jax.Array
LayerState = dict[str, Array]


class GatedLinearAttention(nn.Module):
    """x [B, T, d] -> (y [B, T, d], state).

    ``state`` is None for training (zero initial state, nothing returned) or a dict with
    ``gla`` [B, H, dk, dv] fp32 and, with short conv, ``conv_q`` / ``conv_k`` / ``conv_v``
    [B, W * channels]; the updated dict is returned. T == 1 with a state takes the recurrent step.
    ``lengths_B`` (with a state): positions t >= lengths[b] are padding and leave the state as it
    was (k = v = 0, log-decay 0; the conv cache keeps the last W valid inputs).
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self, x_BxTxD: Array, state: LayerState | None, lengths_B: Array | None = None
    ) -> tuple[Array, LayerState | None]:
        cfg = self.cfg
        dt = cfg.compute_dtype
        B, T, _ = x_BxTxD.shape
        H, G, dk, dv = cfg.n_heads, cfg.kv_groups, cfg.head_k_dim, cfg.head_v_dim
        lin = functools.partial(Linear, dtype=dt, init_std=cfg.init_std)
        w = dict(dtype=dt, init_std=cfg.init_std)
        D = x_BxTxD.shape[-1]
        x_BxTxD = x_BxTxD.astype(dt)
        # q, k, v and the output gate's g: one call where the rows are few (``projections``)
        widths = {
            "q_proj": cfg.key_dim,
            "k_proj": cfg.key_dim // G,
            "v_proj": cfg.value_dim // G,
            "g_proj": cfg.value_dim,
        }
        ws = tuple(Weight(width, ("embed", "heads"), name=name, **w)(D) for name, width in widths.items())
        q, k, v, g = projections(x_BxTxD, ws)
        new_state: LayerState = {}
        if cfg.use_short_conv:
            conv = functools.partial(ShortConv, cfg.conv_size, dtype=dt, init_std=cfg.init_std, impl=cfg.attn_impl)
            cache = (lambda key: None) if state is None else state.get
            q, new_state["conv_q"] = conv(name="q_conv1d")(q, cache("conv_q"), lengths_B)
            k, new_state["conv_k"] = conv(name="k_conv1d")(k, cache("conv_k"), lengths_B)
            v, new_state["conv_v"] = conv(name="v_conv1d")(v, cache("conv_v"), lengths_B)
        # gk_proj: a low-rank pair of projections (fla's names and parameters), then the log-decay
        w0 = Weight(cfg.gate_low_rank_dim, ("embed", "rank"), name="gk_proj_0", **w)(D)
        w1, b1 = WeightAndBias(cfg.key_dim // G, ("rank", "heads"), name="gk_proj_1", **w)(cfg.gate_low_rank_dim)
        valid = None if lengths_B is None else jnp.arange(T)[None, :] < lengths_B[:, None]  # [B, T]
        gk = log_decay(x_BxTxD, w0, w1, b1, cfg.gate_logit_normalizer, cfg.clamp_min, valid)  # 0 at padding
        if valid is not None and not cfg.use_short_conv:  # the convolutions give 0 at padding themselves
            k, v = (jnp.where(valid[:, :, None], a, 0) for a in (k, v))
        # model.remat="save_gla" keeps these as [B, T, features] rows, before the heads are split
        # off: as [B, T, H, d] a TPU tiles the few heads on the sublanes (the 340M's 4, bf16: a
        # quarter of each tile), and stacking them over the layer scan cost the 340M train step on
        # v5e:2x2 11.3 ms of the compiler's estimate, 5.1 ms as rows (docs/tpu.md)
        q, k, v, gk = (checkpoint_name(a, "gla_inputs") for a in (q, k, v, gk))

        q = q.reshape(B, T, H, dk)
        # GQA: kv head j serves query heads j*G .. j*G+G-1.
        k, gk = (jnp.repeat(a.reshape(B, T, H // G, dk), G, axis=2) for a in (k, gk))
        v = jnp.repeat(v.reshape(B, T, H // G, dv), G, axis=2)
        s0 = None if state is None else state["gla"]
        trace = trace_of(self)
        if trace == VERIFY_STATES:  # a speculative verify that keeps every position's state
            o, states = gla_states(q, k, v, gk, s0)
            s = states[:, -1]
            self.sow(trace, "states", states)
        elif s0 is not None and T == 1:
            o, s = gla_decode(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], s0, impl=cfg.attn_impl)
            o = o[:, None]
        elif (axis := context_axis()) is not None:  # this device holds one slice of each sequence
            o, s = context_gla(q, k, v, gk, axis=axis, initial_state=s0, chunk_size=cfg.chunk_size, impl=cfg.attn_impl)
        else:
            o, s = gla(q, k, v, gk, impl=cfg.attn_impl, initial_state=s0, chunk_size=cfg.chunk_size)
        if trace == VERIFY_INPUTS:  # a speculative verify that replays the accepted positions later
            self.sow(trace, "inputs", (k, v, gk))
        new_state["gla"] = s

        # Where the Mosaic norm runs (``row_kernels``) o and g meet it as [B, T, H * dv]: a
        # [.., H, dv] view would be a relayout of both (dv = 192 is not whole lane tiles). For
        # XLA's norm, in the decode step the gate meets o as [B*H, dv] rows: the state (and so o)
        # is laid out batch-minor on the TPU, and with the 4-d shape that layout flowed through
        # the gate into g_proj's output and cost a transposed copy of g_proj's weights every step
        # (1.35 ms of the 3B decode step's estimate at W=256 on v5p); 2-d rows stop it at o
        # (1.5 MB). Over a sequence the 4-d shape is the cheaper one (the 340M train step on
        # v5e:2x2: 282.9 ms against 286.3 as [B, T, H * dv]).
        if row_kernels(g, norm_takes):
            rows: tuple[int, ...] = (B, T, H * dv)
        else:
            rows = (B * H, dv) if T == 1 and state is not None else (B, T, H, dv)
        gate = GatedRMSNorm(dv, cfg.norm_eps, dtype=dt, name="g_norm_swish_gate")
        o = gate(o.reshape(rows), g.reshape(rows)).reshape(B, T, H * dv)
        y = lin(D, ("heads", "embed"), name="o_proj")(o)
        return y, (None if state is None else new_state)
