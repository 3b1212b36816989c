"""Compile for a TPU without a TPU, and read the TPU compiler's own estimate of the program.

libtpu (``pip install -e ".[tpu]"``) holds the real TPU compiler; JAX builds a compile-only
client from a topology description (``tpu_devices("v5e:2x2")``), so any jitted program lowers
and compiles for those chips on a CPU machine. What the compiled program tells (``report``):
- memory per chip (``memory_analysis``: the TPU's own buffer assignment) against the chip's HBM;
- the compiler's estimated time: the sum of the ``estimated_cycles`` it writes on every fusion
  and op (its cost model, the numbers its scheduler uses), each ``while`` body counted as many
  times as the loop runs, over the chip's clock; grouped by the JAX source line and primitive
  each op came from;
- a hand-counted limit beside it (FLOPs over the bf16 peak, minimal bytes over HBM bandwidth)
  and the ratio.
It is the compiler's estimate, never a measurement. This project's Mosaic (Pallas TPU) kernels
carry no ``estimated_cycles`` in a normal compile; their time is the compiler's static schedule
of the kernel (``mosaic_cycles``: its bundle count and latencies, which count no HBM transfer)
or, where larger, a hand-counted DMA floor: every operand and result once, at the share of HBM
bandwidth the cost model gives XLA's own streaming op (``Chip.stream_share``, the calibration's
elementwise program), so a bandwidth-bound kernel is counted as fast as XLA would be, no faster.
Other ops without an estimate are listed, not counted as free (other Mosaic kernels,
asynchronous copies and some collectives); a figure that leaves them out says so.

``cost_analysis()`` is not used: it counts a ``while`` body once (and its ``optimal_seconds``
goes negative for looped programs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from laplace_jax.errors import UserError
from laplace_jax.hlo_stats import (
    Module,
    arrays,
    chosen_branches,
    gla_kernels,
    loops,
    memory_report,
    shape_bytes,
)
from laplace_jax.ops.gla.limits import (
    MOSAIC_CONV_KERNEL,
    MOSAIC_DECODE_KERNELS,
    MOSAIC_GATE_KERNEL,
    MOSAIC_KERNELS,
    MOSAIC_MATMUL_KERNEL,
    MOSAIC_NORM_KERNELS,
    MOSAIC_PROJECTIONS_KERNEL,
    MOSAIC_STEP_KERNEL,
    MOSAIC_SWIGLU_KERNELS,
    matmul_form,
)

LABEL = "TPU compiler estimate (its cost model's estimated_cycles), not a measurement"
MOSAIC_LABEL = (
    "Mosaic kernels: the compiler's static schedule (bundles and latencies, no HBM time) "
    "or a hand-counted DMA floor (operands and results at the cost model's streaming share of HBM bandwidth), "
    "whichever is larger"
)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: published per-chip peaks, HBM, the clock that turns the cost model's
    cycles into seconds, and the calibration measured here (``benchmarks/bench_tpu_calibration``)."""

    name: str
    device_kind: str
    peak_bf16_tflops: float
    hbm_gbps: float
    hbm_gib: float
    clock_ghz: float
    host_bounds: tuple[int, int, int]  # chips per host, as the topology description wants them
    calibrated: bool
    accelerator_prefix: str  # Cloud TPU's accelerator type names: v5litepod-4, v5p-8 (cores), v6e-4
    cores: int  # TensorCores per chip (v5p: a megacore of two; Mosaic splits parallel grid axes over them)
    stream_share: float  # the cost model's share of HBM bandwidth for a 1 GiB elementwise op (calibration)

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * 2**30)


# Peaks and HBM: Google Cloud TPU documentation per generation. Clocks: the ones under which
# an 8192^3 bf16 matmul estimates at ~90% of the published peak; stream shares: a 1 GiB in, 1 GiB
# out fp32 elementwise op's estimate over HBM bandwidth (tpu calibration benchmark; test_tpu).
CHIPS = {
    "v5e": Chip("v5e", "TPU v5 lite", 197.0, 819.0, 16.0, 1.5, (2, 2, 1), True, "v5litepod", 1, 0.81),
    "v5p": Chip("v5p", "TPU v5", 459.0, 2765.0, 95.0, 1.75, (2, 2, 1), True, "v5p", 2, 0.72),
    "v6e": Chip("v6e", "TPU v6 lite", 918.0, 1640.0, 32.0, 1.75, (2, 2, 1), False, "v6e", 1, 0.81),
}

