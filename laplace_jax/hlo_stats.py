"""Read compiled (optimized, SPMD-partitioned) HLO text: its computations, loop trip counts, the
collectives' traffic and, for TPU programs, the compiler's own per-op cost estimate.

Every figure here is read from the compiler's output, with each ``while`` body counted as many
times as the loop runs: XLA prints ``known_trip_count`` where it knows it (XLA:CPU); otherwise
the trip count is read from the loop itself (the condition compares the induction variable with
a constant, the body adds a constant step to it, the start value is a constant in the caller).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from laplace_jax.ops.gla.limits import (
    MOSAIC_CONV_KERNEL,
    MOSAIC_KERNELS,
    MOSAIC_STEP_KERNEL,
    XLA_CONV_SCOPE,
    XLA_SCORES_SCOPE,
    XLA_STEP_SCOPE,
)

_BYTES = {
    **{"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4},
    **{"bf16": 2, "f16": 2, "u16": 2, "s16": 2, "s8": 1, "u8": 1, "pred": 1},
}
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|u16|s16|s8|u8|pred)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"([\w\-]+)\(")
_KNOWN_TRIPS = re.compile(r"known_trip_count[^0-9]*(\d+)")
_CALLERS = "calls|to_apply|body|condition|branch_computations|true_computation|false_computation"
_CALLS = re.compile(rf"(?:{_CALLERS})=\{{?([^}}]*)\}}?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_GTE_INDEX = re.compile(r"get-tuple-element\(%?([\w.\-]+)\), index=(\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
# bytes one device sends per byte of an op's result, ring algorithms over a group of n:
# all-gather and all-to-all (n-1)/n of the result, reduce-scatter n-1 shards, all-reduce
# 2(n-1)/n of it; a collective-permute sends its buffer once
RING = {
    "all-gather": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1.0,
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array shape written in ``text``, in order (a tuple type lists each)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (a tuple type sums its elements)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: its name, result type text, opcode, the rest of the line, and whether
    it is its computation's root."""

    name: str
    type: str
    opcode: str
    rest: str
    root: bool

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ""

    @property
    def frame(self) -> int | None:
        m = _FRAME.search(self.rest)
        return int(m.group(1)) if m else None

    @property
    def cycles(self) -> int | None:
        """The TPU compiler's ``estimated_cycles`` for this instruction, if it printed one."""
        m = _CYCLES.search(self.rest)
        return int(m.group(1)) if m else None

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation) for every computation this instruction calls."""
        out = []
        for attr in _CALLERS.split("|"):
            m = re.search(rf"\b{attr}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.rest)
            if m:
                out += [(attr, c) for c in re.findall(r"%?([\w.\-]+)", m.group(1).strip("{}"))]
        return out


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    tail = line[m.end() :]
    if tail.startswith("("):  # a tuple type: up to its matching parenthesis
        depth, end = 0, len(tail)
        for pos, ch in enumerate(tail):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = pos + 1
                break
        type_, tail = tail[:end], tail[end + 1 :]
    else:
        type_, _, tail = tail.partition(" ")
    op = _OPCODE.match(tail)
    return Instr(m.group(2), type_, op.group(1) if op else "", tail, bool(m.group(1)))


class Module:
    """A compiled module's text, split into computations of parsed instructions."""

    def __init__(self, hlo: str):
        self.text = hlo
        self.computations: dict[str, list[Instr]] = {}
        self.lines: dict[str, list[str]] = {}
        self.entry: str | None = None
        current = None
        for line in hlo.splitlines():
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(1)
                self.computations[current], self.lines[current] = [], []
                if line.startswith("ENTRY"):
                    self.entry = current
            elif current is not None:
                self.lines[current].append(line)
                ins = _parse_instr(line)
                if ins is not None:
                    self.computations[current].append(ins)

    @functools.cached_property
    def _by_name(self) -> dict[str, dict[str, Instr]]:
        return {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}

    def operand_types(self, comp: str, ins: Instr) -> list[str]:
        """The result types of ``ins``' operands (instructions of computation ``comp``), in order."""
        names = self._by_name[comp]
        m = re.match(r"[\w\-]+\(([^)]*)\)", ins.rest)
        refs = re.findall(r"%([\w.\-]+)", m.group(1)) if m else []
        return [names[r].type for r in refs if r in names]

    def trip_count(self, caller: str, loop: Instr) -> int | None:
        """How many times ``loop`` (a while in ``caller``) runs its body, or None if unreadable."""
        known = _KNOWN_TRIPS.search(loop.rest)
        if known:
            return int(known.group(1))
        callees = dict(loop.callees())
        cond, body = callees.get("condition"), callees.get("body")
        if cond not in self.computations or body not in self.computations:
            return None
        root = next((i for i in self.computations[cond] if i.root), None)
        if root is None or root.opcode != "compare":
            return None
        names = self._by_name[cond]
        operands = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0])
        index = limit = None
        for pos, name in enumerate(operands):
            ins = names.get(name)
            if ins is None:
                continue
            c = _CONSTANT.match(ins.rest)
            g = _GTE_INDEX.match(ins.rest)
            if ins.opcode == "constant" and c:
                limit, limit_pos = int(c.group(1)), pos
            elif ins.opcode == "get-tuple-element" and g:
                index = int(g.group(2))
        if index is None or limit is None:
            return None
        direction = re.search(r"direction=(\w+)", root.rest)
        direction = direction.group(1) if direction else "LT"
        if limit_pos == 0:  # constant first: flip the comparison
            direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
        step = self._step(body, index)
        start = self._start(caller, loop, index)
        if step is None or start is None or step == 0:
            return None
        span = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1}
        span["NE"] = abs(limit - start)
        if direction not in span:
            return None
        return max(0, -(-span[direction] // abs(step)))

    def _step(self, body: str, index: int) -> int | None:
        """The constant the body adds to tuple element ``index`` each trip."""
        names = self._by_name[body]
        root = next((i for i in self.computations[body] if i.root), None)
        if root is None or root.opcode != "tuple":
            return None
        elements = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0])
        if index >= len(elements):
            return None
        upd = names.get(elements[index])
        if upd is None or upd.opcode not in ("add", "subtract"):
            return None
        for name in re.findall(r"%([\w.\-]+)", upd.rest.split(")")[0]):
            ins = names.get(name)
            c = _CONSTANT.match(ins.rest) if ins is not None and ins.opcode == "constant" else None
            if c:
                return int(c.group(1)) * (1 if upd.opcode == "add" else -1)
        return None

    def _start(self, caller: str, loop: Instr, index: int) -> int | None:
        """The induction variable's start value: element ``index`` of the loop's operand tuple,
        followed through copies to a constant."""
        names = self._by_name[caller]
        arg = names.get(re.findall(r"%([\w.\-]+)", loop.rest)[0])
        if arg is None or arg.opcode != "tuple":
            return None
        elements = re.findall(r"%([\w.\-]+)", arg.rest.split(")")[0])
        ins = names.get(elements[index]) if index < len(elements) else None
        while ins is not None and ins.opcode in ("copy", "bitcast"):
            ins = names.get(re.findall(r"%([\w.\-]+)", ins.rest)[0])
        c = _CONSTANT.match(ins.rest) if ins is not None and ins.opcode == "constant" else None
        return int(c.group(1)) if c else None

    def multiplicities(
        self, control_only: bool = False, branch: Callable[[Instr], str] | None = None
    ) -> dict[str, float]:
        """How many times one run of the module executes each computation: a while body its trip
        count (an unreadable one counts 1: see ``loops``), its condition once more; a called
        computation as often as its caller. ``control_only``: only computations that run as
        code of their own (while, conditional, call, async), not fusion or reducer bodies, whose
        cost their caller's instruction already carries. ``branch``: the one branch computation a
        conditional runs (one run takes one branch); without it every branch counts."""
        mult: dict[str, float] = defaultdict(float)

        def visit(name: str, factor: float, depth: int = 0) -> None:
            if name not in self.computations or depth > 64:
                return
            mult[name] += factor
            for ins in self.computations[name]:
                trips = (self.trip_count(name, ins) or 1) if ins.opcode == "while" else 1
                taken = branch(ins) if branch is not None and ins.opcode == "conditional" else None
                for attr, callee in ins.callees():
                    if control_only and not _runs_as_code(ins, attr):
                        continue
                    if taken is not None and _runs_as_code(ins, attr) and callee != taken:
                        continue
                    visit(callee, factor * {"body": trips, "condition": trips + 1}.get(attr, 1), depth + 1)

        if self.entry:
            visit(self.entry, 1.0)
        return mult

    def frames(self) -> dict[int, list[tuple[str, str, int]]]:
        """stack_frame_id -> [(file, function, line), innermost first] from the module's tables
        (an op's ``stack_frame_id`` names its innermost frame; each frame's ``parent_frame_id``
        is its caller's table id plus one, 0 for none)."""
        tables: dict[str, dict[int, str]] = defaultdict(dict)
        section = None
        for line in self.text.splitlines():
            if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = line
                continue
            if not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
                section = None if not line.strip() else section
                continue
            m = re.match(r"^(\d+) (.*)$", line)
            if section and m:
                tables[section][int(m.group(1))] = m.group(2)

        def fields(text: str) -> dict[str, int]:
            return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

        out: dict[int, list[tuple[str, str, int]]] = {}
        for fid in tables["StackFrames"]:
            chain, seen, cur = [], set(), fid
            while cur in tables["StackFrames"] and cur not in seen:
                seen.add(cur)
                fr = fields(tables["StackFrames"][cur])
                loc = fields(tables["FileLocations"].get(fr.get("file_location_id", -1), ""))
                file = tables["FileNames"].get(loc.get("file_name_id", -1), '""').strip('"')
                func = tables["FunctionNames"].get(loc.get("function_name_id", -1), '""').strip('"')
                chain.append((file, func, loc.get("line", 0)))
                cur = fr.get("parent_frame_id", 0) - 1  # the parent's table id plus one; 0: no parent
            out[fid] = chain
        return out


