"""The hybrids' softmax attention kernel compiled for TPU chips without a TPU: the compiler's
estimated time, a hand-counted limit and the per-source breakdown, forward and forward +
backward, windowed and full. Needs ``jax[tpu]`` (libtpu); the figures are the TPU compiler's
estimate (its cost model's estimated_cycles), never a measurement.

    python -m benchmarks.bench_attention_tpu --chips v5e v5p --out benchmarks/results/attention_tpu.json

The layer is a 3B-wide attention layer: 4 rows of 4,096 tokens, 16 query heads of 192 (d_model
3,072), 4 kv heads, bf16, 128-query blocks. The limit: q k^T and p v over the keys each query
sees (x 3.5 for forward + backward: the backward recomputes the scores), over the chip's bf16
peak; or q, k, v and o read and written once over HBM bandwidth, whichever is larger.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import write_result
from laplace_jax.ops.attention import chunk_attention
from laplace_jax.tpu import report, tpu_devices

B, T, H, N, D, CHUNK = 4, 4096, 16, 4, 192, 128
WINDOWS = (2048, None)


def programs(window: int | None):
    def fwd(q, k, v):
        return chunk_attention(q, k, v, window=window, chunk_size=CHUNK)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32))

    seen = sum(min(t + 1, window or T) for t in range(T))  # keys per query, summed over the queries
    flops = 4 * B * H * D * seen
    io = 2 * (2 * B * T * H * D + 2 * B * T * N * D)  # bf16 q and o, k and v
    return [("forward", fwd, flops, io), ("forward + backward", jax.grad(loss, argnums=(0, 1, 2)), 3.5 * flops, 2 * io)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chips", nargs="+", default=["v5e", "v5p"], help="TPU generations (one chip each)")
    ap.add_argument("--out", default=None, help="JSON to write")
    a = ap.parse_args(argv)
    rows = []
    for name in a.chips:
        chip, devices = tpu_devices(f"{name}:1x1" if name == "v5e" else f"{name}:1x1x1")
        one = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
        q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=one)
        kv = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16, sharding=one)
        for window in WINDOWS:
            for what, fn, flops, io in programs(window):
                compiled = jax.jit(fn).lower(q, kv, kv).compile()
                rep = report(compiled, chip, f"attention {what}, window {window or 'full'}", flops=flops, bytes_=io)
                rows.append({"window": window, "pass": what, **rep})
                print(f"{chip.name} {rep['program']}: {rep['estimate']['seconds'] * 1e3:.2f} ms estimated, "
                      f"{rep['estimate_over_limit']:.1f}x the limit")  # fmt: skip
    res = {"shape": {"batch": B, "tokens": T, "heads": H, "kv_heads": N, "head_dim": D, "chunk": CHUNK}, "rows": rows}
    write_result(res, "bench_attention_tpu", argv, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
