"""Direct sums and shifts along one axis, for the decay sums ``pallas.py`` computes before its
kernels (the XLA kernel forms its sums with 0/1 matrices, ``levels.sums``).

Every cumulative sum here adds the terms themselves (a cumulative sum, flipped or shifted), never
subtracts one cumulative sum from another: for same-sign terms (log-decays) nothing cancels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def rev_excl_cumsum(x: Array, axis: int) -> Array:
    """sum_{t > s} x_t along ``axis``, summed directly (no cancellation for same-sign x)."""
    return shift_up(rev_incl_cumsum(x, axis), 1, axis)


def rev_incl_cumsum(x: Array, axis: int) -> Array:
    """sum_{t >= s} x_t along ``axis``, summed directly."""
    return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)


def shift_down(x: Array, d: int, axis: int) -> Array:
    """x[r - d] along ``axis`` (zeros where r < d)."""
    if d == 0:
        return x
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (d, 0)
    return jax.lax.slice_in_dim(jnp.pad(x, pad), 0, n, axis=axis)


def shift_up(x: Array, d: int, axis: int) -> Array:
    """x[r + d] along ``axis`` (zeros where r + d is past the end)."""
    if d == 0:
        return x
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, d)
    return jax.lax.slice_in_dim(jnp.pad(x, pad), d, n + d, axis=axis)


def excl_cumsum(x: Array, axis: int) -> Array:
    """sum_{s < t} x_s along ``axis``, summed directly."""
    return shift_down(jnp.cumsum(x, axis), 1, axis)
