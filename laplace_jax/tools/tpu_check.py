"""Compile this project's programs for a TPU topology on any machine (no TPU) and report what
the TPU compiler says of each: memory per chip, its estimated time and where it goes, a
hand-counted limit and the ratio (``laplace_jax.tpu``; every time is the compiler's estimate,
not a measurement).

    python -m laplace_jax.tools.tpu_check --topology v5e:1x1 --kernel                  # the 3B GLA layer
    python -m laplace_jax.tools.tpu_check --topology v5p:1x1x1 --config configs/3b.py --decode 256
    python -m laplace_jax.tools.tpu_check --topology v5p:1x1x1 --config configs/3b.py --prefill 128,512,2048
    python -m laplace_jax.tools.tpu_check --topology v5e:1x1 --config configs/tiny.py --serve
    python -m laplace_jax.tools.tpu_check --topology v5e:2x2 --config configs/tiny.py   # the train step

--kernel      the GLA kernels at a layer shape (``--impl``: chunk, the XLA kernel; mosaic, the Pallas
              TPU kernel; both), forward and forward + backward (bf16 q/k/v, fp32 g).
--decode W    the public ``decode_step`` at W sequences, bf16 weights and compute, the state
              donated: once with the weights as plain bf16 arrays, once packed as serving packs
              them on CPU (``pack_weights``, XLA:CPU's workaround), once each layer in its own
              buffers as serving places them on TPU (``unstack_weights``: the Mosaic matmul).
--prefill T   the public ``prefill`` of one T-token prompt (T: one length or a comma list, the
              prompt length buckets), bf16: estimated tokens/s against the FLOP limit.
--serve       serving's programs for the config (bf16): prefill, every decode bucket, the sampler.
--config C    alone: the sharded train step (as ``train.py --plan --topology``).
Needs libtpu: ``pip install -e ".[tpu]"``. ``--out F`` writes the reports as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
from typing import Any

SHAPES = {"3b": (4, 4096, 16, 96, 192), "small": (1, 256, 2, 32, 64)}  # B, T, H, K, V


def _shape(text: str) -> tuple[int, ...]:
    if text in SHAPES:
        return SHAPES[text]
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--shape is {' or '.join(SHAPES)} or B,T,H,K,V (five positive ints)")
    return dims


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError("--prefill is a prompt length or a comma list of them (e.g. 128,512,2048)")
    return lengths


def compile_for_tpu(fn, args, devices=None, donate=(), free_layouts=False):
    """Compile ``fn`` for the TPU: ``args`` placed on the first of ``devices``, or (None) with
    the shardings they carry. ``free_layouts``: arguments and results in the layouts the compiler
    prefers (``Layout.AUTO``), as the ops around a kernel inside a model can write and read them."""
    import jax
    import numpy as np
    from jax.experimental.layout import Format, Layout
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    layouts = {}
    if devices is not None:
        one = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), args)
        if free_layouts:
            auto = Format(Layout.AUTO, one)
            layouts = {"in_shardings": jax.tree.map(lambda _: auto, tuple(args)), "out_shardings": auto}
    return jax.jit(fn, donate_argnums=donate, **layouts).lower(*args).compile()


KERNEL_LABELS = {"chunk": "chunk_gla", "mosaic": "mosaic_gla", "auto": "gla(impl=auto)"}  # --impl: kernels for TPU


def kernel_programs(fwd, shape: tuple[int, ...], chunk: int) -> tuple[list[Any], list[tuple[str, Any, float, float]]]:
    """A GLA kernel's two programs at ``shape`` (B, T, H, K, V): (the inputs q, k, v bf16 and g
    fp32, [(what, fn, FLOPs, bytes)] for "forward" (``fwd`` itself, returning o) and "forward +
    backward" (the gradients of the output's sum)). The limits: FLOPs 4KV + 2C(K+V) per token and
    head (x3 with the backward); bytes the inputs and output (forward) plus, for the backward, the
    inputs again, the output's cotangent and the gradients."""
    import jax
    import jax.numpy as jnp

    B, T, H, K, V = shape
    args = [jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (K, K, V)]
    args.append(jax.ShapeDtypeStruct((B, T, H, K), jnp.float32))
    inputs = sum(a.size * a.dtype.itemsize for a in args)
    out = B * T * H * V * 2
    flops = B * T * H * (4 * K * V + 2 * chunk * (K + V))
    loss = lambda *a: fwd(*a).astype(jnp.float32).sum()  # noqa: E731
    return args, [
        ("forward", fwd, flops, inputs + out),
        ("forward + backward", jax.grad(loss, argnums=(0, 1, 2, 3)), 3 * flops, 2 * inputs + 2 * out + inputs),
    ]


