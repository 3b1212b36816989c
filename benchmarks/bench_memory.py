"""Compiled memory of the GLA kernel's gradient and of a train step per remat policy (nothing allocated).

    python -m benchmarks.bench_memory kernel [--B 4 --T 4096 --H 16 --K 96 --V 192]
    python -m benchmarks.bench_memory step --config configs/gla_340m.py --batch 16 --seq 2048 \\
        --dtype bfloat16 --remat none full save_dots save_gla [--time-batch 1] --out results.json
    python -m benchmarks.bench_memory decode --config configs/3b.py --width 256 [--weights-dtype bfloat16]
    python -m benchmarks.bench_memory sampler --config configs/3b.py --width 256

Both read XLA's ``memory_analysis()`` (temporaries, arguments, outputs) and ``cost_analysis()``
(FLOPs, bytes accessed) of executables compiled from abstract inputs, so anyone can check memory
on a CPU.
- ``kernel``: ``jax.grad`` of ``chunk_gla`` (bf16 q, k, v; fp32 g), temporaries against its
  inputs + outputs.
- ``step``: the real single-device train step (Muon + AdamW, one micro-batch) of a config.
  ``--time-batch N`` also runs each policy at batch N on this machine and reports the median
  step time (the full batch would take minutes per step on a CPU). ``--kernel-standin`` swaps
  the GLA kernel for one that keeps only its inputs, to see how much of a step is the kernel's.
- ``decode``: one ``decode_step`` of W sequences (state donated), bytes accessed against the
  minimum (weights read once + the state read and written once) and temporaries against the
  state. The decode step's layer loop is unrolled, so the cost analysis counts every layer.
  XLA:CPU upcasts bf16 dots to fp32 (one layer's weights at a time under the memory-ordered
  schedule, ``laplace_jax/xla_flags.py``), so bf16 temporaries on CPU are not what a GPU
  allocates; ``--packed`` compiles the weights as serving places them on CPU.
"""

from __future__ import annotations

import argparse
import platform as host
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import baseline_chunk_gla, write_result

GiB = 2**30


