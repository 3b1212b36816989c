"""Static GPU check of the Pallas GLA kernel, on any machine (no GPU needed).

    python -m laplace_jax.tools.gpu_check --shape 3b --out report.json      # the 3B layer
    python -m laplace_jax.tools.gpu_check --shape small                      # seconds; what CI runs
    python -m laplace_jax.tools.gpu_check --shape 3b --arch 90 --sweep       # + every num_warps x num_stages
    python -m laplace_jax.tools.gpu_check --shape 3b --arch 90 --blocks      # + key x value tilings

1. Lower the forward and the gradient of ``gla(..., impl="pallas", interpret=False)``
   for cuda (``lower(lowering_platforms=("cuda",))``: Pallas' Triton lowering runs in Python),
   capturing each Triton module, its grid and its ``num_warps``/``num_stages``.
2. Compile each module with the ``triton`` package for every ``--arch`` (sm_90, sm_80) in a
   separate process (triton and jax do not share one), and read the PTX assembler's resource
   report (``ptxas -v``, the Blackwell-capable build bundled with triton): registers per thread,
   spill store/load bytes, shared memory; list the MMA instructions in the PTX (wgmma on sm_90,
   mma.sync); and compare the programs per launch with the SM count.

Needs jaxlib 0.10.x (newer jaxlibs compile Triton during lowering through the CUDA plugin) and
``pip install triton``; where the jax here has no Python Triton lowering to capture, the check
says so and writes ``{"skipped": reason}`` (a lowering error in the kernels is an error, not a
skip). The report is JSON: one entry per kernel and architecture; with ``--sweep`` the
resources of every kernel under every launch setting (how ``LAUNCH`` was chosen), with
``--blocks`` those of the gradient's kernels under other key x value tilings (how
``pallas_gla``'s default tiles were chosen).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

SHAPES = {  # B, T, H, K, V (K is padded to 128 inside the kernel for the 3B layer's 96)
    "small": (1, 256, 2, 32, 64),
    "3b": (4, 4096, 16, 96, 192),
}
SMS = {90: 132, 80: 108}  # H100/H200, A100


class UnsupportedError(RuntimeError):
    """This jax cannot run the check on this machine; the message says why."""


def capture(shape: tuple[int, ...], blocks: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Lower forward and gradient for cuda; each Triton module's text, grid and launch options.
    ``blocks``: (key tile, value tile) instead of the kernel's defaults.
    Raises ``UnsupportedError`` where this jaxlib does not run Pallas' Triton lowering in Python."""
    import jax
    import jax.numpy as jnp

    try:
        from jax._src.pallas.triton import lowering
    except ImportError as e:
        raise UnsupportedError(f"jax {jax.__version__} has no Pallas Triton lowering module ({e})") from e

    from laplace_jax.ops.gla import gla
    from laplace_jax.ops.gla.pallas import pallas_gla

    B, T, H, K, V = shape
    args = [jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16) for d in (K, K, V)]
    args.append(jax.ShapeDtypeStruct((B, T, H, K), jnp.float32))

    def fwd(q, k, v, g):
        if blocks is None:
            return gla(q, k, v, g, impl="pallas", interpret=False)[0]
        s0 = jnp.zeros((B, H, K, V), jnp.float32)
        return pallas_gla(q, k, v, g, s0, scale=K**-0.5, block_k=blocks[0], block_v=blocks[1])[0]

    def loss(q, k, v, g):
        return fwd(q, k, v, g).astype(jnp.float32).sum()

    modules: list[dict[str, Any]] = []
    original = lowering.lower_jaxpr_to_triton_module

    def keep(jaxpr, grid_mapping, *rest, **kw):
        res = original(jaxpr, grid_mapping, *rest, **kw)
        res.module.operation.verify()
        modules.append(
            {"name": jaxpr.debug_info.func_name, "grid": list(res.grid), "ttir": res.module.operation.get_asm()}
        )
        return res

    lowering.lower_jaxpr_to_triton_module = keep
    try:
        for label, fn in (("forward", fwd), ("gradient", jax.grad(loss, argnums=(0, 1, 2, 3)))):
            before = len(modules)
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            for m in modules[before:]:
                m["pass"] = label
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    if not modules:
        raise UnsupportedError(f"jax {jax.__version__} lowered without the Python Triton lowering: nothing to read")
    from laplace_jax.ops.gla.pallas import LAUNCH

    return [{**m, **LAUNCH[m["name"]]} for m in modules]


COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
path, arch, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
k = triton.compile(path, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
print(json.dumps({"ptx": k.asm["ptx"], "shared": k.metadata.shared}))
"""


def dot_kinds(ttir: str) -> dict[str, int]:
    """The kernel's dot ops (static count in the Triton IR) by operand type and input precision:
    "bf16" (tensor cores), "f32_ieee" (IEEE fp32 on CUDA cores), "f32_tf32" (tensor cores, TF32)."""
    kinds: dict[str, int] = {}
    for line in re.findall(r"tt\.dot [^\n]*", ttir):
        operand = re.search(r": tensor<[^>]*x(\w+)>", line).group(1)
        precision = m.group(1) if (m := re.search(r"inputPrecision = (\w+)", line)) else "ieee"
        key = operand if operand != "f32" else f"f32_{precision}"
        kinds[key] = kinds.get(key, 0) + 1
    return dict(sorted(kinds.items()))


def _ptxas() -> str:
    """The assembler bundled with triton, found without importing triton (whose LLVM must not
    share a process with XLA's)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the static GPU check needs the triton package: pip install triton")
    return os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "ptxas-blackwell")


def resources(module: dict[str, Any], arch: int, workdir: str) -> dict[str, Any]:
    """Compile one captured module for sm_<arch>; the assembler's resource report."""
    base = os.path.join(workdir, f"{module['pass']}_{module['name']}_{len(os.listdir(workdir))}")
    with open(base + ".ttir", "w") as f:
        f.write(module["ttir"])
    cmd = [
        sys.executable,
        "-c",
        COMPILE,
        base + ".ttir",
        str(arch),
        str(module["num_warps"]),
        str(module["num_stages"]),
    ]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    with open(base + ".ptx", "w") as f:
        f.write(out["ptx"])
    suffix = "a" if arch == 90 else ""
    report = subprocess.run(
        [_ptxas(), f"-arch=sm_{arch}{suffix}", "-v", base + ".ptx", "-o", base + ".cubin"],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, report)) else 0  # noqa: E731
    programs = math.prod(module["grid"])
    return {
        "kernel": module["name"],
        "pass": module["pass"],
        "arch": f"sm_{arch}",
        "grid": module["grid"],
        "programs": programs,
        "programs_per_sm": programs / SMS[arch],
        "num_warps": module["num_warps"],
        "num_stages": module["num_stages"],
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "shared_bytes": out["shared"],
        "dots": dot_kinds(module["ttir"]),
        "mma": sorted({m.group(0) for m in re.finditer(r"\b(wgmma\.mma_async|mma\.sync)\.\w+(\.\w+)*", out["ptx"])}),
    }


def report(shape_name: str, arches: list[int]) -> dict[str, Any]:
    modules = capture(SHAPES[shape_name])
    with tempfile.TemporaryDirectory() as workdir:
        kernels = [resources(m, arch, workdir) for m in modules for arch in arches]
    return {
        "shape": shape_name,
        "B_T_H_K_V": SHAPES[shape_name],
        "sms": {f"sm_{a}": SMS[a] for a in arches},
        "kernels": kernels,
    }


SWEEP = {"num_warps": (4, 8), "num_stages": (1, 2, 3)}  # the launch options --sweep compiles every kernel with
SWEEP_FIELDS = ("kernel", "arch", "num_warps", "num_stages", "registers", "spill_store_bytes", "shared_bytes")


def sweep(shape_name: str, arch: int) -> list[dict[str, Any]]:
    """Every kernel (once each) compiled under every ``SWEEP`` setting: the resources each gets, to
    choose ``ops.gla.pallas.LAUNCH`` from (no spills, then the fewest registers)."""
    from laplace_jax.ops.gla.pallas import LAUNCH

    modules = list({m["name"]: m for m in reversed(capture(SHAPES[shape_name]))}.values())[::-1]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for m in modules:
            for warps in SWEEP["num_warps"]:
                for stages in SWEEP["num_stages"]:
                    r = resources({**m, "num_warps": warps, "num_stages": stages}, arch, workdir)
                    chosen = LAUNCH[m["name"]] == {"num_warps": warps, "num_stages": stages}
                    rows.append({k: r[k] for k in SWEEP_FIELDS} | {"chosen": chosen})
    return rows


BLOCKS = ((32, 32), (32, 64), (64, 64), (32, 128))  # (key tile, value tile) settings --blocks compiles


def block_sweep(shape_name: str, arch: int) -> list[dict[str, Any]]:
    """The gradient's kernels compiled under each ``BLOCKS`` tiling (launch options as in
    ``LAUNCH``): programs, registers and spills, to choose ``pallas_gla``'s tiles from."""
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for bk, bv in BLOCKS:
            for m in capture(SHAPES[shape_name], (bk, bv)):
                if m["pass"] == "gradient":
                    r = resources(m, arch, workdir)
                    keep = ("kernel", "arch", "programs", "registers", "spill_store_bytes")
                    rows.append({"block_k": bk, "block_v": bv} | {k: r[k] for k in keep})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.tools.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SMS))
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--sweep", action="store_true", help="also compile every kernel under every num_warps x num_stages")
    ap.add_argument("--blocks", action="store_true", help="also compile the gradient under each key x value tiling")
    a = ap.parse_args(argv)
    try:
        rep = report(a.shape, a.arch)
    except UnsupportedError as e:
        print(f"static GPU check skipped: {e}")
        rep = {"shape": a.shape, "skipped": str(e)}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rep, f, indent=2)
        return 0
    if a.blocks:
        rep["blocks"] = block_sweep(a.shape, a.arch[0])
        for r in rep["blocks"]:
            print(
                f"blocks K {r['block_k']:>3} V {r['block_v']:>3} {r['kernel']:<12} {r['arch']}: "
                f"{r['programs']} programs, {r['registers']} regs, spills {r['spill_store_bytes']} B"
            )
    if a.sweep:
        rep["sweep"] = sweep(a.shape, a.arch[0])
        for r in rep["sweep"]:
            print(
                f"sweep {r['kernel']:<12} {r['arch']} warps {r['num_warps']} stages {r['num_stages']}: "
                f"{r['registers']} regs, spills {r['spill_store_bytes']} B, smem {r['shared_bytes'] / 1024:.0f} KiB"
                + ("  <- LAUNCH" if r["chosen"] else "")
            )
    for k in rep["kernels"]:
        print(
            f"{k['pass']:>8} {k['kernel'][:40]:<40} {k['arch']}: {k['registers']} regs, "
            f"spills {k['spill_store_bytes']} B stored / {k['spill_load_bytes']} B loaded, "
            f"smem {k['shared_bytes'] / 1024:.0f} KiB, {k['programs']} programs "
            f"({k['programs_per_sm']:.2f} per SM), dots {k['dots']}, mma {', '.join(k['mma']) or 'none'}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