_TRIVIAL = {
    "parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "while", "conditional", "call", "copy-done", "all-gather-done",
    "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
}  # fmt: skip


def _require_libtpu(chip: Chip, n_chips: int) -> None:
    """libtpu is there, and set up to compile without a TPU: one process may load it while
    another does (its lock file otherwise refuses), and it is told the accelerator and the
    (only) worker, which it otherwise tries to find from a TPU VM's metadata and warns about."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        import jax

        raise UserError(
            "compiling for TPU needs libtpu, which this environment lacks: "
            f'pip install "jax[tpu]=={jax.__version__}" (or pip install -e ".[tpu]")'
        )
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.accelerator_prefix}-{chip.cores * n_chips}")


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """``"v5e:2x2"`` -> (the v5e Chip, (2, 2)); a clear error for an unknown chip or shape."""
    chip, _, shape = name.partition(":")
    if chip not in CHIPS:
        raise UserError(f"unknown TPU {chip!r} in topology {name!r}; known: {', '.join(CHIPS)} (e.g. v5e:2x2)")
    if not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        dims = "AxB (v5e, v6e)" if chip != "v5p" else "AxBxC"
        raise UserError(f"topology {name!r} needs a chip grid after the colon, {dims}: e.g. v5e:2x2, v5p:2x2x4")
    return CHIPS[chip], tuple(int(d) for d in shape.split("x"))


def tpu_devices(topology: str) -> tuple[Chip, list[Any]]:
    """(chip, devices) of a TPU topology, for ``Mesh`` and ``jax.jit(...).lower(...).compile()``;
    no TPU needed. The devices only compile: nothing can be placed on them."""
    chip, dims = parse_topology(topology)
    _require_libtpu(chip, math.prod(dims))
    from jax.experimental import topologies

    bounds = tuple(min(b, d) for b, d in zip(chip.host_bounds, (*dims, 1, 1)[:3], strict=True))
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chip_config_name="default", chips_per_host_bounds=bounds,
            num_slices=1,
        )  # fmt: skip
    except Exception as e:  # libtpu's own words: an unsupported shape for this generation
        raise UserError(f"libtpu does not build topology {topology!r}: {str(e).splitlines()[0]}") from e
    return chip, list(desc.devices)


def out_of_memory(err: Exception) -> str | None:
    """The compiler's own words when a program does not fit HBM, else None."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or ("exceeds" in text and "HBM" in text):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return next((ln for ln in lines if "memory" in ln.lower() or "hbm" in ln.lower()), lines[0])
    return None


def memory(compiled: Any, chip: Chip) -> dict[str, Any]:
    """Per-chip bytes of a compiled program (TPU buffer assignment) against the chip's HBM."""
    mem = memory_report(compiled)
    return {**mem, "hbm": chip.hbm_bytes, "fits": bool(mem["total"] <= chip.hbm_bytes)}


def _source(chain: list[tuple[str, str, int]]) -> str:
    """The innermost frame in this package (else the innermost) as ``file:line function``."""
    if not chain:
        return "(no source)"
    mine = [f for f in chain if f"{os.sep}laplace_jax{os.sep}" in f[0]]
    file, func, line = (mine or chain)[0]
    if mine:
        file = file.split(f"{os.sep}laplace_jax{os.sep}", 1)[1]
    return f"{os.path.basename(file) if not mine else file}:{line} {func}"


def _primitive(op_name: str) -> str:
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return parts[-1] if parts else "(unnamed)"


