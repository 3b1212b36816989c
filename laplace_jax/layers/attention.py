"""The softmax attention layer of hybrid models (fla ``Attention`` semantics and parameter names).

q / k / v projections (biases with ``qkv_bias``), rotary embeddings on q and k (fla's, the two
halves of each head rotated as pairs, frequencies rope_theta^(-2i / head_dim), angles in
float32), causal softmax attention over ``chunk_attention``, GQA, o projection without bias.

The decode state is fixed per sequence: ``k`` / ``v`` [B, R, N, head_dim] in the compute dtype
(keys after rotation, as fla caches them) and ``pos`` [B] int32, the tokens seen. Slot j holds
the newest position p = j (mod R), so the buffer is a ring: R = window_size for a windowed layer
(any context length, a fixed state), R = model.max_seq_len for full attention (a fixed
allocation: positions beyond it would overwrite the oldest, so serving refuses requests that go
there). A prefill chunk or a decode step attends to the ring's valid slots and to its own keys,
then keeps in each slot the newest of both.

Under context parallelism (``mesh.context``: this device holds slice p of each training
sequence, positions p T .. p T + T - 1) the earlier slices' keys are a ``Prefix`` too: for a
window of w <= T + 1 tokens, the previous slice's last w - 1 keys and values by one neighbour
exchange; for full attention (or a longer window), every slice's keys and values by one
all-gather (named scope ``context_kv``; the backward reduce-scatters their gradients), masked to
the earlier positions.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from laplace_jax.config import AttnSpec, ModelConfig
from laplace_jax.layers.common import Linear, trace_of
from laplace_jax.ops.attention import Prefix, chunk_attention
from laplace_jax.parallel import as_wire, context_axis, from_previous_slice

Array = jax.Array
LayerState = dict[str, Array]


def ring_size(cfg: ModelConfig, spec: AttnSpec) -> int:
    """Positions the layer's decode state holds per sequence."""
    return cfg.max_seq_len if spec.window_size is None else spec.window_size


def rotary(x: Array, pos: Array, theta: float) -> Array:
    """x [B, T, heads, d] rotated by positions pos [B, T] (fla's non-interleaved rotary embedding)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, d/2]
    cos, sin = (jnp.concatenate([f(angle)] * 2, axis=-1)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return (x32 * cos + jnp.concatenate([-x2, x1], axis=-1) * sin).astype(x.dtype)


def _earlier_slices(k: Array, v: Array, axis: str, window: int | None) -> tuple[Array, Prefix | None]:
    """Under context parallelism: (this slice's first position [B], the earlier slices' keys a
    query here can see, as a Prefix; None for a window of 1) (module docstring)."""
    B, T = k.shape[:2]
    start = jnp.full((B,), jax.lax.axis_index(axis) * T, jnp.int32)
    if window == 1:  # each token sees only itself
        return start, None
    if window is not None and window - 1 <= T:
        R = window - 1
        halo_k, halo_v = from_previous_slice(jnp.stack([k[:, T - R :], v[:, T - R :]]), axis)  # zeros on slice 0
        pos = start[:, None] - R + jnp.arange(R)[None, :]
        return start, Prefix(halo_k, halo_v, pos, pos >= 0)
    with jax.named_scope("context_kv"):  # the name ``hlo_stats.source_of`` files it under
        gather = lambda x: jax.lax.all_gather(x, axis, axis=2, tiled=True)  # noqa: E731
        all_k, all_v = as_wire(gather, jnp.stack([k, v]))
    pos = jnp.broadcast_to(jnp.arange(all_k.shape[1])[None, :], (B, all_k.shape[1]))
    return start, Prefix(all_k, all_v, pos, pos < start[:, None])  # this and later slices: not a prefix


def _slot_positions(pos: Array, R: int) -> Array:
    """[B, R]: the newest position p < pos[b] with p = j (mod R) in slot j (negative: none yet)."""
    j = jnp.arange(R)[None, :]
    last = pos[:, None] - 1
    return last - jnp.mod(last - j, R)


class Attention(nn.Module):
    """x [B, T, d] -> (y [B, T, d], state): causal softmax attention (module docstring).

    ``state`` None: training (positions 0 .. T-1, nothing returned). Otherwise the ring state;
    ``lengths_B``: positions t >= lengths[b] are padding (not attended to, not kept, ``pos`` not
    advanced past them)."""

    cfg: ModelConfig
    spec: AttnSpec

    @nn.compact
    def __call__(
        self, x_BxTxD: Array, state: LayerState | None, lengths_B: Array | None = None
    ) -> tuple[Array, LayerState | None]:
        cfg, spec = self.cfg, self.spec
        B, T, D = x_BxTxD.shape
        H, N = spec.num_heads, spec.kv_heads
        hd = D // H
        lin = functools.partial(Linear, dtype=cfg.compute_dtype, init_std=cfg.init_std, use_bias=spec.qkv_bias)
        q = lin(D, ("embed", "heads"), name="q_proj")(x_BxTxD).reshape(B, T, H, hd)
        k = lin(N * hd, ("embed", "heads"), name="k_proj")(x_BxTxD).reshape(B, T, N, hd)
        v = lin(N * hd, ("embed", "heads"), name="v_proj")(x_BxTxD).reshape(B, T, N, hd)
        axis = None if state is not None else context_axis()
        if axis is not None:  # this device holds one slice of each sequence
            start, prefix = _earlier_slices(k, v, axis, spec.window_size)
        else:
            start, prefix = jnp.zeros((B,), jnp.int32) if state is None else state["pos"], None
        pos = start[:, None] + jnp.arange(T)[None, :]
        q, k = rotary(q, pos, spec.rope_theta), rotary(k, pos, spec.rope_theta)
        attend = functools.partial(chunk_attention, window=spec.window_size, chunk_size=cfg.chunk_size)
        if prefix is not None:  # the earlier slices' keys rotate at their own positions
            prefix = prefix._replace(k=rotary(prefix.k, prefix.pos, spec.rope_theta))
        if state is None:
            o, new_state = attend(q, k, v, start=start, prefix=prefix), None
        else:
            lengths = jnp.full((B,), T, jnp.int32) if lengths_B is None else lengths_B.astype(jnp.int32)
            R = state["k"].shape[1]
            slots = _slot_positions(start, R)
            o = attend(q, k, v, start=start, lengths=lengths, prefix=Prefix(state["k"], state["v"], slots, slots >= 0))
            new_state = self.keep(state, k, v, start, lengths)
            if (trace := trace_of(self)) is not None:  # a speculative verify: the chunk's rotated keys
                self.sow(trace, "inputs", (k, v))
        y = Linear(D, ("heads", "embed"), dtype=cfg.compute_dtype, init_std=cfg.init_std, name="o_proj")
        return y(o.reshape(B, T, H * hd)), new_state

    @staticmethod
    def keep(state: LayerState, k: Array, v: Array, start: Array, lengths: Array) -> LayerState:
        """The ring after the chunk: each slot's newest position among the old slots and the chunk's valid keys."""
        end = start + lengths
        newest = _slot_positions(end, state["k"].shape[1])
        from_chunk = (newest >= start[:, None])[:, :, None, None]
        t = jnp.clip(newest - start[:, None], 0, k.shape[1] - 1)[:, :, None, None]
        keep = lambda old, new: jnp.where(from_chunk, jnp.take_along_axis(new, t, axis=1), old)  # noqa: E731
        return {
            "k": keep(state["k"], k.astype(state["k"].dtype)),
            "v": keep(state["v"], v.astype(state["v"].dtype)),
            "pos": end,
        }
