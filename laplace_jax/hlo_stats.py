"""Collective traffic read from compiled (SPMD-partitioned) HLO text, with loop trip counts applied."""

from __future__ import annotations

import re
from collections import defaultdict

_BYTES = {
    **{"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4},
    **{"bf16": 2, "f16": 2, "u16": 2, "s16": 2, "s8": 1, "u8": 1, "pred": 1},
}
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|u16|s16|s8|u8|pred)\[([\d,]*)\]")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+).*?known_trip_count[^0-9]*(\d+)")
_CALLERS = "calls|to_apply|body|condition|branch_computations|true_computation|false_computation"
_CALLS = re.compile(rf"(?:{_CALLERS})=\{{?([^}}]*)\}}?")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def source_of(op_name: str) -> str:
    """Which part of a train step a collective came from, by its JAX op_name: "embeddings" (the
    token table's gather and its gradient's reduce-scatter), "weights" (every other model
    parameter's FSDP gather and gradient reduction, ``parallel.gathered``), "muon" (the
    optimizer's all-to-alls), or "other" (the loss and the gradient norm)."""
    if "/embeddings/" in op_name:
        return "embeddings"
    if "GLALM" in op_name:
        return "weights"
    if "muon/" in op_name:
        return "muon"
    return "other"


def collective_bytes(hlo: str) -> dict[str, dict[str, float]]:
    """Per-device bytes and op counts of each collective kind in one execution of the module.

    Bytes are the collective's result shape on one device (for all-to-all: the payload each rank
    exchanges; for all-gather: the gathered result). A collective inside a while body counts
    trip-count times; computations reached from several callers count once per call site.
    """
    out: dict[str, dict[str, float]] = {k: {"bytes": 0.0, "ops": 0.0} for k in COLLECTIVES}
    for by_kind in collectives_by_source(hlo).values():
        for kind, v in by_kind.items():
            out[kind]["bytes"] += v["bytes"]
            out[kind]["ops"] += v["ops"]
    return out


def collectives_by_source(hlo: str) -> dict[str, dict[str, dict[str, float]]]:
    """``collective_bytes`` split by ``source_of`` the op: {source: {kind: {"bytes", "ops"}}}."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    entry = next((m.group(1) for line in hlo.splitlines() if (m := re.match(r"^ENTRY %?([\w.\-]+)", line))), None)
    mult: dict[str, float] = defaultdict(float)

    def visit(name: str, factor: float, depth: int = 0) -> None:
        if name not in comps or depth > 50:
            return
        mult[name] += factor
        for line in comps[name]:
            w = _WHILE.search(line)
            trips = {w.group(1): int(w.group(2))} if w else {}
            for group in _CALLS.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    visit(callee, factor * trips.get(callee, 1), depth + 1)

    if entry:
        visit(entry, 1.0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, lines in comps.items():
        factor = mult.get(name, 0.0)
        for line in lines:
            for kind in COLLECTIVES:
                if f" {kind}(" in line or f" {kind}-start(" in line:
                    lhs = line.split("=", 1)[1].split(kind)[0]
                    op = _OP_NAME.search(line)
                    src = out.setdefault(source_of(op.group(1) if op else ""), {})
                    v = src.setdefault(kind, {"bytes": 0.0, "ops": 0.0})
                    v["bytes"] += factor * _shape_bytes(lhs)
                    v["ops"] += factor
    return out
