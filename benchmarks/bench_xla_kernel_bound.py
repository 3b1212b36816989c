"""Where the XLA GLA kernel's time goes on the TPU compiler, by ablation: the kernel as it is, then
with its exact intra-chunk decays replaced by inexact stand-ins that cost less, so the gap to
issue 51's goals (v5e: forward <= 8x and forward + backward <= 10x the hand-counted limit) is
split between the loop around the chunks and the exact decays inside them.

    python -m benchmarks.bench_xla_kernel_bound --out benchmarks/results/xla_kernel_bound.json

Variants (``layout="full"``, what ``auto`` compiles for TPU and Neuron; 3B layer, bf16):
- ``exact``: ``chunk_gla`` unchanged.
- ``exponents_free``: each level's exponents as exp((l + 1) g) instead of the 0/1-matrix direct
  sums (``levels._full_factors``): the seven levels' scaled queries and keys, their masked score
  sum and the backward's level gradients stay; only the sums' cost goes.
- ``one_matmul_scores``: the intra-chunk scores as one causal-masked matmul of q e^g and k e^g,
  the gate's gradient as q dq - k dk (``levels.scores_full``, ``levels.scores_bwd_full``): the cost
  of a chunk's scores without any level structure. The loop, the state path, the output writes
  and the backward's state gradients are those of ``exact``.
The stand-ins are wrong numbers, compiled only for their cost; nothing runs. Times are the TPU
compiler's estimates for the named chip, never measurements.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from benchmarks.common import write_result
from laplace_jax.ops.gla import levels
from laplace_jax.ops.gla.chunk import chunk_gla

Array = jax.Array
CHUNK = 128


def _free_factors(g: Array) -> tuple[dict, Array, Array]:
    """``levels._full_factors`` with exp((l + 1) g) per level for the direct sums."""
    m = levels.level_matrices(g.shape[-2])
    gp = levels._pad(g, levels.padded(g.shape[-2]))
    n_levels = m["upper"].shape[0]
    upper = jnp.asarray(m["upper"]).reshape(-1, *([1] * (g.ndim - 2)), gp.shape[-2], 1)
    e = jnp.exp(jnp.arange(1, n_levels + 1, dtype=jnp.float32).reshape(-1, *([1] * g.ndim)) * gp[None])
    return m, jnp.where(upper, e, 0.0), jnp.where(upper, 0.0, e)


def _one_matmul_scores(q: Array, k: Array, g: Array, scale: float, dtype) -> Array:
    C = q.shape[-2]
    e = jnp.exp(g)
    a = levels.dot("...rk,...sk->...rs", q * e, k * e, dtype)
    return scale * jnp.where(jnp.tril(jnp.ones((C, C), bool)), a, 0.0)


def _one_matmul_scores_bwd(q: Array, k: Array, g: Array, dA: Array, scale: float, dtype):
    e = jnp.exp(g)
    dq = scale * e * levels.dot("...rs,...sk->...rk", dA, k * e, dtype)
    dk = scale * e * levels.dot("...rs,...rk->...sk", dA, q * e, dtype)
    return dq, dk, q * dq - k * dk


# variant -> (what it compiles, the functions of ``levels`` it replaces)
STANDINS = {
    "exact": ("the kernel as it is", {}),
    "exponents_free": ("level exponents free (exp((l + 1) g), no 0/1 sums)", {"_full_factors": _free_factors}),
    "one_matmul_scores": (
        "a chunk's scores as one masked matmul (no levels)",
        {"scores_full": _one_matmul_scores, "scores_bwd_full": _one_matmul_scores_bwd},
    ),
}


@contextlib.contextmanager
def standin(variant: str) -> Iterator[None]:
    """``levels`` with ``variant``'s functions in place while tracing; restored on exit. JAX's
    caches are cleared on both sides, so no trace made with one variant serves another."""
    patches = STANDINS[variant][1]
    saved = {name: getattr(levels, name) for name in patches}
    jax.clear_caches()
    try:
        for name, fn in patches.items():
            setattr(levels, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(levels, name, fn)
        jax.clear_caches()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5e:1x1", help="the deviceless TPU topology (issue 51 item 3: v5e)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from laplace_jax.tools.tpu_check import SHAPES, compile_for_tpu, kernel_programs
    from laplace_jax.tpu import report, tpu_devices

    chip, devices = tpu_devices(a.topology)
    shape = SHAPES["3b"]
    fwd = lambda q, k, v, g: chunk_gla(q, k, v, g, chunk_size=CHUNK, layout="full")[0]  # noqa: E731
    args, programs = kernel_programs(fwd, shape, CHUNK)
    rows = []
    for variant, (description, _) in STANDINS.items():
        for what, fn, work, moved in programs:
            with standin(variant):
                compiled = compile_for_tpu(fn, args, devices, free_layouts=True)
            rep = report(compiled, chip, what, flops=work, bytes_=moved)
            est = rep["estimate"]
            rows.append(
                {
                    "variant": variant,
                    "description": description,
                    "program": what,
                    "estimate_s": est["seconds"],
                    "limit_s": rep["limit"]["seconds"],
                    "estimate_over_limit": rep["estimate_over_limit"],
                    "top_sources": [{k: s[k] for k in ("source", "seconds")} for s in est["by_source"][:6]],
                }
            )
            print(f"{variant:18s} {what:19s} {est['seconds'] * 1e3:7.3f} ms  {rep['estimate_over_limit']:5.2f}x")
    res = {"chip": chip.name, "shape": dict(zip("BTHKV", shape, strict=True)), "chunk": CHUNK, "label": est["label"]}
    write_result({**res, "rows": rows}, "bench_xla_kernel_bound", argv, a.out)


if __name__ == "__main__":
    main()