def _origin(module: Module, ins: Any) -> tuple[str, int | None]:
    """(op_name, stack frame) that names where ``ins`` came from. For a fusion: the most common
    among its fused computation's computing instructions, ties to the one nearest the root (the
    fusion's own metadata often names only the enclosing call)."""
    if ins.opcode != "fusion":
        return ins.op_name, ins.frame
    body = dict(ins.callees()).get("calls")
    skip = ("parameter", "constant", "bitcast", "broadcast", "tuple", "get-tuple-element")
    named = [(i.op_name, i.frame) for i in module.computations.get(body, []) if i.op_name and i.opcode not in skip]
    if not named:
        return ins.op_name, ins.frame
    counts: dict[tuple[str, int | None], int] = defaultdict(int)
    for key in named:
        counts[key] += 1
    last = {key: pos for pos, key in enumerate(named)}
    return max(counts, key=lambda key: (counts[key], last[key]))


def _unestimated_kind(ins: Any) -> str | None:
    """How to list an op that runs without an estimate, or None for bookkeeping and scalars."""
    if ins.opcode == "custom-call" and "tpu_custom_call" in ins.rest:
        m = re.search(r'kernel_name\\?"?[:=]\\?"?([\w.\-]+)', ins.rest)
        return f"Mosaic kernel {m.group(1) if m else _primitive(ins.op_name)}"
    if ins.opcode in _TRIVIAL or "AllocateBuffer" in ins.rest or re.fullmatch(r"\w+\[\]\S*", ins.type):
        return None
    target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
    return f"custom-call {target.group(1)}" if ins.opcode == "custom-call" and target else ins.opcode


_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}