def memory_report(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled step: arguments, outputs, temporaries, aliased, total needed."""
    m = compiled.memory_analysis()
    need = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "total": int(need),
    }


def _runs_as_code(ins: Instr, attr: str) -> bool:
    if ins.opcode == "while":
        return attr in ("body", "condition")
    if ins.opcode == "conditional":
        return attr in ("branch_computations", "true_computation", "false_computation")
    return ins.opcode in ("call", "async-start") and attr in ("to_apply", "calls")


def chosen_branches(
    module: Module, cost: Callable[[str, Any], float], cheapest: Callable[[Any], bool] = lambda ins: False
) -> dict[str, str]:
    """{conditional instruction's name: its costliest branch computation} (its cheapest where
    ``cheapest(ins)``), each branch's cost its own instructions' (``cost(comp, ins)``) plus what it
    runs as code (loops by their trips, nested conditionals by their own chosen branch)."""
    chosen: dict[str, str] = {}

    @functools.cache
    def total(comp: str) -> float:
        c = 0.0
        for ins in module.computations.get(comp, []):
            c += cost(comp, ins)
            trips = (module.trip_count(comp, ins) or 1) if ins.opcode == "while" else 1
            called = [(a, callee) for a, callee in ins.callees() if _runs_as_code(ins, a)]
            if ins.opcode == "conditional" and called:
                best = (min if cheapest(ins) else max)((callee for _, callee in called), key=total)
                chosen[ins.name] = best
                c += total(best)
                continue
            c += sum({"body": trips, "condition": trips + 1}.get(a, 1) * total(callee) for a, callee in called)
        return c

    if module.entry:
        total(module.entry)
    return chosen


def loops(module: Module) -> list[dict[str, object]]:
    """Every while loop reached from the entry: its body, JAX op name and trip count (None where
    it could not be read, in which case every sum here counts the body once)."""
    out = []
    mult = module.multiplicities(control_only=True)
    for comp, instrs in module.computations.items():
        if not mult.get(comp):
            continue
        for ins in instrs:
            if ins.opcode == "while":
                body = dict(ins.callees()).get("body")
                out.append({"body": body, "op_name": ins.op_name, "trips": module.trip_count(comp, ins)})
    return out


def source_of(op_name: str) -> str:
    """Which part of a train step a collective came from, by its JAX op_name: "embeddings" (the
    token table's gather and its gradient's reduce-scatter), "weights" (every other model
    parameter's FSDP gather and gradient reduction, ``parallel.gathered``), "context" (context
    parallelism: the GLA states' all-gather, the short convolution's neighbour exchange and an
    attention layer's earlier keys and values, and their transposes), "muon" (the optimizer's
    all-to-alls), or "other" (the loss and the gradient norm)."""
    if any(scope in op_name for scope in ("context_states", "context_halo", "context_kv")):
        return "context"
    if "/embeddings/" in op_name:
        return "embeddings"
    if "GLALM" in op_name:
        return "weights"
    if "muon/" in op_name:
        return "muon"
    return "other"


def group_size(line: str, devices: int) -> int:
    """How many devices one collective's replica group holds, from its HLO line (an explicit
    list, the iota form [groups, size], or the mesh form with its named axes); ``devices`` when
    the groups are empty (every device)."""
    if m := _GROUPS_LIST.search(line):
        return len(m.group(1).split(","))
    if m := _GROUPS_IOTA.search(line):
        return int(m.group(1))
    if m := _GROUPS_MESH.search(line):
        sizes = {k.strip("'"): int(v) for k, v in (a.split("=") for a in m.group(1).split(","))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(","))
    return devices


def collective_bytes(hlo: str) -> dict[str, dict[str, float]]:
    """Per-device bytes and op counts of each collective kind in one execution of the module.

    Bytes are the collective's result shape on one device (for all-to-all: the payload each rank
    exchanges; for all-gather: the gathered result). A collective inside a while body counts
    trip-count times; computations reached from several callers count once per call site.
    """
    out: dict[str, dict[str, float]] = {k: {"bytes": 0.0, "ops": 0.0, "wire": 0.0} for k in COLLECTIVES}
    for by_kind in collectives_by_source(hlo).values():
        for kind, v in by_kind.items():
            for key in out[kind]:
                out[kind][key] += v[key]
    return out


def collectives_by_source(hlo: str) -> dict[str, dict[str, dict[str, float]]]:
    """``collective_bytes`` split by ``source_of`` the op: {source: {kind: {"bytes", "ops",
    "wire"}}}; "wire" is the bytes one device sends under ring algorithms over each op's own
    replica group (``RING``, ``group_size``)."""
    module = Module(hlo)
    mult = module.multiplicities()
    devices = int(m.group(1)) if (m := _PARTITIONS.search(hlo[:4000])) else 1
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, lines in module.lines.items():
        factor = mult.get(name, 0.0)
        for line in lines:
            for kind in COLLECTIVES:
                if f" {kind}(" in line or f" {kind}-start(" in line:
                    lhs = line.split("=", 1)[1].split(kind)[0]
                    op = _OP_NAME.search(line)
                    src = out.setdefault(source_of(op.group(1) if op else ""), {})
                    v = src.setdefault(kind, {"bytes": 0.0, "ops": 0.0, "wire": 0.0})
                    v["bytes"] += factor * shape_bytes(lhs)
                    v["ops"] += factor
                    v["wire"] += factor * shape_bytes(lhs) * RING[kind](group_size(line, devices))
    return out


def gla_kernels(hlo: str) -> list[str]:
    """The GLA kernels a compiled program runs, read from its HLO text: the Mosaic kernels by their
    names, a Pallas GPU kernel by its Triton call, the XLA kernels by their named scopes (the chunk
    kernel with its layout, the decode and conv steps)."""
    gla = (*MOSAIC_KERNELS, MOSAIC_STEP_KERNEL, MOSAIC_CONV_KERNEL)  # not the projections, norms or SwiGLU
    found = [f"{name} (Mosaic)" for name in gla if name in hlo]
    if "xla.gpu.triton" in hlo or "__triton" in hlo:
        found.append("Pallas GPU kernel (Triton)")
    layouts = [lay for lay in ("full", "blocks") if XLA_SCORES_SCOPE.format(layout=lay) in hlo]
    found += [f"XLA chunk kernel ({lay} layout)" for lay in layouts]
    found += [
        label for scope, label in ((XLA_STEP_SCOPE, "XLA GLA step"), (XLA_CONV_SCOPE, "XLA conv step")) if scope in hlo
    ]
    return found