def kernel_reports(
    chip, devices, shape: tuple[int, ...], chunk: int, impls: tuple[str, ...] = ("chunk", "mosaic")
) -> list[dict[str, Any]]:
    """Each GLA kernel in ``impls`` ("chunk": the XLA kernel, "mosaic": the Pallas TPU kernel),
    forward and forward + backward at ``shape`` on one chip, with the limits of
    ``kernel_programs``. Inputs and outputs take the layout each kernel's compiler prefers (the
    XLA kernel: the sequence axis minor; the Mosaic kernel: heads before the sequence), as the ops
    around it in a model can produce them; the loss's cotangent, built inside the program, does
    not."""
    from laplace_jax.ops.gla import gla
    from laplace_jax.tpu import report

    B, T, H, K, V = shape
    reports = []
    for impl in impls:
        fwd = lambda q, k, v, g, impl=impl: gla(q, k, v, g, impl=impl, chunk_size=chunk)[0]  # noqa: E731
        where = f"{KERNEL_LABELS[impl]} B{B} T{T} H{H} K{K} V{V} chunk {chunk}"
        args, programs = kernel_programs(fwd, shape, chunk)
        for what, fn, work, moved in programs:
            compiled = compile_for_tpu(fn, args, devices, free_layouts=True)
            reports.append(report(compiled, chip, f"{where}, {what}", flops=work, bytes_=moved))
    return reports


def _serving_cfg(config):
    return dataclasses.replace(config.model, dtype="bfloat16")


def _weight_and_state_bytes(cfg, batch: int) -> tuple[int, int]:
    """(bf16 bytes of every weight, bytes of ``batch`` sequences' state)."""
    import jax

    from laplace_jax.models.gla_lm import abstract_params, init_state

    weights = sum(x.size * 2 for x in jax.tree.leaves(abstract_params(cfg)))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: init_state(cfg, batch))))
    return weights, state


# the forms decode's and prefill's weights may be placed in (``_bf16_weights``)
WEIGHT_FORMS = ("bf16 weights", "packed weights (pack_weights)", "per-layer weights (unstack_weights)")


def _bf16_weights(cfg, form: str = WEIGHT_FORMS[0]):
    """Abstract bf16 weights of ``cfg`` in one of ``WEIGHT_FORMS``: as initialised (layers
    stacked), as uint16 bits (serving's CPU form) or each layer in its own buffers (its TPU form)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.models.gla_lm import abstract_params, pack_weights, unstack_weights

    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), abstract_params(cfg))
    place = {
        WEIGHT_FORMS[0]: lambda p: p,
        WEIGHT_FORMS[1]: pack_weights,
        WEIGHT_FORMS[2]: functools.partial(unstack_weights, cfg),
    }
    return jax.eval_shape(place[form], bf16)


def decode_reports(chip, devices, config, width: int, forms=tuple(WEIGHT_FORMS)) -> list[dict[str, Any]]:
    """The public ``decode_step`` at ``width`` on one chip, bf16 weights in each of ``forms``
    (``WEIGHT_FORMS``: plain, packed, each layer in its own buffers), state donated. Limit: every
    weight read once and the state read and written once."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.models.gla_lm import abstract_params, count_params, decode_step, init_state
    from laplace_jax.tpu import report

    cfg = _serving_cfg(config)
    state = jax.eval_shape(lambda: init_state(cfg, width))
    tokens = jax.ShapeDtypeStruct((width,), jnp.int32)
    weights, state_bytes = _weight_and_state_bytes(cfg, width)
    flops = 2 * count_params(abstract_params(cfg)) * width
    step = lambda p, t, s: decode_step(cfg, p, t, s)  # noqa: E731
    return [
        report(
            compile_for_tpu(step, (params, tokens, state), devices, donate=(2,)),
            chip,
            f"decode_step W={width}, {label}",
            flops=flops,
            bytes_=weights + 2 * state_bytes,
        )
        for label, params in ((form, _bf16_weights(cfg, form)) for form in forms)
    ]


