"""Gradient exactness of chunk_gla across decay strengths: the figures behind the kernel's promise.

    python -m benchmarks.bench_decay_sweep [--baseline OLD_gla_chunk.py] --out benchmarks/results/decay_sweep.json

For each per-token log-decay g in {-0.01, -0.1, -1, -4, -8, -16} (nearly uniform: 5% jitter per
token and channel) and "mixed" (each key channel at one of those), B2 T150 H2 K32 V32, chunk 64,
fp32 inputs with an initial state and a final-state cotangent, it compares the gradients of the
GLA kernels (XLA; the Pallas GPU and TPU kernels, interpreted off their hardware) with ``jax.grad``
of the plain token recurrence (``recurrent_gla``) in float64. Two errors per gradient, both relative to the
reference's max |value|: per element, and summed over batch and positions (what a gate bias sees);
for dg also per channel (each (head, key channel) against its own max |value|), so the "mixed"
row cannot hide a strongly decaying channel behind a weak one's larger gradients.
``--baseline FILE`` adds another version of ``ops/gla_chunk.py`` (its ``chunk_gla_padded``),
timed on the same inputs, e.g. ``git show REV:laplace_jax/ops/gla_chunk.py``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import baseline_chunk_gla, write_result
from laplace_jax.ops.gla import gla, recurrent_gla
from laplace_jax.ops.gla.naive import SWEEP_DECAYS, SWEEP_SHAPE, decay_sweep_inputs

GRADS = ("q", "k", "v", "g", "s0")
C = SWEEP_SHAPE["chunk_size"]


def grad_fn(fn):
    def loss(q, k, v, g, s0, w_o, w_s):
        o, s = fn(q, k, v, g, s0)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    return jax.jit(jax.grad(loss, argnums=range(5)))


def errors(ours, ref) -> dict[str, dict[str, float]]:
    out = {}
    for name, a, b in zip(GRADS, ours, ref, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        per = float(np.abs(a - b).max() / np.abs(b).max())
        if name == "s0":
            summed = per
        else:
            sa, sb = a.sum(axis=(0, 1)), b.sum(axis=(0, 1))
            summed = float(np.abs(sa - sb).max() / np.abs(sb).max())
        out[name] = {"per_element": per, "summed": summed}
    a, b = (np.asarray(x, np.float64) for x in (ours[3], ref[3]))
    out["g"]["per_channel"] = float(np.max(np.abs(a - b).max(axis=(0, 1)) / np.abs(b).max(axis=(0, 1))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="another ops/gla_chunk.py, measured on the same inputs")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    def kernel(name: str):
        return grad_fn(lambda q, k, v, g, s0: gla(q, k, v, g, impl=name, initial_state=s0, chunk_size=C))

    kernels = {name: kernel(name) for name in ("chunk", "pallas", "mosaic")}
    if a.baseline:
        base = baseline_chunk_gla(a.baseline)
        kernels["baseline"] = grad_fn(lambda q, k, v, g, s0: base(q, k, v, g, s0, C))
    res = {"jax": jax.__version__, "shape": dict(SWEEP_SHAPE), "decays": {}}
    for decay in SWEEP_DECAYS:
        xs = decay_sweep_inputs(decay)
        with jax.enable_x64(True):
            reference = grad_fn(lambda q, k, v, g, s0: recurrent_gla(q, k, v, g, initial_state=s0))(*xs)
            reference = [np.asarray(x) for x in reference]
        xs32 = [x.astype(np.float32) for x in xs]
        row = {name: errors(fn(*xs32), reference) for name, fn in kernels.items()}
        res["decays"][str(decay)] = row
        cells = "  ".join(
            f"{name}: dg {r['g']['per_element']:.1e}/{r['g']['summed']:.1e}/{r['g']['per_channel']:.1e} "
            f"others <= {max(r[n]['per_element'] for n in GRADS if n != 'g'):.1e}"
            for name, r in row.items()
        )
        print(f"g {decay!s:>6}  {cells}", flush=True)
    write_result(res, "bench_decay_sweep", argv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
