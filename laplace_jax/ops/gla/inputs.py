"""Shape and dtype checks shared by the GLA entry points (``chunk_gla``, ``recurrent_gla``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def check_inputs(q: Array, k: Array, v: Array, g: Array, initial_state: Array | None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, H, D] (rank 4); got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype; got {x.dtype}")
    if q.shape != k.shape or q.shape != g.shape:
        raise ValueError(
            "q, k and g must share one shape [B, T, H, K]; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}; got {tuple(v.shape)}")
    if initial_state is not None:
        want = (q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [B, H, K, V] = {want}; got {tuple(initial_state.shape)}")