def prefill_reports(chip, devices, config, lengths: list[int], form: str = WEIGHT_FORMS[0]) -> list[dict[str, Any]]:
    """The public ``prefill`` of one prompt of each length on one chip, bf16 weights (in ``form``,
    one of ``WEIGHT_FORMS``) and compute, the state donated. Limit: FLOPs 2 N T plus the chunk
    kernel's 4 dk dv + 2 C (dk + dv) per token, head and layer; bytes every weight once and the
    state in and out."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.models.gla_lm import abstract_params, count_params, init_state, prefill
    from laplace_jax.tpu import report

    cfg = _serving_cfg(config)
    bf16 = _bf16_weights(cfg, form)
    state = jax.eval_shape(lambda: init_state(cfg, 1))
    weights, state_bytes = _weight_and_state_bytes(cfg, 1)
    K, V, C = cfg.head_k_dim, cfg.head_v_dim, cfg.chunk_size
    kernel_per_token = cfg.n_layers * cfg.n_heads * (4 * K * V + 2 * C * (K + V))
    out = []
    for T in lengths:
        tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
        step = lambda p, t, s: prefill(cfg, p, t, s)  # noqa: E731
        rep = report(
            compile_for_tpu(step, (bf16, tokens, state), devices, donate=(2,)),
            chip,
            f"prefill 1 x {T} tokens, bf16" + ("" if form == WEIGHT_FORMS[0] else f", {form}"),
            flops=T * (2 * count_params(abstract_params(cfg)) + kernel_per_token),
            bytes_=weights + 2 * state_bytes,
        )
        rep["tokens"] = T
        rep["tokens_per_s"] = T / rep["estimate"]["seconds"]
        out.append(rep)
    return out


def serve_reports(
    chip,
    devices,
    config,
    max_num_seqs: int,
    buckets: str,
    prefill_chunk: int,
    steps: int,
    programs: tuple[str, ...] = ("prefill", "decode", "sampler"),
    speculative_config: str | None = None,
):
    """Serving's programs on ``devices`` (slots over a ``data`` mesh): prefill, each decode
    bucket and the sampler, with per-chip limits (weights once per step, the state in and out).
    ``speculative_config``: decode with speculation (each step a verify of K + 1 tokens; the
    estimate counts a conditional's costliest branch, here the verify)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from laplace_jax.models.gla_lm import abstract_params, count_params
    from laplace_jax.sampling import grammar_limit, grammar_next, grammar_tiles_shape, penalize, sample_rows
    from laplace_jax.serve.config import ServeConfig
    from laplace_jax.serve.programs import placed_weights, serving_programs
    from laplace_jax.serve.scheduler import make_buckets
    from laplace_jax.serve.slot_programs import GRAMMAR_DTYPE, SlotLayout, row_keys, row_template
    from laplace_jax.tpu import report

    cfg = _serving_cfg(config)
    widths = make_buckets(buckets, max_num_seqs) or list(range(1, max_num_seqs + 1))
    mesh = Mesh(np.asarray(devices), ("data",))
    serve = ServeConfig(speculative_config=speculative_config)
    lay = SlotLayout(cfg, mesh, "threefry2x32", steps, serve.structured_states, serve.speculation(), cfg.max_seq_len)
    params = jax.eval_shape(lambda p: placed_weights(cfg, p, devices[0]), _bf16_weights(cfg))  # serving's form
    n_params = count_params(abstract_params(cfg))
    out = []
    for name, width, fn, args, donate in serving_programs(lay, params, max_num_seqs, prefill_chunk, widths):
        if name not in programs or name == "sampler":
            continue
        rows, tokens = (1, prefill_chunk) if name == "prefill" else (width, steps)
        weights, state = _weight_and_state_bytes(cfg, rows)
        compiled = compile_for_tpu(fn, args, donate=donate)  # args carry the slots' shardings
        what = f"{name} [{prefill_chunk} tokens x 1 row per chip]" if name == "prefill" else f"decode W={width}"
        if name == "decode" and lay.speculation is not None:
            what += f" (speculative, K + 1 = {lay.positions} tokens per step)"
        per_call = weights * (1 if name == "prefill" else steps) + 2 * state
        out.append(report(compiled, chip, what, flops=2 * n_params * rows * tokens, bytes_=per_call))
    if "sampler" not in programs:
        return out
    W, V = max(widths), cfg.vocab_size
    tpl = row_template(lay.prng, V)  # the sampler alone: no history rows
    rows = {k: jax.ShapeDtypeStruct((W, *s), d) for k, (s, d, _) in tpl.items()}

    def sampler(logits, r, table=None):
        keys = functools.partial(row_keys, lay.prng, r)
        pen = penalize(logits, r)
        if table is not None:  # structured outputs' mask and next state (rows at -1: unconstrained)
            pen = grammar_limit(pen, logits, table, r["gstate"])
        tok = sample_rows(pen, r["temperature"], r["top_k"], r["top_p"], keys, r["min_p"])
        return tok if table is None else (tok, grammar_next(table, r["gstate"], tok, ~r["done"]))

    logits = jax.ShapeDtypeStruct((W, V), jnp.float32)
    row_bytes = int(sum(np.prod(s.shape) * s.dtype.itemsize for s in rows.values()))
    compiled = compile_for_tpu(sampler, (logits, rows), devices)
    out.append(report(compiled, chip, f"sampler W={W}", bytes_=W * V * 4 + row_bytes))
    table = jax.ShapeDtypeStruct(grammar_tiles_shape(lay.grammar_rows, V), GRAMMAR_DTYPE)
    compiled = compile_for_tpu(sampler, (logits, rows, table), devices)
    gathered = W * V * GRAMMAR_DTYPE.dtype.itemsize
    what = f"sampler W={W} + structured-output mask ({lay.grammar_rows} table rows)"
    out.append(report(compiled, chip, what, bytes_=W * V * 4 + row_bytes + gathered))
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m laplace_jax.tools.tpu_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every time printed is the TPU compiler's estimate (its cost model), never a measurement.",
    )
    ap.add_argument("--topology", default="v5e:1x1", help="TPU topology: v5e:1x1, v5e:2x2, v5p:1x1x1, v5p:2x2x4, ...")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--kernel", action="store_true", help="GLA kernels at --shape, forward and forward + backward")
    what.add_argument("--decode", type=int, metavar="W", help="decode_step at W sequences (needs --config)")
    what.add_argument("--prefill", type=_lengths, metavar="T", help="prefill of one T-token prompt (T,T,..: several)")
    what.add_argument("--serve", action="store_true", help="serving's prefill, decode buckets and sampler (--config)")
    ap.add_argument("--config", help="an ml_collections config file (e.g. configs/3b.py); alone: the train step")
    ap.add_argument("--shape", type=_shape, default=SHAPES["3b"], help="--kernel: 3b, small or B,T,H,K,V")
    ap.add_argument("--chunk", type=int, default=128, help="--kernel: chunk size")
    ap.add_argument(
        "--impl",
        choices=(*KERNEL_LABELS, "both"),
        default="both",
        help="--kernel: chunk (XLA), mosaic (Pallas TPU), auto (what model.attn_impl=auto compiles to) or both "
        "(chunk and mosaic); with --config: the model.attn_impl to compile with (mosaic and auto: the Pallas TPU "
        "kernels, in decode the GLA and short-conv steps too; both: the config's)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=8, help="--serve: decode slots per chip")
    ap.add_argument("--buckets", default="pow2", help="--serve: decode bucket widths (pow2 or e.g. 1,4,8)")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="--serve: tokens per prefill call")
    ap.add_argument("--steps-per-call", type=int, default=4, help="--serve: decode tokens per call")
    ap.add_argument(
        "--speculative-config", help="--serve: decode with speculation (serve.py's JSON, e.g. num_speculative_tokens)"
    )
    ap.add_argument("--json", action="store_true", help="print the reports as JSON instead of text")
    ap.add_argument("--out", help="also write the reports as JSON to this file")
    return ap


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The reports the arguments ask for (UserError for a mistake the user can fix)."""
    from laplace_jax.config import load_run_config
    from laplace_jax.errors import UserError
    from laplace_jax.tpu import tpu_devices

    if (a.decode is not None or a.prefill or a.serve) and not a.config:
        raise UserError("--decode, --prefill and --serve need --config (e.g. --config configs/3b.py)")
    if not (a.kernel or a.config):
        raise UserError("say what to compile: --kernel, or --config C with --decode W, --serve or alone (train step)")
    chip, devices = tpu_devices(a.topology)
    if a.kernel:
        impls = ("chunk", "mosaic") if a.impl == "both" else (a.impl,)
        return kernel_reports(chip, devices, a.shape, a.chunk, impls)
    config = load_run_config(a.config)
    if a.impl != "both":
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, attn_impl=a.impl))
    if a.decode is not None:
        return decode_reports(chip, devices, config, a.decode)
    if a.prefill:
        return prefill_reports(chip, devices, config, a.prefill)
    if a.serve:
        buckets = a.buckets if a.buckets in ("pow2", "exact") else a.buckets.split(",")
        return serve_reports(
            chip,
            devices,
            config,
            a.max_num_seqs,
            buckets,
            a.prefill_chunk,
            a.steps_per_call,
            speculative_config=a.speculative_config,
        )
    from laplace_jax.train.tpu_plan import tpu_plan

    return [tpu_plan(config, a.topology)]


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"  # the TPU devices are compile-only; nothing runs on a TPU
    from laplace_jax.errors import UserError

    try:
        if a.config and not (a.kernel or a.serve or a.prefill or a.decode is not None):
            from laplace_jax.train.tpu_plan import reserve_cpu_devices

            reserve_cpu_devices(a.topology)
        reports = run(a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.out:
        with open(a.out, "w") as f:
            command = "python -m laplace_jax.tools.tpu_check " + shlex.join(sys.argv[1:])
            json.dump({"topology": a.topology, "command": command, "reports": reports}, f, indent=2)
    if a.json:
        print(json.dumps(reports, indent=2))
    else:
        from laplace_jax.tpu import format_report
        from laplace_jax.train.tpu_plan import format_tpu_plan

        print("\n\n".join(format_tpu_plan(r) if "tpu_run" in r else format_report(r) for r in reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
