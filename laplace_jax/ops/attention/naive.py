"""The float64 reference of causal (optionally windowed) softmax attention, in NumPy, written from
the definition: every query against every key, masked, softmax, weighted sum. Shares no code
with ``chunk_attention``."""

from __future__ import annotations

import numpy as np


def naive_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None, scale: float | None = None
) -> np.ndarray:
    """q [B, T, H, d], k / v [B, T, N, d] at positions 0 .. T-1 -> o [B, T, H, d] float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, H, d = q.shape[1:]
    G = H // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # query head h reads kv head h // G
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = np.arange(T)
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed &= t[None, :] > t[:, None] - window
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)
