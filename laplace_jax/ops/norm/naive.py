"""RMSNorm in plain JAX: the reference for ``mosaic.py`` and the form every backend runs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def rms_normalize(x: Array, eps: float) -> Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def rms_norm(x: Array, gain: Array, eps: float, out_dtype: Any, gate: Array | None = None) -> Array:
    """rms_normalize(x) * gain, times swish(gate) with a gate (like x), in float32, returned in
    ``out_dtype``: fla's RMSNorm and its FusedRMSNormGated with swish. x [.., D], gain [w] with w
    dividing D: each run of w features (a head) is normalised on its own, with the same gain."""
    D, w = x.shape[-1], gain.shape[-1]
    heads = x if w == D else x.reshape(*x.shape[:-1], D // w, w)
    y = rms_normalize(heads, eps) * gain.astype(jnp.float32)
    if gate is not None:
        gate = gate.astype(jnp.float32).reshape(heads.shape)
        y = y * gate * jax.nn.sigmoid(gate)
    return y.astype(out_dtype).reshape(x.shape)


def residual_rms_norm(x: Array, h: Array, gain: Array, eps: float, out_dtype: Any) -> tuple[Array, Array]:
    """(r, rms_norm(r)) with r = x + h: a pre-norm block's residual add and the next norm."""
    r = x + h
    return r, rms_norm(r, gain, eps, out_dtype)
