"""FSDP and collectives for the model and the optimizer, without mesh names in model code.

- ``constrain`` / ``local_shape``: logical sharding constraints and per-device parameter shapes,
  aware of whether we trace inside the train step's ``shard_map``.
- ``gathered``: every weight the model reads; an all-gather of its shards in the compute dtype,
  whose gradient is a reduce-scatter (a custom VJP).
- ``as_wire``: 16-bit float payloads cross collectives as their uint16 bits, because some
  backends (XLA:CPU) widen 16-bit float collectives to fp32; the Muon all-to-alls send them in
  pairs, as uint32 words.
- ``context_axis`` / ``from_previous_slice``: context parallelism, where the train step splits
  each sequence into consecutive slices along the mesh axis bound to the logical name "context".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def as_wire(collective: Callable[[Array], Array], x: Array, pairs: bool = False) -> Array:
    """``collective(x)``, with a 16-bit float ``x`` sent as its uint16 bits (2 bytes an element on
    every backend) and turned back into its dtype after. ``pairs``: as uint32 words, each two elements
    half the last axis apart (its size even; ``collective`` must not split that axis): the same
    bytes, and for a large all-to-all far less of the TPU compiler's host memory (the Muon
    exchange of the 3B, 4 layers, at fsdp 2: over 14 GB as uint16, 4 GB as words)."""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return collective(x)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    if not pairs:
        return jax.lax.bitcast_convert_type(collective(bits), x.dtype)
    half = x.shape[-1] // 2  # word i: element i (low bits) and element half + i (high bits)
    lo, hi = (b.astype(jnp.uint32) for b in (bits[..., :half], bits[..., half:]))
    words = collective(lo | (hi << 16))
    back = jnp.concatenate([(words & 0xFFFF).astype(jnp.uint16), (words >> 16).astype(jnp.uint16)], axis=-1)
    return jax.lax.bitcast_convert_type(back, x.dtype)


def in_shard_map(mesh: jax.sharding.AbstractMesh) -> bool:
    """Whether we trace inside a ``shard_map`` over ``mesh`` (the train step's FSDP region)."""
    return any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    """``nn.with_logical_constraint``, except inside a ``shard_map`` (arrays there are per-device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and in_shard_map(mesh):
        return x
    return nn.with_logical_constraint(x, axes)


def local_shape(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """A parameter's shape as the model sees it: its per-device shard inside the train step's
    ``shard_map`` (each sharded dim divided by its mesh axes' sizes), ``shape`` everywhere else."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not in_shard_map(mesh):
        return shape
    spec = nn.logical_to_mesh_axes(axes) or (None,) * len(shape)
    sizes = [
        1 if ax is None else math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax)) for ax in spec
    ]
    return tuple(d // n for d, n in zip(shape, sizes, strict=True))


def context_axis() -> str | None:
    """The mesh axis that splits sequences into slices (the one the rules bind to the logical
    name "context"), when we trace inside the train step's ``shard_map`` and it has more than one
    device; None otherwise (one device, eval, serving: the whole sequence is here)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not in_shard_map(mesh):
        return None
    (ax,) = nn.logical_to_mesh_axes(("context",)) or (None,)
    return ax if isinstance(ax, str) and mesh.shape[ax] > 1 else None


def from_previous_slice(x: Array, axis: str) -> Array:
    """Under context parallelism along ``axis``, the previous slice's ``x`` (zeros on the first
    slice): one neighbour exchange. For what a slice needs of the tokens before it (the short
    convolution's last inputs)."""
    n = jax.lax.axis_size(axis)
    with jax.named_scope("context_halo"):  # the name ``hlo_stats.source_of`` files it under
        return as_wire(lambda y: jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(n - 1)]), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gathered(w: Array, axes: tuple[str | None, ...], dtype: jnp.dtype) -> Array:
    """A weight with logical ``axes``, cast to ``dtype`` on its shards and then all-gathered for
    use, so an FSDP gather moves ``dtype`` bytes (bf16: half of fp32). The gradient goes back to
    the shards in fp32. Every parameter the model reads goes through here.

    - No logical axis rules or mesh (one device, serving): just the cast.
    - Inside the train step's ``shard_map`` (``train.step``): an explicit all-gather, and the
      gradient is reduce-scattered (``psum_scatter``): each device receives only its shard.
    - Under plain ``jit`` (eval): the same all-gather in its own ``shard_map``; XLA's partitioner
      reduces the gradient.

    16-bit payloads cross the collectives as uint16 (``as_wire``)."""
    return _gather(w, axes, dtype)


def _mesh_spec(axes: tuple[str | None, ...]):
    """(abstract mesh, PartitionSpec of ``axes`` under the current rules), or (None, None) with no mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, None
    spec = nn.logical_to_mesh_axes(axes) or (None,) * len(axes)
    return mesh, jax.sharding.PartitionSpec(*spec)


def _size(mesh: jax.sharding.AbstractMesh, ax: str | tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax))


def _all_gather(x: Array, spec: jax.sharding.PartitionSpec) -> Array:
    def gather(x):
        for dim, ax in enumerate(spec):
            if ax is not None:
                x = jax.lax.all_gather(x, ax, axis=dim, tiled=True)
        return x

    return as_wire(gather, x)


def _gather(w, axes, dtype):
    local = w.astype(dtype)
    mesh, spec = _mesh_spec(axes)
    if mesh is None:
        return local
    if in_shard_map(mesh):
        return _all_gather(local, spec)
    if all(ax is None or _size(mesh, ax) == 1 for ax in spec):
        return local
    body = functools.partial(_all_gather, spec=spec)
    P = jax.sharding.PartitionSpec
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(local)


def _gathered_fwd(w, axes, dtype):
    return _gather(w, axes, dtype), None


def _gathered_bwd(axes, dtype, _, g):
    g = g.astype(jnp.float32)
    mesh, spec = _mesh_spec(axes)
    if mesh is None:
        return (g,)
    if not in_shard_map(mesh):
        # the full gradient of the gathered weight; the partitioner reduces it to the shards
        return (nn.with_logical_constraint(g, axes),)
    # g is this device's part (from its rows of the batch): sum it over the sharded axes keeping
    # this device's shard (reduce-scatter), and over every other axis in full
    sharded = set()
    for dim, ax in enumerate(spec):
        if ax is not None:
            g = jax.lax.psum_scatter(g, ax, scatter_dimension=dim, tiled=True)
            sharded.update((ax,) if isinstance(ax, str) else ax)
    rest = tuple(a for a in mesh.axis_names if a not in sharded and mesh.shape[a] > 1)
    return (jax.lax.psum(g, rest) if rest else g,)


gathered.defvjp(_gathered_fwd, _gathered_bwd)
