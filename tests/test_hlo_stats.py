"""Collective bytes read from compiled HLO: loop bodies count trip-count times."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from laplace_jax.hlo_stats import collective_bytes


def test_collective_inside_scan_counts_per_iteration():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])

    def body(x):
        def step(c, _):
            return jax.lax.all_to_all(c, "x", 0, 0, tiled=True) * 1.5, None

        return jax.lax.scan(step, x, None, length=24)[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    stats = collective_bytes(f.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32)).compile().as_text())
    assert stats["all-to-all"]["ops"] == 24
    assert stats["all-to-all"]["bytes"] == 24 * 8 * 16 * 4  # per-device block [8, 16] f32, 24 times
    assert stats["all-gather"]["ops"] == 0