def mosaic_call(module: Module, comp: str, ins: Any) -> dict[str, Any] | None:
    """The sizes of a call of this project's Mosaic kernels (the GLA chunk kernels of
    ``ops/gla/mosaic.py``; the decode steps of ``ops/gla/mosaic_step.py`` and
    ``ops/conv/mosaic_step.py``, the few-row products of ``ops/matmul/mosaic.py``, the
    RMSNorm kernels of ``ops/norm/mosaic.py`` and SwiGLU's of ``ops/swiglu/mosaic.py``, whose
    ``shape`` is what ``tools/mosaic_profile`` rebuilds them
    from), read from the compiled call and its operands, or None for any other instruction."""
    if ins.opcode != "custom-call" or "tpu_custom_call" not in ins.rest:
        return None
    kernel = next((k for k in (*MOSAIC_KERNELS, *MOSAIC_DECODE_KERNELS) if k in ins.name or k in ins.op_name), None)
    if kernel is None:
        return None
    types = module.operand_types(comp, ins)
    operands = [arrays(t)[0] for t in types]
    moved = sum(map(shape_bytes, types)) + shape_bytes(ins.type)
    if kernel == MOSAIC_STEP_KERNEL:  # q, k, g [H, K, B], v [H, V, B], state [H, K, V, B]
        (H, K, B), (dtype, (_, V, _)) = operands[0][1], operands[3]
        return {"kernel": kernel, "shape": (B, H, K, V), "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel == MOSAIC_MATMUL_KERNEL:  # x [M, I], w [I, O] (, r [M, O] or u [I, O]) -> [M, O]
        (dtype, (M, I)), (_, (_, O)) = operands[:2]
        form = matmul_form([dims for _, dims in operands])  # plain, residual or gated (ops/matmul/mosaic.py)
        shape = (M, I, O, int(arrays(ins.type)[0][0] == "f32"), form)
        return {"kernel": kernel, "shape": shape, "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel == MOSAIC_PROJECTIONS_KERNEL:  # x [M, I], w_i [I, O_i] -> [M, O_i] each
        (dtype, (M, I)), widths = operands[0], tuple(dims[1] for _, dims in operands[1:])
        return {"kernel": kernel, "shape": (M, I, *widths), "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel == MOSAIC_GATE_KERNEL:  # x [M, D], w0 as [r, D], w1 [r, N], bias [N / 128, 128] (, live [1, M]) -> [N, M]
        (dtype, (M, D)), (_, (r, _)), (_, (_, N)) = operands[:3]
        shape = (M, D, r, N, int(operands[3][0] == "f32"), int(len(operands) == 5))
        return {"kernel": kernel, "shape": shape, "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel in MOSAIC_NORM_KERNELS[:2]:  # x [N, D], gain_rows (, gate [N, D]) (, dy [N, D]) -> y (, dx, dg (, dz))
        bwd = kernel == MOSAIC_NORM_KERNELS[1]
        gated = len(operands) == 3 + bwd
        (dtype, (N, D)), w = operands[0], math.prod(operands[1][1])  # the gain's width, from its rows
        out = operands[-1][0] if bwd else arrays(ins.type)[0][0]
        shape = (N, D, w, int(out == "f32"), int(gated), int(operands[1][0] == "f32"))
        return {"kernel": kernel, "shape": shape, "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel in MOSAIC_NORM_KERNELS[2:]:  # x, h, gain (as rms_norm's) -> (r, y); r, gain, dy, dr -> (dx, dg)
        bwd = kernel == MOSAIC_NORM_KERNELS[3]
        (dtype, (N, D)), out = operands[0], operands[2][0] if bwd else arrays(ins.type)[1][0]
        shape = (N, D, D, int(out == "f32"), 0, int(operands[1 if bwd else 2][0] == "f32"))
        return {"kernel": kernel, "shape": shape, "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel in MOSAIC_SWIGLU_KERNELS:  # gate, up (, dy) [N, F]
        dtype, (N, F) = operands[0]
        return {"kernel": kernel, "shape": (N, F), "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    if kernel == MOSAIC_CONV_KERNEL:  # ([live [B, 1],] x [B, D], cache [B, W * D], kernel [W, D])
        (dtype, (B, D)), (W, _) = operands[-3], operands[-1][1]
        shape = (B, W, D, int(len(operands) == 4))
        return {"kernel": kernel, "shape": shape, "dtype": _DTYPES.get(dtype, dtype), "bytes": moved}
    q, v = operands[0], operands[2]  # (q, k, v, g, ...): the forward's chunk-start states are its second result
    starts = arrays(ins.type)[1] if kernel == MOSAIC_KERNELS[0] else operands[5]
    B, H, T, K = q[1]
    return {"kernel": kernel, "units": B * H, "T": T, "C": T // starts[1][2], "K": K, "V": v[1][-1],
            "dtype": _DTYPES.get(q[0], q[0]), "bytes": moved}  # fmt: skip


PROFILE_CHUNKS = 8  # the sequence a Mosaic kernel is profiled at, in chunks (the profiler grows faster than the grid)


def run_mosaic_profile(*args: str, timeout: float = 1800) -> dict[str, Any]:
    """``python -m laplace_jax.tools.mosaic_profile ARGS`` in a child process (the compiler's profile
    flag is read when libtpu loads), its JSON line; RuntimeError with the child's last words."""
    cmd = [sys.executable, "-m", "laplace_jax.tools.mosaic_profile", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = [ln for ln in done.stderr.splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"mosaic_profile {' '.join(args)} failed: {' | '.join(tail)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _mosaic_fit(chip_name: str, kernel: str, C: int, K: int, V: int, dtype: str) -> tuple[float, float]:
    """(fixed cycles per call, cycles per grid step) of a Mosaic GLA kernel: the compiler's static
    schedule at ``PROFILE_CHUNKS`` chunks and two and four heads per TensorCore, from a child
    process (``tools/mosaic_profile``). One head alone profiles cheaper than any head among
    others, so the fit starts at two."""
    cores = CHIPS[chip_name].cores
    heads = (2 * cores, 4 * cores)
    T = PROFILE_CHUNKS * C
    c1, c2 = run_mosaic_profile(
        "--chip", chip_name, "--kernel", kernel, "--shape", f"{T},{C},{K},{V}", "--dtype", dtype,
        "--heads", f"{heads[0]},{heads[1]}",
    )["cycles"]  # fmt: skip
    per_step = (c2 - c1) / ((heads[1] - heads[0]) * PROFILE_CHUNKS)
    return c1 - per_step * heads[0] * PROFILE_CHUNKS, per_step


@functools.cache
def _mosaic_whole_cycles(chip_name: str, kernel: str, shape: tuple[int, ...], dtype: str) -> float:
    """A decode-step kernel's static schedule at the call's own sizes (one compile: its grid is
    small), from a child process (``tools/mosaic_profile``)."""
    size = ",".join(map(str, shape))
    return run_mosaic_profile("--chip", chip_name, "--kernel", kernel, "--shape", size, "--dtype", dtype)["cycles"][0]


def mosaic_cycles(chip: Chip, call: dict[str, Any]) -> float:
    """The compiler's static schedule of one Mosaic kernel call (``mosaic_call``), in cycles: the
    chunk kernels' fit scaled to the call's grid steps (batch rows x heads x chunks), a decode
    step's profile at its own sizes."""
    if call["kernel"] in MOSAIC_DECODE_KERNELS:
        return _mosaic_whole_cycles(chip.name, call["kernel"], tuple(call["shape"]), call["dtype"])
    fixed, per_step = _mosaic_fit(chip.name, call["kernel"], call["C"], call["K"], call["V"], call["dtype"])
    return fixed + per_step * call["units"] * (call["T"] // call["C"])


def dma_floor(chip: Chip, bytes_: float) -> float:
    """Seconds to move ``bytes_`` over HBM at the share of bandwidth the cost model gives a
    streaming XLA op (``Chip.stream_share``): a Mosaic kernel's floor."""
    return bytes_ / (chip.hbm_gbps * 1e9 * chip.stream_share)


def _instr_cost(module: Module, comp: str, ins: Any, chip: Chip) -> tuple[float | None, dict | None, str | None]:
    """One instruction's cycles (None: no estimate), its Mosaic call record, and why a Mosaic call
    could not be profiled: ``estimate``'s per-instruction rule."""
    hz = chip.clock_ghz * 1e9
    c = ins.cycles
    call = mosaic_call(module, comp, ins) if c is None else None
    if call is not None:
        try:
            schedule, floor = mosaic_cycles(chip, call) / hz, dma_floor(chip, call["bytes"])
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # listed as not estimated, with why
            return None, None, f"Mosaic kernel {call['kernel']} (not profiled: {e})"
        return max(schedule, floor) * hz, {**call, "schedule_s": schedule, "dma_floor_s": floor}, None
    if c is None and ins.opcode == "reshape":  # a relayout (a bitcast would say so): read and write it
        c = dma_floor(chip, 2 * shape_bytes(ins.type)) * hz
    return (float(c) if c is not None else None), None, None


def _optional_work() -> Callable[[Any], bool]:
    """Whether an instruction is a conditional that skips optional work (``platform.skip_unless``'s,
    by its name scope): the predicate, built once per estimate."""
    from laplace_jax.platform import OPTIONAL_SCOPE  # imports jax, which this module's readers may not need

    marker = f"{OPTIONAL_SCOPE}/"
    return lambda ins: ins.opcode == "conditional" and marker in ins.op_name


def _multiplicities(module: Module, cost: Callable[[str, Any], float], cheapest: Callable[[Any], bool]):
    """Runs per computation with each conditional at its costliest branch (its cheapest where
    ``cheapest(ins)``)."""
    chosen = chosen_branches(module, cost, cheapest)
    return module.multiplicities(control_only=True, branch=lambda ins: chosen.get(ins.name, ""))


def estimate(hlo: str, chip: Chip) -> dict[str, Any]:
    """The compiler's estimated time of one run of a compiled TPU module (``compiled.as_text()``).

    Returns seconds and cycles, the while loops with their trip counts, ``by_source`` (seconds
    per ``file:line function`` of the JAX code each op came from, with its primitives), and
    ``unestimated``: ops that run but carry no estimate (per opcode, Mosaic kernels by name: how
    many times they run and the bytes of their results), so a reader knows what the sum leaves
    out. Scalar bookkeeping (loop counters, tuples) is not listed. ``mosaic`` lists this project's
    Mosaic kernel calls, each counted at max(static schedule, DMA floor) (``MOSAIC_LABEL``). A
    reshape that the compiler kept as one (a relayout: a free one is a bitcast) carries no
    estimate either; it is counted at the DMA floor of reading and writing its result. A
    conditional counts its costliest branch (one run takes one branch; which one the data
    decides, so the estimate is the dearest), with everything else inside that branch;
    ``optional_skipped_seconds`` (in a program with optional work: ``platform.skip_unless``'s
    conditionals, read by their name scope) takes those conditionals' cheapest branch instead and
    every other's costliest: in serving's decode program, a batch of live rows that asks for no
    optional work (greedy, no logprobs, no grammar, no top-k or top-p)."""
    module = Module(hlo)
    costs = {}  # every computation that runs as code, whichever branch reaches it
    for comp in module.multiplicities(control_only=True):
        for ins in module.computations.get(comp, []):
            costs[comp, ins.name] = _instr_cost(module, comp, ins, chip)

    def cost(comp: str, ins: Any) -> float:
        return costs[comp, ins.name][0] or 0.0

    mult = _multiplicities(module, cost, lambda ins: False)
    frames = module.frames()
    cycles = 0.0
    by_source: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    unestimated: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0})
    mosaic: list[dict[str, Any]] = []
    for comp, instrs in module.computations.items():
        factor = mult.get(comp, 0.0)
        if not factor:
            continue
        for ins in instrs:
            c, call, failed = costs[comp, ins.name]
            if call is not None:
                mosaic.append({**call, "calls": factor})
            if c is None:
                kind = failed or _unestimated_kind(ins)
                if kind is not None:
                    unestimated[kind]["count"] += factor
                    unestimated[kind]["bytes"] += factor * shape_bytes(ins.type)
                continue
            cycles += factor * c
            op_name, frame = _origin(module, ins)
            src = _source(frames.get(frame, [])) if frame is not None else "(no source)"
            src += " [backward]" if "transpose(" in op_name else ""
            by_source[src][_primitive(op_name)] += factor * c / (chip.clock_ghz * 1e9)
    seconds = cycles / (chip.clock_ghz * 1e9)
    rows = sorted(
        ({"source": s, "seconds": sum(p.values()), "primitives": dict(p)} for s, p in by_source.items()),
        key=lambda r: -r["seconds"],
    )
    for r in rows:
        r["share"] = r["seconds"] / seconds if seconds else 0.0
    skipped, optional = {}, _optional_work()
    if any(optional(ins) for comp in mult for ins in module.computations.get(comp, [])):
        low = _multiplicities(module, cost, optional)
        cycles_low = sum(f * cost(comp, ins) for comp, f in low.items() for ins in module.computations.get(comp, []))
        skipped["optional_skipped_seconds"] = cycles_low / (chip.clock_ghz * 1e9)
    return {
        "label": LABEL if not mosaic else f"{LABEL}; {MOSAIC_LABEL}",
        "seconds": seconds,
        **skipped,
        "cycles": cycles,
        "clock_ghz": chip.clock_ghz,
        "loops": loops(module),
        "by_source": rows,
        "unestimated": dict(sorted(unestimated.items(), key=lambda kv: -kv[1]["bytes"])),
        "mosaic": mosaic,
    }


def limit(chip: Chip, *, flops: float = 0.0, bytes_: float = 0.0) -> dict[str, Any]:
    """A hand-counted floor for one chip: FLOPs over the bf16 peak, minimal bytes over HBM
    bandwidth; the larger bounds the program."""
    compute, mem = flops / (chip.peak_bf16_tflops * 1e12), bytes_ / (chip.hbm_gbps * 1e9)
    return {
        "flops": flops,
        "bytes": bytes_,
        "compute_s": compute,
        "memory_s": mem,
        "seconds": max(compute, mem),
        "bound": "compute" if compute >= mem else "memory",
    }


def report(compiled: Any, chip: Chip, what: str, *, flops: float = 0.0, bytes_: float = 0.0) -> dict[str, Any]:
    """Everything one compiled TPU program tells: memory per chip, the compiler's estimated time
    and its breakdown, a hand-counted limit (``flops``, ``bytes_`` per chip) and the ratio."""
    hlo = compiled.as_text()
    est = estimate(hlo, chip)
    lim = limit(chip, flops=flops, bytes_=bytes_)
    return {
        "program": what,
        "chip": chip.name,
        "gla_kernels": gla_kernels(hlo),
        "chip_calibrated": chip.calibrated,
        "memory": memory(compiled, chip),
        "estimate": est,
        "limit": lim,
        "estimate_over_limit": est["seconds"] / lim["seconds"] if lim["seconds"] else None,
    }


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms" if s < 10 else f"{s:,.2f} s"


def format_report(rep: dict[str, Any], top: int = 8) -> str:
    """One program's report as text: memory, the estimate (labelled), the limit, the top sources."""
    mem, est, lim = rep["memory"], rep["estimate"], rep["limit"]
    note = "" if rep["chip_calibrated"] else " (clock not calibrated for this chip: treat the time as rough)"
    lines = [
        f"{rep['program']} on TPU {rep['chip']}{note}",
        f"  memory per chip    {_gib(mem['total'])} of {_gib(mem['hbm'])} HBM "
        f"(arguments {_gib(mem['arguments'])}, temporaries {_gib(mem['temporaries'])}, outputs "
        f"{_gib(mem['outputs'])}, {_gib(mem['aliased'])} aliased){'' if mem['fits'] else '  DOES NOT FIT'}",
        f"  estimated time     {_ms(est['seconds'])}  [{est['label']}]",
    ]
    if "optional_skipped_seconds" in est:
        lines.append(f"  optional skipped   {_ms(est['optional_skipped_seconds'])} (above: all optional work done)")
    if rep.get("gla_kernels"):
        lines.append(f"  GLA kernels        {', '.join(rep['gla_kernels'])} (read from the compiled program)")
    alike: dict[tuple[str, str, str], float] = defaultdict(float)  # identical calls (one per layer) on one line
    for m in est["mosaic"]:
        alike[m["kernel"], _ms(m["schedule_s"]), _ms(m["dma_floor_s"])] += m["calls"]
    for (kernel, schedule, floor), calls in alike.items():
        lines.append(
            f"  Mosaic kernel      {kernel} x{calls:g}: static schedule {schedule}, DMA floor {floor} per call"
        )
    if lim["seconds"]:
        lines.append(
            f"  hand-counted limit {_ms(lim['seconds'])} ({lim['bound']}: {lim['flops'] / 1e9:,.1f} GFLOP -> "
            f"{_ms(lim['compute_s'])}, {lim['bytes'] / 1e9:,.3f} GB -> {_ms(lim['memory_s'])}); "
            f"estimate / limit {rep['estimate_over_limit']:.1f}x ({100 / rep['estimate_over_limit']:.0f}% of the limit)"
        )
    if "tokens_per_s" in rep:
        lines.append(f"  tokens/s           {rep['tokens_per_s']:,.0f} per chip, from the estimate")
    trips = [f"{lp['trips'] if lp['trips'] is not None else '?'}" for lp in est["loops"]]
    if trips:
        lines.append(f"  loops              {len(trips)} (trip counts {', '.join(trips)})")
    if est["unestimated"]:
        left = ", ".join(
            f"{k} x{v['count']:g} ({v['bytes'] / 1e6:,.0f} MB)" for k, v in list(est["unestimated"].items())[:5]
        )
        lines.append(f"  not in the estimate {left}")
    for r in est["by_source"][:top]:
        prims = sorted(r["primitives"].items(), key=lambda kv: -kv[1])[:3]
        names = ", ".join(f"{p} {100 * s / est['seconds']:.0f}%" for p, s in prims)
        lines.append(f"  {100 * r['share']:5.1f}%  {r['source']}  ({names})")
    return "\n".join(lines)
