"""GLA kernel roofline: chunk_gla (per chunk size and kernel) and recurrent_gla against this device's peaks.

    python -m benchmarks.bench_gla [--B 4 --T 2048 --H 4 --K 128 --V 256] [--dtype float32] \\
        --out benchmarks/results/gla_cpu.json
    # GPU, the 3B layer: --B 4 --T 4096 --H 16 --K 96 --V 192 --dtype bfloat16 --pallas 64 128

``--pallas C ...`` also times the Pallas kernel at those chunk sizes. It is compiled (Triton)
on GPU only; elsewhere it runs in the Pallas interpreter and its times mean nothing.

For each implementation and pass (forward; forward+backward) it reports the median time, the
FLOPs and the minimal memory traffic, and the achieved fraction of each roofline:
- FLOPs: the dense matmuls of the chunk form, per (batch, head, chunk of C tokens)
  2*C*C*K (scores) + 2*C*C*V (scores @ v) + 2*C*K*V (q @ state) + 2*C*K*V (k^T v);
  forward+backward counts 3x the forward. Elementwise decay work is not counted.
- minimal bytes: what any implementation must move: forward reads q, k, v, g and writes o;
  backward also reads do and writes dq, dk, dv, dg (the saved chunk states are not counted).
- peaks: a 2048^3 matmul in the benchmark dtype (FLOP/s) and a large elementwise copy
  (bytes read + written per second), both measured in the same run.

``--baseline FILE`` also times another version of the XLA kernel side by side, at chunk size 128:
an ``ops/gla.py`` that defines ``chunk_gla`` (before the kernel moved out of it), or an
``ops/gla_chunk.py`` (``git show REV:laplace_jax/ops/gla_chunk.py > /tmp/gla_chunk_before.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import baseline_chunk_gla, matmul_gflops, median_seconds, write_result
from laplace_jax.ops.gla import chunk_gla, gla, recurrent_gla
from laplace_jax.platform import on_gpu


def gla_flops(B: int, T: int, H: int, K: int, V: int, C: int) -> float:
    n = -(-T // C)
    return B * H * n * (2 * C * C * K + 2 * C * C * V + 4 * C * K * V)


def min_bytes(B: int, T: int, H: int, K: int, V: int, itemsize: int) -> tuple[float, float]:
    """(forward, forward+backward) minimal traffic in bytes; g is float32."""
    qk, v, g = 2 * B * T * H * K * itemsize, B * T * H * V * itemsize, B * T * H * K * 4
    fwd = qk + v + g + v  # read q, k, v, g; write o
    bwd = qk + v + g + v + (qk + v + g)  # read q, k, v, g, do; write dq, dk, dv, dg
    return fwd, fwd + bwd


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes read + written per second by a jitted elementwise op over ``n_bytes``."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    return 2 * n_bytes / median_seconds(lambda: f(x), repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 4), ("T", 2048), ("H", 4), ("K", 128), ("V", 256)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q, k, v dtype")
    ap.add_argument("--chunk-sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--pallas", type=int, nargs="*", default=[], help="chunk sizes for the Pallas kernel")
    ap.add_argument("--no-recurrent", action="store_true", help="skip recurrent_gla (slow at long T)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another ops/gla.py whose chunk_gla is timed side by side")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    dt = jnp.dtype(a.dtype)
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (a.B, a.T, a.H, a.K), dt)
    k = jax.random.normal(ks[1], (a.B, a.T, a.H, a.K), dt)
    v = jax.random.normal(ks[2], (a.B, a.T, a.H, a.V), dt)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (a.B, a.T, a.H, a.K))) / 16

    def fwd(fn):
        return jax.jit(lambda q, k, v, g: fn(q, k, v, g)[0])

    def fwd_bwd(fn):
        return jax.jit(
            jax.grad(lambda q, k, v, g: jnp.sum(fn(q, k, v, g)[0].astype(jnp.float32)), argnums=(0, 1, 2, 3))
        )

    peak = matmul_gflops(dtype=dt, repeats=a.repeats) * 1e9
    bw = copy_bandwidth(repeats=a.repeats)
    b_fwd, b_fb = min_bytes(a.B, a.T, a.H, a.K, a.V, dt.itemsize)
    res = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "shape": dict(B=a.B, T=a.T, H=a.H, K=a.K, V=a.V, dtype=a.dtype),
        "matmul_peak_flops": peak,
        "copy_bandwidth_bytes_per_s": bw,
        "min_bytes": {"fwd": b_fwd, "fwd_bwd": b_fb},
        "impls": {},
    }

    def measure(name: str, fn, flops: float, repeats: int) -> None:
        f, fb = fwd(fn), fwd_bwd(fn)
        t_f = median_seconds(lambda: f(q, k, v, g), repeats)
        t_fb = median_seconds(lambda: fb(q, k, v, g), repeats)
        res["impls"][name] = {
            "fwd_s": t_f,
            "fwd_bwd_s": t_fb,
            "fwd_flops": flops,
            "fwd_fraction_of_flop_peak": flops / t_f / peak,
            "fwd_bwd_fraction_of_flop_peak": 3 * flops / t_fb / peak,
            "fwd_fraction_of_bandwidth": b_fwd / t_f / bw,
            "fwd_bwd_fraction_of_bandwidth": b_fb / t_fb / bw,
        }
        print(f"  {name:<12} fwd {t_f * 1e3:8.1f} ms   f+b {t_fb * 1e3:8.1f} ms", flush=True)

    print(f"peaks: matmul {peak / 1e9:.1f} GFLOP/s ({a.dtype}), copy {bw / 1e9:.1f} GB/s on {res['device']}")
    for C in a.chunk_sizes:
        fn = lambda q, k, v, g, C=C: chunk_gla(q, k, v, g, chunk_size=C)  # noqa: E731
        measure(f"chunk{C}", fn, gla_flops(a.B, a.T, a.H, a.K, a.V, C), a.repeats)
    if a.pallas and not on_gpu():
        print("  (the Pallas kernel is interpreted on this backend: its times are not kernel times)")
    for C in a.pallas:
        fn = lambda q, k, v, g, C=C: gla(q, k, v, g, impl="pallas", chunk_size=C)  # noqa: E731
        measure(f"pallas{C}", fn, gla_flops(a.B, a.T, a.H, a.K, a.V, C), a.repeats)
    if a.baseline:
        base = baseline_chunk_gla(a.baseline)
        fn = lambda q, k, v, g: base(q, k, v, g, None, 128)  # noqa: E731
        measure("baseline128", fn, gla_flops(a.B, a.T, a.H, a.K, a.V, 128), a.repeats)
    if not a.no_recurrent:
        measure("recurrent", recurrent_gla, gla_flops(a.B, a.T, a.H, a.K, a.V, 128), 3)
    summarize(res["impls"])
    write_result(res, "bench_gla", argv, a.out)
    return 0


def summarize(impls: dict) -> None:
    """Add each kernel's forward + backward speedup over the recurrent one; print the table."""
    rec = impls.get("recurrent")
    print(f"{'impl':<12} {'fwd ms':>8} {'f+b ms':>8} {'f+b %FLOP':>10} {'f+b %BW':>8} {'f+b vs recurrent':>17}")
    for name, r in impls.items():
        if rec:
            r["fwd_bwd_speedup_over_recurrent"] = rec["fwd_bwd_s"] / r["fwd_bwd_s"]
        print(
            f"{name:<12} {r['fwd_s'] * 1e3:>8.1f} {r['fwd_bwd_s'] * 1e3:>8.1f} "
            f"{100 * r['fwd_bwd_fraction_of_flop_peak']:>9.1f}% {100 * r['fwd_bwd_fraction_of_bandwidth']:>7.1f}% "
            f"{r.get('fwd_bwd_speedup_over_recurrent', float('nan')):>16.1f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
