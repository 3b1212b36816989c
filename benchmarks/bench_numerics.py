"""The "measured" column of README's tolerance table: kernel and model errors against their oracles.

    python -m benchmarks.bench_numerics --out benchmarks/results/numerics_kernels.json   # ~10 min here

Each figure is the worst case over the inputs the tests use (``ops.gla.naive.random_gla_inputs``),
measured against the package's float64 reference (``ops/gla/naive.py``: NumPy, no shared code
with the kernels; the tests check the kernels against the PyTorch one in ``tests/torch_gla.py``):
- forward: max |o - o64| / max |o64| of ``chunk_gla`` (the XLA kernel and the Pallas GPU and
  TPU kernels, interpreted here) and ``recurrent_gla`` in fp32 against the float64 recurrence, over T,
  weak and strong decay, with and without an initial state (outputs and final states);
- gradients: the same error for dq, dk, dv, dg and d initial state against the float64
  reverse-time recurrence (T=150, chunk 64), and against ``jax.grad(recurrent_gla)`` (T=300);
- bf16: RMS relative error of each kernel on bf16 inputs vs fp32 (T=512; output, and the worst
  of dq, dk, dv, dg for a random output cotangent), and of a random
  2-layer model's logits with bf16 compute vs fp32 (T=200).
The tests assert the bounds; this script records the figures the README quotes.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.common import write_result
from laplace_jax import ModelConfig, forward, init_params
from laplace_jax.ops.gla import chunk_gla, gla, recurrent_gla
from laplace_jax.ops.gla.naive import naive_gla, naive_gla_vjp, random_gla_inputs, rel_error

T_CHUNK = (1, 100, 128, 300, 2048)
T_PALLAS = (100, 128, 2048)  # the interpreter is slow on CPU; the tests use the same subset
PALLAS = ("pallas", "mosaic")  # the Pallas kernels (GPU, TPU), interpreted here
GRADS = ("q", "k", "v", "g", "s0")


def _chunk(kernel: str, chunk_size: int = 128):
    return functools.partial(gla, impl=kernel, chunk_size=chunk_size)


def forward_errors() -> dict[str, float]:
    worst = dict.fromkeys(("chunk", *PALLAS, "recurrent"), 0.0)
    cases = [(T, d, s) for T in sorted(set(T_CHUNK) | set(T_PALLAS)) for d in ("weak", "strong") for s in (False, True)]
    for T, decay, with_state in tqdm(cases, desc="forward vs float64"):
        q, k, v, g, s0 = random_gla_inputs(T, decay, seed=T)
        init = s0 if with_state else None
        o64, s64 = naive_gla(q, k, v, g, initial_state=init)
        fns = {"recurrent": recurrent_gla}
        lengths = {"chunk": T_CHUNK} | dict.fromkeys(PALLAS, T_PALLAS)
        fns.update({kernel: _chunk(kernel) for kernel, ts in lengths.items() if T in ts})
        for name, fn in fns.items():
            o, s = fn(q, k, v, g, initial_state=init)
            worst[name] = max(worst[name], rel_error(o, o64), rel_error(s, s64))
    return worst


def _weighted(fn, w_o: np.ndarray, w_s: np.ndarray, *args) -> jax.Array:
    o, s = fn(*args[:4], initial_state=args[4])
    return jnp.sum(o * w_o.astype(np.float32)) + jnp.sum(s * w_s.astype(np.float32))


def _grads(fn, w_o: np.ndarray, w_s: np.ndarray, inputs: tuple) -> tuple:
    return jax.grad(functools.partial(_weighted, fn, w_o, w_s), argnums=range(5))(*inputs)


def gradient_errors() -> dict[str, dict[str, float]]:
    out = {}
    for kernel in ("chunk", *PALLAS):
        vs_float64, vs_recurrent = [], []
        for decay in ("weak", "strong"):
            inputs = random_gla_inputs(150, decay, seed=11)
            r = np.random.default_rng(2)
            w_o, w_s = r.standard_normal((2, 150, 2, 32)), r.standard_normal(inputs[4].shape)
            ref = naive_gla_vjp(*inputs, do=w_o, dS_final=w_s)
            ours = _grads(_chunk(kernel, 64), w_o, w_s, inputs)
            vs_float64 += [rel_error(a, b) for a, b in zip(ours, ref, strict=True)]

            inputs = random_gla_inputs(300, decay, seed=7)
            r = np.random.default_rng(1)
            w_o, w_s = r.standard_normal((2, 300, 2, 32)), r.standard_normal(inputs[4].shape)
            ours = _grads(_chunk(kernel), w_o, w_s, inputs)
            ref = _grads(recurrent_gla, w_o, w_s, inputs)
            vs_recurrent += [rel_error(a, np.asarray(b, np.float64)) for a, b in zip(ours, ref, strict=True)]
        out[kernel] = {
            "vs_float64_min": min(vs_float64),
            "vs_float64_max": max(vs_float64),
            "vs_jax_grad_recurrent_max": max(vs_recurrent),
        }
    return out


def _rms_rel(x: jax.Array, ref: jax.Array) -> float:
    return float(jnp.linalg.norm(x.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def bf16_errors() -> dict[str, float]:
    q, k, v, g, _ = random_gla_inputs(512, "weak", seed=3)
    w_o = np.random.default_rng(4).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)

    def grads(kernel: str, dtype) -> tuple[jax.Array, ...]:
        def loss(q, k, v, g):
            o, _ = gla(q.astype(dtype), k.astype(dtype), v.astype(dtype), g, impl=kernel)
            return jnp.sum(o.astype(jnp.float32) * w_o)

        return jax.grad(loss, argnums=range(4))(q, k, v, g)

    ref, _ = chunk_gla(q, k, v, g)
    ref_grads = grads("chunk", jnp.float32)
    out = {}
    for kernel in ("chunk", *PALLAS):
        o, _ = gla(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), g, impl=kernel)
        out[f"kernel_{kernel}"] = _rms_rel(o, ref)
        out[f"gradients_{kernel}"] = max(map(_rms_rel, grads(kernel, jnp.bfloat16), ref_grads))
    kw = dict(vocab_size=256, d_model=128, n_layers=2, n_heads=2, use_short_conv=True, chunk_size=64, init_std=0.05)
    params = init_params(ModelConfig(**kw), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 200), 0, 256)
    ref = forward(ModelConfig(**kw), params, tokens)
    lo = forward(ModelConfig(**kw, dtype="bfloat16"), params, tokens)
    out["model_logits"] = float(jnp.linalg.norm(lo - ref) / jnp.linalg.norm(ref))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "forward_max_rel": forward_errors()}
    res["gradients_max_rel"] = gradient_errors()
    res["bf16_rms_rel"] = bf16_errors()
    for section in ("forward_max_rel", "gradients_max_rel", "bf16_rms_rel"):
        print(section, res[section])
    write_result(res, "bench_numerics", argv, a.out)


if __name__ == "__main__":
    main()
