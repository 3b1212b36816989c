"""The short convolution's one-token step in XLA: the reference, and the step on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from laplace_jax.ops.gla.limits import XLA_CONV_SCOPE

Array = jax.Array


def conv_step(x: Array, cache: Array, kernel: Array, lengths: Array | None = None) -> tuple[Array, Array]:
    """x [B, D], cache [B, W * D], kernel [W, D] -> (y [B, D], cache'), all in x's dtype. Taps are
    slices of the flat cache's minor axis at multiples of D (no [.., W, D] tiles to relayout).
    ``lengths`` [B]: a row whose length is 0 (padding) keeps its cache and gives y = 0 (a GLA
    layer's k and v: nothing enters its state)."""
    with jax.named_scope(XLA_CONV_SCOPE):  # what a compiled program ran, by name (hlo_stats.gla_kernels)
        return _step(x, cache, kernel, lengths)


def _step(x: Array, cache: Array, kernel: Array, lengths: Array | None) -> tuple[Array, Array]:
    D, W = x.shape[1], kernel.shape[0]
    taps = [cache[:, w * D : (w + 1) * D] for w in range(1, W)] + [x]
    y = sum(taps[w] * kernel[w] for w in range(W))
    new = jnp.concatenate([cache[:, D:], x], axis=1)
    if lengths is None:
        return jax.nn.silu(y), new
    live = lengths[:, None] > 0
    return jnp.where(live, jax.nn.silu(y), 0), jnp.where(live, new, cache)