def kernel_report(B: int, T: int, H: int, K: int, V: int, chunk_size: int = 128, baseline: str | None = None) -> dict:
    """``baseline``: another version's ``ops/gla.py`` defining ``chunk_gla`` (e.g. 79ee48b, the
    autodiff'd kernel), measured instead of this one."""
    if baseline:
        base = baseline_chunk_gla(baseline)
        chunk_gla = lambda q, k, v, g, chunk_size: base(q, k, v, g, None, chunk_size)  # noqa: E731
    else:
        from laplace_jax.ops.gla import chunk_gla

    bf16, f32 = jnp.bfloat16, jnp.float32
    args = [jax.ShapeDtypeStruct((B, T, H, K), bf16)] * 2 + [jax.ShapeDtypeStruct((B, T, H, V), bf16)]
    args += [jax.ShapeDtypeStruct((B, T, H, K), f32)]

    def loss(q, k, v, g):
        return jnp.sum(chunk_gla(q, k, v, g, chunk_size=chunk_size)[0].astype(f32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
    m = compiled.memory_analysis()
    io = sum(a.size * a.dtype.itemsize for a in args) + B * T * H * V * 2  # inputs + the bf16 output
    states = (T // chunk_size) * B * H * K * V * 4
    return {
        "shape": dict(B=B, T=T, H=H, K=K, V=V, chunk_size=chunk_size),
        "temporaries_bytes": int(m.temp_size_in_bytes),
        "inputs_plus_outputs_bytes": int(io),
        "chunk_states_bytes": int(states),
        "temporaries_over_io": m.temp_size_in_bytes / io,
    }


def _inputs_only_standin():
    """A stand-in for chunk_gla whose autodiff keeps only its inputs: what the rest of the step
    needs, to attribute memory to the kernel. Its output and gradients depend on their inputs
    (o = v; d(q, k, g) = (q, k, g) * mean(do); dv = do), so XLA cannot fold the layer's
    backward away as it could with zeros."""

    @jax.custom_vjp
    def standin(q, k, v, g, s0):
        return v, s0

    def bwd(res, cot):
        q, k, _, g, _ = res
        do, ds = cot
        m = jnp.mean(do.astype(jnp.float32))
        return (q * m.astype(q.dtype), k * m.astype(k.dtype), do, g * m, ds)

    standin.defvjp(lambda q, k, v, g, s0: (standin(q, k, v, g, s0), (q, k, v, g, s0)), bwd)

    def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, chunk_size=128):
        B, _, H, K = q.shape
        s0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
        return standin(q, k, v, g, s0)

    return chunk_gla


def step_report(config: str, batch: int, seq: int, dtype: str, remat: str, time_batch: int, standin: bool) -> dict:
    from laplace_jax.config import RunConfig, load_config_file
    from laplace_jax.hlo_stats import memory_report
    from laplace_jax.layers import gla as gla_layer
    from laplace_jax.train.trainer import Trainer

    if standin:
        gla_layer.chunk_gla = _inputs_only_standin()

    cfg = load_config_file(config)
    cfg.model.update(dtype=dtype, remat=remat)
    cfg.data.update(global_batch=batch, seq_len=seq)
    cfg.train.update(grad_accum=1)
    cfg.mesh.update(data=1, fsdp=1)
    trainer = Trainer(RunConfig.from_mapping(cfg), devices=jax.devices()[:1])
    compiled = trainer.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    rep = {
        "remat": remat,
        "kernel": "inputs-only stand-in" if standin else "chunk_gla",
        "memory": memory_report(compiled),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
    }
    if time_batch:
        from laplace_jax.platform import median_seconds

        cfg.data.update(global_batch=time_batch)
        small = Trainer(RunConfig.from_mapping(cfg), devices=jax.devices()[:1])
        step = small.step_fn.lower(small.abstract_state, small.abstract_batch).compile()
        state = small.init(0)
        tokens = jax.random.randint(jax.random.key(0), small.abstract_batch.shape, 0, trainer.model_cfg.vocab_size)

        def run():
            nonlocal state
            state, metrics = step(state, tokens)
            return metrics["loss"]

        rep["time_batch"] = time_batch
        rep["step_seconds"] = median_seconds(run, repeats=3, warmup=1)
    return rep


def decode_report(config: str, width: int, weights_dtype: str, compute_dtype: str | None, packed: bool) -> dict:
    """The public ``decode_step`` compiled on CPU at ``width`` (state donated, nothing allocated):
    temporaries and XLA's bytes accessed against the minimum (every weight once, the state in and
    out). The layer loop is unrolled, so the cost analysis counts every layer. ``packed``: the
    weights as serving places them on CPU (``pack_weights``)."""
    import dataclasses

    from laplace_jax.config import load_run_config
    from laplace_jax.models.gla_lm import abstract_params, decode_step, init_state, pack_weights

    cfg = load_run_config(config).model
    cfg = dataclasses.replace(cfg, dtype=compute_dtype or cfg.dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(weights_dtype)), abstract_params(cfg))
    if packed:
        params = jax.eval_shape(pack_weights, params)
    state = jax.eval_shape(lambda: init_state(cfg, width))
    token = jax.ShapeDtypeStruct((width,), jnp.int32)
    step = jax.jit(lambda p, t, s: decode_step(cfg, p, t, s), donate_argnums=(2,))
    compiled = step.lower(params, token, state).compile()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    w_bytes, s_bytes = nbytes(params), nbytes(state)
    minimum = w_bytes + 2 * s_bytes
    accessed = float(cost.get("bytes accessed", 0.0))
    return {
        "config": config,
        "width": width,
        "weights_dtype": weights_dtype,
        "compute_dtype": cfg.dtype,
        "packed": packed,
        "weights_bytes": w_bytes,
        "state_bytes": s_bytes,
        "min_bytes": minimum,
        "bytes_accessed": accessed,
        "bytes_over_min": accessed / minimum,
        "temporaries_bytes": int(m.temp_size_in_bytes),
        "logits_bytes": width * cfg.vocab_size * 4,
    }


def sampler_report(config: str, width: int, prng: str) -> dict:
    """The serving sampler at W rows of the config's vocabulary (compiled cost analysis) against
    the bf16 decode step's minimum traffic (weights read once, state read and written once)."""
    from laplace_jax.config import load_run_config
    from laplace_jax.models.gla_lm import abstract_params, init_state
    from laplace_jax.platform import key_words
    from laplace_jax.sampling import sample_rows

    cfg = load_run_config(config).model
    V = cfg.vocab_size
    rows = lambda dt: jax.ShapeDtypeStruct((width,), dt)  # noqa: E731
    key_data = jax.ShapeDtypeStruct((width, key_words(prng)), jnp.uint32)

    def sample(logits, temperature, top_k, top_p, kd):  # as the decode program calls it
        keys = jax.random.wrap_key_data(kd, impl=prng)
        return sample_rows(logits, temperature, top_k, top_p, keys)

    args = (jax.ShapeDtypeStruct((width, V), jnp.float32), rows(jnp.float32), rows(jnp.int32), rows(jnp.float32))
    cost = jax.jit(sample).lower(*args, key_data).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    state, params = jax.eval_shape(lambda: init_state(cfg, width)), abstract_params(cfg)
    step_min = nbytes(params) // 2 + 2 * nbytes(state)  # bf16 weights
    step_flops = 2 * sum(x.size for x in jax.tree.leaves(params)) * width
    return {
        "config": config,
        "width": width,
        "prng": prng,
        "sampler_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "sampler_flops": float(cost.get("flops", 0.0)),
        "decode_min_bytes": step_min,
        "decode_matmul_flops": step_flops,
        "share_of_bytes": float(cost.get("bytes accessed", 0.0)) / step_min,
        "share_of_flops": float(cost.get("flops", 0.0)) / step_flops,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel", help="jax.grad(chunk_gla) at one layer's shape")
    for name, default in (("B", 4), ("T", 4096), ("H", 16), ("K", 96), ("V", 192), ("chunk-size", 128)):
        k.add_argument(f"--{name}", type=int, default=default)
    k.add_argument("--baseline", default=None, help="another version's ops/gla.py (with its own chunk_gla)")
    s = sub.add_parser("step", help="a config's train step for each remat policy")
    s.add_argument("--config", required=True)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--remat", nargs="+", default=["none", "full", "save_dots", "save_gla"])
    s.add_argument("--time-batch", type=int, default=0, help="also time each policy at this batch size (0: skip)")
    s.add_argument(
        "--kernel-standin",
        action="store_true",
        help="replace chunk_gla by a stand-in whose autodiff keeps only its inputs (to attribute memory)",
    )
    d = sub.add_parser("decode", help="one decode step of a config at W slots: bytes accessed vs the minimum")
    d.add_argument("--config", required=True)
    d.add_argument("--width", type=int, nargs="+", default=[256])
    d.add_argument("--weights-dtype", default="bfloat16")
    d.add_argument("--compute-dtype", default=None, help="override model.dtype (default: the config's)")
    d.add_argument(
        "--packed", action="store_true", help="weights as serving places them on CPU (pack_weights' uint16 bits)"
    )
    sm = sub.add_parser("sampler", help="the serving sampler's share of a decode step (cost analysis)")
    sm.add_argument("--config", required=True)
    sm.add_argument("--width", type=int, default=256)
    sm.add_argument("--prng", nargs="+", default=["threefry2x32", "rbg"])
    for p in (k, s, d, sm):
        p.add_argument("--out", default=None, help="write the JSON result here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    res = {"device": jax.devices()[0].device_kind, "host": host.processor() or host.machine(), "jax": jax.__version__}
    if a.what == "kernel":
        r = kernel_report(a.B, a.T, a.H, a.K, a.V, a.chunk_size, a.baseline)
        res["kernel"] = r
        print(
            f"jax.grad(chunk_gla) {r['shape']}: temporaries {r['temporaries_bytes'] / GiB:.3f} GiB = "
            f"{r['temporaries_over_io']:.2f}x inputs + outputs ({r['inputs_plus_outputs_bytes'] / GiB:.3f} GiB); "
            f"chunk states {r['chunk_states_bytes'] / GiB:.3f} GiB"
        )
    elif a.what == "decode":
        res["decode"] = []
        cols = ("W", "weights GB", "state GB", "min GB", "accessed GB", "x min", "temps GiB")
        print(" ".join(f"{c:>{max(6, len(c))}}" for c in cols))
        for w in a.width:
            r = decode_report(a.config, w, a.weights_dtype, a.compute_dtype, a.packed)
            res["decode"].append(r)
            print(
                f"{w:>6} {r['weights_bytes'] / 1e9:>10.2f} {r['state_bytes'] / 1e9:>8.2f} {r['min_bytes'] / 1e9:>6.2f} "
                f"{r['bytes_accessed'] / 1e9:>11.2f} {r['bytes_over_min']:>6.3f} {r['temporaries_bytes'] / GiB:>9.3f}",
                flush=True,
            )
    elif a.what == "sampler":
        res["sampler"] = [sampler_report(a.config, a.width, prng) for prng in a.prng]
        for r in res["sampler"]:
            print(
                f"sampler W={r['width']} {r['prng']}: {r['sampler_bytes_accessed'] / 1e9:.3f} GB = "
                f"{100 * r['share_of_bytes']:.1f}% of the decode step's {r['decode_min_bytes'] / 1e9:.2f} GB; "
                f"{r['sampler_flops'] / 1e9:.2f} GFLOP = {100 * r['share_of_flops']:.2f}% of its matmul FLOPs"
            )
    else:
        res.update(config=a.config, batch=a.batch, seq=a.seq, dtype=a.dtype, policies=[])
        print(f"{a.config}: train step, batch {a.batch} x {a.seq}, {a.dtype} compute, one device")
        head = f"{'remat':<10} {'temporaries':>12} {'arguments':>10} {'TFLOP':>7} {'GB accessed':>12}"
        print(head + (f" {'step s @ batch ' + str(a.time_batch):>18}" if a.time_batch else ""))
        for policy in a.remat:
            t0 = time.perf_counter()
            r = step_report(a.config, a.batch, a.seq, a.dtype, policy, a.time_batch, a.kernel_standin)
            r["compile_seconds"] = time.perf_counter() - t0
            res["policies"].append(r)
            m = r["memory"]
            line = (
                f"{policy:<10} {m['temporaries'] / GiB:>8.1f} GiB {m['arguments'] / GiB:>6.1f} GiB "
                f"{r['flops'] / 1e12:>7.1f} {r['bytes_accessed'] / 1e9:>12.0f}"
            )
            print(line + (f" {r['step_seconds']:>18.2f}" if a.time_batch else ""), flush=True)
    write_result(res, "bench_memory", argv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
