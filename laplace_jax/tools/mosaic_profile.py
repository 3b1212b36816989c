"""The TPU compiler's static schedule of this project's Mosaic (Pallas TPU) kernels, in cycles.

The TPU compiler writes no ``estimated_cycles`` on a Mosaic kernel unless libtpu is started with
``--xla_jf_dump_static_llo_profile_to=DIR``; then it profiles the kernel's scheduled bundles
(VLIW instructions, with their latencies) and puts the cycles on the custom call. The flag is
read once, when libtpu loads, and the profile's time and memory grow faster than the grid (a
3B layer's backward, 2,048 grid steps, outgrows this machine). So ``tpu.mosaic_cycles`` runs
this module in a child process: it compiles one kernel for one TPU chip at the program's chunk
and head widths with one batch row, a few heads and a short sequence, prints the cycles, and
the parent scales them to the program's grid steps (batch rows x heads x chunks: the steps are
alike, and the cycles are linear in each, which ``tests/test_tpu.py`` checks).

    python -m laplace_jax.tools.mosaic_profile --chip v5e --kernel gla_mosaic_fwd \
        --shape 1024,128,96,192 --dtype bfloat16 --heads 2,4

prints {"kernel": ..., "heads": [2, 4], "cycles": [...]} as JSON. The decode-step kernel
(``gla_mosaic_step``, ``--shape B,H,K,V``), the conv step (``short_conv_mosaic_step``,
``--shape B,W,D,masked``), the few-row product (``matmul_mosaic_rows``, ``--shape M,I,O,fp32_out,form``:
form 0 plain, 1 with a residual, 2 gated: ``limits``' ``PLAIN``, ``RESIDUAL``, ``GATED``)
and the RMSNorm kernels (``rms_norm_mosaic_fwd`` / ``_bwd``, ``rms_norm_residual_mosaic_fwd`` /
``_bwd``, ``--shape N,D,w,fp32_out,gated,gain_f32``) and SwiGLU's (``swiglu_mosaic_fwd`` / ``_bwd``,
``--shape N,F``) are
profiled once at the call's own sizes: their grids are small or their steps few bundles.
The cycles are the compiler's static schedule, which counts no HBM transfer time: ``tpu`` sets
it beside a DMA floor.
``--calibration`` profiles a compute-bound Mosaic program instead, an N^3 bf16 matmul in
512-wide tiles (``--n``, 8192 by default: the calibration table's), whose cycles over the chip's
clock give the share of its peak (the XLA matmul's estimate is 88-90%; ``tests/test_tpu.py`` holds
the 4096^3 one, a ninth of the compile time, to the same band).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from laplace_jax.ops.gla.limits import (
    GATED,
    MOSAIC_DECODE_KERNELS,
    MOSAIC_GATE_KERNEL,
    MOSAIC_MATMUL_KERNEL,
    MOSAIC_NORM_KERNELS,
    MOSAIC_PROJECTIONS_KERNEL,
    MOSAIC_STEP_KERNEL,
    MOSAIC_SWIGLU_KERNELS,
    RESIDUAL,
)

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
TOPOLOGY = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}  # one chip of each generation


def decode_args(kernel: str, shape: tuple[int, ...], dtype: str, chip: str) -> tuple:
    """A Mosaic decode-step kernel and ShapeDtypeStructs of its operands (the kernel's own
    layout): ``gla_mosaic_step`` at B,H,K,V, ``short_conv_mosaic_step`` at B,W,D,masked,
    ``matmul_mosaic_rows`` at M,I,O,fp32_out,form, ``projections_mosaic_rows`` at M,I,O_1,O_2,..,
    ``log_decay_mosaic_rows`` at M,D,r,N,bias_f32,masked (GLA's gate, normalizer 16, no clamp),
    ``rms_norm_mosaic_fwd`` / ``_bwd`` at N,D,w,fp32_out,gated,gain_f32 (the residual ones: D as
    w, gated 0), ``swiglu_mosaic_fwd`` / ``_bwd`` at N,F. The conv step's weights are in the
    activations' dtype, as the model passes them, and its row blocks as the model picks them for
    ``chip`` (two TensorCores or one)."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.ops.conv import mosaic_step as conv
    from laplace_jax.ops.gla import mosaic_step as gla
    from laplace_jax.ops.matmul import log_decay
    from laplace_jax.ops.matmul import mosaic as matmul
    from laplace_jax.ops.norm import mosaic as norm
    from laplace_jax.ops.swiglu import mosaic_swiglu
    from laplace_jax.tpu import CHIPS

    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    if kernel == MOSAIC_MATMUL_KERNEL:
        M, I, O, fp32_out, form = shape
        x, w = S((M, I), dtype), S((I, O), dtype)
        if form == RESIDUAL:
            return (lambda x, w, r: matmul.residual_rows_matmul(x, w, r)), (x, w, S((M, O), f32 if fp32_out else dtype))
        if form == GATED:
            return matmul.gated_rows_matmul, (x, w, w)
        return (lambda x, w: matmul.rows_matmul(x, w, f32 if fp32_out else dtype)), (x, w)
    if kernel == MOSAIC_PROJECTIONS_KERNEL:
        M, I, *widths = shape
        return (lambda x, *ws: matmul.rows_projections(x, ws)), (S((M, I), dtype), *(S((I, o), dtype) for o in widths))
    if kernel == MOSAIC_GATE_KERNEL:
        M, D, r, N, bias_f32, masked = shape
        fn = lambda x, w0, w1, b, *v: log_decay.rows_log_decay(x, w0, w1, b, *(v or [None]), 16.0, None)  # noqa: E731
        valid = [S((M,), jnp.bool_)] if masked else []
        return fn, (S((M, D), dtype), S((D, r), dtype), S((r, N), dtype), S((N,), f32 if bias_f32 else dtype), *valid)
    if kernel in MOSAIC_SWIGLU_KERNELS:
        rows = S(shape, dtype)
        if kernel == MOSAIC_SWIGLU_KERNELS[0]:
            return mosaic_swiglu, (rows, rows)
        return (lambda a, b, dy: jax.vjp(mosaic_swiglu, a, b)[1](dy)), (rows, rows, rows)
    if kernel in MOSAIC_NORM_KERNELS:
        N, D, w, fp32_out, gated, gain_f32 = shape
        out, rows, gain = f32 if fp32_out else dtype, S((N, D), dtype), f32 if gain_f32 else dtype
        gate = (rows,) if gated else ()
        norm_fn = lambda x, g, *z: norm.rms_norm(x, g, 1e-6, out, *z)  # noqa: E731
        if kernel == MOSAIC_NORM_KERNELS[0]:
            return norm_fn, (rows, S((w,), gain), *gate)
        if kernel in MOSAIC_NORM_KERNELS[2:]:  # after a residual add: x + h and its norm
            add_norm = lambda x, h, g: norm.residual_rms_norm(x, h, g, 1e-6, out)  # noqa: E731
            if kernel == MOSAIC_NORM_KERNELS[2]:
                return add_norm, (rows, rows, S((D,), gain))
            add_bwd = lambda x, h, g, dr, dy: jax.vjp(add_norm, x, h, g)[1]((dr, dy))  # noqa: E731
            return add_bwd, (rows, rows, S((D,), gain), rows, S((N, D), out))
        bwd = lambda x, g, *z_dy: jax.vjp(lambda x, g, *z: norm_fn(x, g, *z), x, g, *z_dy[:-1])[1](z_dy[-1])  # noqa: E731
        return bwd, (rows, S((w,), gain), *gate, S((N, D), out))
    if kernel == MOSAIC_STEP_KERNEL:
        B, H, K, V = shape
        fn = lambda q, k, g, v, s: gla._call(q, k, g, v, s, K**-0.5, False)  # noqa: E731
        rows = S((H, K, B), dtype)
        return fn, (rows, rows, S((H, K, B), f32), S((H, V, B), dtype), S((H, K, V, B), f32))
    B, W, D, masked = shape
    live = S((B, 1), jnp.int32) if masked else None
    two_cores = CHIPS[chip].cores >= 2
    fn = lambda x, c, k, live=None: conv._call(x, c, k, live, False, two_cores)  # noqa: E731
    return fn, (S((B, D), dtype), S((B, W * D), dtype), S((W, D), dtype), *([live] if masked else []))


def kernel_args(kernel: str, heads: int, T: int, C: int, K: int, V: int, dtype: str) -> tuple:
    """The Mosaic GLA kernel ``kernel`` and ShapeDtypeStructs of its operands for one batch row of
    ``heads`` heads."""
    import jax
    import jax.numpy as jnp

    from laplace_jax.ops.gla import mosaic

    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    rows = lambda d, t=dtype: S((1, heads, T, d), t)  # noqa: E731
    state = S((1, heads, K, V), f32)
    fwd_name, bwd_name = mosaic.MOSAIC_KERNELS
    if kernel == fwd_name:
        fn = lambda q, k, v, g, s0: mosaic._forward(q, k, v, g, s0, 1.0, C, False)  # noqa: E731
        return fn, (rows(K), rows(K), rows(V), rows(K, f32), state)
    if kernel == bwd_name:
        starts = S((1, heads, T // C, K, V), f32)

        def fn(q, k, v, g, do, st, ds):
            return mosaic._backward(q, k, v, g, do, st, ds, 1.0, C, False)

        return fn, (rows(K), rows(K), rows(V), rows(K, f32), rows(V), starts, state)
    raise ValueError(f"unknown Mosaic kernel {kernel!r}; known: {fwd_name}, {bwd_name}")


CALIBRATION_N, CALIBRATION_TILE = 8192, 512


def calibration_matmul(n: int = CALIBRATION_N):
    """(fn, args): an ``n``^3 bf16 matmul as a Pallas TPU kernel, fp32 accumulation in VMEM."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    t = CALIBRATION_TILE

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    def fn(x, y):
        return pl.pallas_call(
            kernel,
            grid=(n // t, n // t, n // t),
            in_specs=[pl.BlockSpec((t, t), lambda i, j, k: (i, k)), pl.BlockSpec((t, t), lambda i, j, k: (k, j))],
            out_specs=pl.BlockSpec((t, t), lambda i, j, k: (i, j)),
            out_shape=jax.ShapeDtypeStruct((n, n), jnp.bfloat16),
            scratch_shapes=[pltpu.VMEM((t, t), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            name="calibration_matmul",
        )(x, y)

    return fn, (jax.ShapeDtypeStruct((n, n), jnp.bfloat16),) * 2


def _cycles(text: str, kernel: str) -> int:
    """The estimated cycles of the one Mosaic call of ``kernel`` in a compiled module's text."""
    calls = [ln for ln in text.splitlines() if "tpu_custom_call" in ln and kernel in ln]
    found = [int(m.group(1)) for ln in calls if (m := _CYCLES.search(ln))]
    if len(found) != 1:
        raise RuntimeError(f"expected one estimated {kernel} call in the compiled program, found {len(found)}")
    return found[0]


def _compiled_text(chip_name: str, fn, args) -> str:
    from laplace_jax.tools.tpu_check import compile_for_tpu
    from laplace_jax.tpu import tpu_devices

    _, devices = tpu_devices(TOPOLOGY[chip_name])
    return compile_for_tpu(fn, args, devices).as_text()


def profile(chip_name: str, kernel: str, shape: tuple[int, int, int, int], dtype: str, heads: list[int]) -> list[int]:
    """Cycles of ``kernel`` at each head count (this process must have started libtpu with the
    static profile flag: ``main`` does)."""
    return [_cycles(_compiled_text(chip_name, *kernel_args(kernel, h, *shape, dtype)), kernel) for h in heads]


def main(argv: list[str] | None = None) -> int:
    prog = "python -m laplace_jax.tools.mosaic_profile"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--chip", choices=sorted(TOPOLOGY), required=True)
    ap.add_argument(
        "--kernel", help="gla_mosaic_fwd, gla_mosaic_bwd, gla_mosaic_step, short_conv_mosaic_step or matmul_mosaic_rows"
    )
    ap.add_argument(
        "--shape",
        help="T,C,K,V: sequence, chunk, key and value head widths (gla_mosaic_step: B,H,K,V; "
        "short_conv_mosaic_step: B,W,D,masked; matmul_mosaic_rows: M,I,O,fp32_out,form; "
        "rms_norm_mosaic_fwd / _bwd: N,D,w,fp32_out,gated,gain_f32; swiglu_mosaic_fwd / _bwd: N,F)",
    )
    ap.add_argument("--calibration", action="store_true", help="the calibration matmul instead of a kernel")
    ap.add_argument("--n", type=int, default=CALIBRATION_N, help="the calibration matmul's size (a multiple of 512)")
    ap.add_argument("--dtype", default="bfloat16", help="q, k, v dtype")
    ap.add_argument("--heads", default="2,4", help="head counts to compile (one batch row)")
    a = ap.parse_args(argv)
    if not (a.calibration or (a.kernel and a.shape)):
        ap.error("say --kernel and --shape (or --calibration)")
    os.environ["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory(prefix="mosaic_profile_") as dump:  # the profiles' files, not needed after
        flag = f"--xla_jf_dump_static_llo_profile_to={dump}"
        os.environ["LIBTPU_INIT_ARGS"] = f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flag}".strip()
        if a.calibration:
            if a.n % CALIBRATION_TILE or a.n <= 0:
                ap.error(f"--n must be a positive multiple of {CALIBRATION_TILE}; got {a.n}")
            cycles = _cycles(_compiled_text(a.chip, *calibration_matmul(a.n)), "calibration_matmul")
            res = {"program": f"matmul {a.n}^3 bf16 (Mosaic)", "chip": a.chip, "cycles": cycles, "flops": 2 * a.n**3}
        elif a.kernel in MOSAIC_DECODE_KERNELS:
            shape = tuple(int(x) for x in a.shape.split(","))
            cycles = [_cycles(_compiled_text(a.chip, *decode_args(a.kernel, shape, a.dtype, a.chip)), a.kernel)]
            res = {"kernel": a.kernel, "chip": a.chip, "shape": shape, "cycles": cycles}
        else:
            shape = tuple(int(x) for x in a.shape.split(","))
            heads = [int(x) for x in a.heads.split(",")]
            cycles = profile(a.chip, a.kernel, shape, a.dtype, heads)
            res = {"kernel": a.kernel, "chip": a.chip, "shape": shape, "heads": heads, "cycles": cycles}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
