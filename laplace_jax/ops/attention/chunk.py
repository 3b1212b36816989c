"""Blocked causal softmax attention: a ``lax.map`` over blocks of ``chunk_size`` queries.

Query block i (positions start + i c .. start + i c + c - 1) meets the keys its mask can reach:
for a window w, the block's own keys and the ``lead`` = ceil((w - 1) / c) c before them (a
static span, sliced from the keys padded in front); for full attention every key. A ``Prefix``
adds keys from before the sequence (a decode state's KV ring or buffer) that every block sees,
masked by their own positions. Each block is one dense masked softmax in float32 wrapped in
``jax.checkpoint``: the backward recomputes a block's scores from q, k, v, so memory is O(T c)
rather than O(T^2). Full attention without a window spends about half its score FLOPs on masked
keys (every block meets every key); windowed attention costs O(T (w + c)).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
_MASKED = -1e30  # a masked score: exp(_MASKED - max) is 0, and a row with no key stays finite


class Prefix(NamedTuple):
    """Keys from before the sequence: k, v [B, R, N, d], their positions [B, R] int32 and validity [B, R] bool."""

    k: Array
    v: Array
    pos: Array
    valid: Array


def _attend(q, k, v, q_pos, k_pos, k_valid, window: int | None, scale: float) -> Array:
    """One block: q [B, c, H, d] against k, v [B, S, N, d] -> [B, c, H, d] (v's dtype)."""
    B, c, H, d = q.shape
    N = k.shape[2]
    qg = q.reshape(B, c, N, H // N, d)
    s = jnp.einsum("bqngd,bknd->bngqk", qg, k, preferred_element_type=jnp.float32) * scale
    allowed = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    s = jnp.where(allowed[:, None, None], s, _MASKED)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)).astype(v.dtype)  # unnormalised
    # The row sums come out of the p v matmul as one more column of v (ones): the matrix unit sums
    # the same rounded p it weights v with, and no reduction over the scores is left.
    v1 = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
    o = jnp.einsum("bngqk,bknd->bngqd", p, v1, preferred_element_type=jnp.float32)
    o = o[..., :d] / o[..., d:]  # [B, N, G, c, d]: c x d divisions, not c x S
    return jnp.moveaxis(o, 3, 1).reshape(B, c, H, d).astype(v.dtype)


def chunk_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    window: int | None = None,
    chunk_size: int = 128,
    start: Array | None = None,
    lengths: Array | None = None,
    prefix: Prefix | None = None,
    scale: float | None = None,
) -> Array:
    """q [B, T, H, d]; k, v [B, T, N, d] at the queries' positions start[b] + t (start None: 0);
    key t is valid when t < lengths[b] (None: every t); ``prefix``: earlier keys. -> o [B, T, H, d]."""
    B, T, H, d = q.shape
    scale = d**-0.5 if scale is None else scale
    start = jnp.zeros((B,), jnp.int32) if start is None else start.astype(jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    c = min(chunk_size, T)
    n = -(-T // c)
    pad = n * c - T
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    lead = 0 if window is None else min(n * c - c, -(-(window - 1) // c) * c)
    span = n * c if window is None else lead + c
    if lead:
        k, v = (jnp.pad(x, ((0, 0), (lead, 0), (0, 0), (0, 0))) for x in (k, v))

    def block(i: Array) -> Array:
        first = i * c  # the block's first query, as an index into the (unpadded) sequence
        qb = jax.lax.dynamic_slice_in_dim(q, first, c, axis=1)
        t = (first - lead if window is not None else 0) + jnp.arange(span)  # sequence index of each key
        if window is None:
            kb, vb = k, v
        else:
            kb, vb = (jax.lax.dynamic_slice_in_dim(x, first, span, axis=1) for x in (k, v))
        k_pos = start[:, None] + t[None, :]
        k_valid = (t[None, :] >= 0) & (t[None, :] < lengths[:, None])
        if prefix is not None:
            kb, vb = jnp.concatenate([prefix.k, kb], axis=1), jnp.concatenate([prefix.v, vb], axis=1)
            k_pos = jnp.concatenate([prefix.pos, k_pos], axis=1)
            k_valid = jnp.concatenate([prefix.valid, k_valid], axis=1)
        q_pos = start[:, None] + first + jnp.arange(c)[None, :]
        return _attend(qb, kb, vb, q_pos, k_pos, k_valid, window, scale)

    o = jax.lax.map(jax.checkpoint(block, prevent_cse=False), jnp.arange(n))  # [n, B, c, H, d]
    return jnp.moveaxis(o, 0, 1).reshape(B, n * c, H, d)[:, :T]
