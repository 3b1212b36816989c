"""chunk_gla throughput vs this machine's fp32 matmul peak, vs recurrent_gla, and a chunk-size sweep.

    python -m benchmarks.bench_gla [--B 4 --T 2048 --H 4 --K 128 --V 256] [--out results/gla_cpu.json]

FLOPs counted: the dense matmuls the chunk form performs, per (batch, head, chunk of C tokens):
2*C*C*K (scores) + 2*C*C*V (scores @ v) + 2*C*K*V (q @ state) + 2*C*K*V (k^T v). Backward is
counted as 2x forward, so forward+backward = 3x. Elementwise work (decays) is not counted.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import jax.numpy as jnp

from benchmarks.common import batched_matmul_gflops, matmul_gflops, median_seconds
from laplace_jax.ops.gla import chunk_gla, recurrent_gla


def gla_flops(B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    n = -(-T // C)
    return B * H * n * (2 * C * C * K + 2 * C * C * V + 4 * C * K * V)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 4), ("T", 2048), ("H", 4), ("K", 128), ("V", 256)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (a.B, a.T, a.H, a.K))
    k = jax.random.normal(ks[1], (a.B, a.T, a.H, a.K))
    v = jax.random.normal(ks[2], (a.B, a.T, a.H, a.V))
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (a.B, a.T, a.H, a.K))) / 16

    def fwd(fn):
        return jax.jit(lambda q, k, v, g: fn(q, k, v, g)[0])

    def fwd_bwd(fn):
        return jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(fn(q, k, v, g)[0]), argnums=(0, 1, 2, 3)))

    peak = matmul_gflops(repeats=a.repeats)
    batched = batched_matmul_gflops(batch=a.B * a.H * -(-a.T // 128), k=a.K, n=a.V, repeats=a.repeats)
    res = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.processor() or platform.machine(),
        "shape": dict(B=a.B, T=a.T, H=a.H, K=a.K, V=a.V),
        "matmul_fp32_gflops": peak,
        "batched_matmul_fp32_gflops": batched,
        "chunk": {},
    }
    for C in (64, 128, 256):
        fn = lambda q, k, v, g, C=C: chunk_gla(q, k, v, g, chunk_size=C)  # noqa: E731
        f, fb = fwd(fn), fwd_bwd(fn)
        t_f = median_seconds(lambda f=f: f(q, k, v, g), a.repeats)
        t_fb = median_seconds(lambda fb=fb: fb(q, k, v, g), a.repeats)
        fl = gla_flops(a.B, a.T, a.H, a.K, a.V, C)
        res["chunk"][C] = {
            "fwd_s": t_f,
            "fwd_bwd_s": t_fb,
            "fwd_gflops": fl / t_f / 1e9,
            "fwd_bwd_gflops": 3 * fl / t_fb / 1e9,
        }
    f, fb = fwd(recurrent_gla), fwd_bwd(recurrent_gla)
    res["recurrent"] = {
        "fwd_s": median_seconds(lambda: f(q, k, v, g), 3, 1),
        "fwd_bwd_s": median_seconds(lambda: fb(q, k, v, g), 3, 1),
    }
    c128 = res["chunk"][128]
    res["summary"] = {
        "fwd_bwd_fraction_of_matmul_peak_C128": c128["fwd_bwd_gflops"] / peak,
        "fwd_fraction_of_matmul_peak_C128": c128["fwd_gflops"] / peak,
        "speedup_over_recurrent_fwd_C128": res["recurrent"]["fwd_s"] / c128["fwd_s"],
        "speedup_over_recurrent_fwd_bwd_C128": res["recurrent"]["fwd_bwd_s"] / c128["fwd_bwd_s"],
    }
    print(
        f"fp32 matmul peak (2048^3): {peak:.1f} GFLOP/s on {res['device']}; "
        f"batched 128x{a.K}x{a.V} matmuls: {batched:.1f} GFLOP/s"
    )
    print(f"{'C':>5} {'fwd ms':>9} {'fwd GF/s':>9} {'f+b ms':>9} {'f+b GF/s':>9} {'f+b % peak':>10}")
    for C, r in res["chunk"].items():
        print(
            f"{C:>5} {r['fwd_s'] * 1e3:>9.1f} {r['fwd_gflops']:>9.1f} {r['fwd_bwd_s'] * 1e3:>9.1f} "
            f"{r['fwd_bwd_gflops']:>9.1f} {100 * r['fwd_bwd_gflops'] / peak:>9.1f}%"
        )
    rec = res["recurrent"]
    print(
        f"recurrent: fwd {rec['fwd_s'] * 1e3:.1f} ms, f+b {rec['fwd_bwd_s'] * 1e3:.1f} ms; chunk(128) speedup "
        f"fwd {res['summary']['speedup_over_recurrent_fwd_C128']:.1f}x, "
        f"f+b {res['summary']['speedup_over_recurrent_fwd_bwd_C128']:.1f}x"
    )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
