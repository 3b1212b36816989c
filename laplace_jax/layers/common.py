"""Building blocks shared by the GLA layers: Linear, RMSNorm, gated RMSNorm, short conv, SwiGLU MLP.

Parameters are float32 and carry logical axis names (no mesh names); compute happens in the
module's ``dtype`` and norms in float32, as in flash-linear-attention.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def normal_init(std: float, axes: tuple[str, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered(w: Array, axes: tuple[str | None, ...], dtype: jnp.dtype) -> Array:
    """A weight with logical ``axes`` cast to ``dtype`` on its shards, then all-gathered for use, so
    an FSDP gather moves ``dtype`` bytes (bf16: half of fp32). The gradient is reduce-scattered
    back to the shards and returned in fp32. Without logical axis rules and a mesh (one device,
    serving) this is just the cast.

    The gather is an explicit ``shard_map`` collective (XLA's partitioner would place it on the
    fp32 master), and 16-bit payloads cross it as uint16: XLA:CPU widens 16-bit float
    collectives to fp32 (the Muon all-to-alls do the same)."""
    return _gather(w, axes, dtype)


def _mesh_spec(axes: tuple[str | None, ...]):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, None
    spec = nn.logical_to_mesh_axes(axes)
    if spec is None or all(a is None for a in spec):
        return None, None
    return mesh, jax.sharding.PartitionSpec(*spec)


def _gather(w, axes, dtype):
    local = w.astype(dtype)
    mesh, spec = _mesh_spec(axes)
    if mesh is None:
        return local
    bits16 = jnp.dtype(dtype).itemsize == 2

    def body(x):
        if bits16:
            x = jax.lax.bitcast_convert_type(x, jnp.uint16)
        for dim, ax in enumerate(spec):
            if ax is not None:
                x = jax.lax.all_gather(x, ax, axis=dim, tiled=True)
        return jax.lax.bitcast_convert_type(x, dtype) if bits16 else x

    P = jax.sharding.PartitionSpec
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(local)


def _gathered_fwd(w, axes, dtype):
    return _gather(w, axes, dtype), None


def _gathered_bwd(axes, dtype, _, g):
    # g is the full gradient of the gathered weight (the partitioner sums the batch shards'
    # parts); each device keeps its shard, in fp32
    return (nn.with_logical_constraint(g.astype(jnp.float32), axes),)


gathered.defvjp(_gathered_fwd, _gathered_bwd)


class Linear(nn.Module):
    """y = x @ kernel (+ bias). kernel: [in, out] fp32; ``fp32_out`` keeps the product in float32."""

    features: int
    axes: tuple[str, str]
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False
    init_std: float = 0.02
    fp32_out: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", normal_init(self.init_std, self.axes), (x.shape[-1], self.features), jnp.float32)
        out_dtype = jnp.float32 if self.fp32_out else self.dtype
        y = jnp.einsum(
            "...i,io->...o",
            x.astype(self.dtype),
            gathered(kernel, self.axes, self.dtype),
            preferred_element_type=out_dtype,
        )
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:]),
                (self.features,),
                jnp.float32,
            )
            y = y + bias.astype(out_dtype)
        return y


def rms_normalize(x: Array, eps: float) -> Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a float32 gain (init 1); output in ``dtype``."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        w = self.param(
            "weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), jnp.float32
        )
        return (rms_normalize(x, self.eps) * w).astype(self.dtype)


class GatedRMSNorm(nn.Module):
    """fla's FusedRMSNormGated with swish: rmsnorm(o) * weight * g * sigmoid(g), all in float32.

    o, g: [..., dv]; one weight vector of size dv shared by every head.
    """

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, o: Array, g: Array) -> Array:
        w = self.param(
            "weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (o.shape[-1],), jnp.float32
        )
        g = g.astype(jnp.float32)
        return (rms_normalize(o, self.eps) * w * g * jax.nn.sigmoid(g)).astype(self.dtype)


class ShortConv(nn.Module):
    """Depthwise causal convolution of width W followed by SiLU (fla ``ShortConvolution``).

    kernel: [W, D]; kernel[W - 1] multiplies the current token. ``cache``: [B, W, D], the last W
    raw inputs, newest last (zeros for a fresh sequence). ``lengths_B``: only the first lengths[b]
    inputs of row b are real (the new cache ends at the last real one). Returns (y, new cache).
    """

    width: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(
        self, x_BxTxD: Array, cache_BxWxD: Array | None, lengths_B: Array | None = None
    ) -> tuple[Array, Array]:
        B, T, D = x_BxTxD.shape
        W = self.width
        kernel = self.param("kernel", normal_init(self.init_std, ("conv", "heads")), (W, D), jnp.float32)
        if cache_BxWxD is None:
            cache_BxWxD = jnp.zeros((B, W, D), self.dtype)
        full = jnp.concatenate([cache_BxWxD.astype(self.dtype), x_BxTxD.astype(self.dtype)], axis=1)  # [B, W+T, D]
        k = gathered(kernel, ("conv", "heads"), self.dtype)
        y = sum(full[:, 1 + w : 1 + w + T] * k[w] for w in range(W))
        if lengths_B is None:
            return jax.nn.silu(y), full[:, -W:]
        # Only the first lengths[b] inputs are real: the cache is the W inputs ending there.
        cache = jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, W, axis=0))(full, lengths_B)
        return jax.nn.silu(y), cache


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); fla ``GatedMLP`` with swish."""

    hidden: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        lin = dict(dtype=self.dtype, init_std=self.init_std)
        gate = Linear(self.hidden, ("embed", "mlp"), name="gate_proj", **lin)(x)
        up = Linear(self.hidden, ("embed", "mlp"), name="up_proj", **lin)(x)
        return Linear(d, ("mlp", "embed"), name="down_proj", **lin)(jax.nn.silu(gate) * up)
