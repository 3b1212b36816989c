"""Structured outputs: JSON-schema generation (the on-device automaton, and host masks for a schema
with numeric bounds) against unconstrained generation at the same batch, the time to compile
each constraint and its automaton's size.

    python -m benchmarks.bench_structured --out benchmarks/results/structured_cpu.json

One engine (the tiny model, random weights, ``--width`` slots, one device) serves ``--width``
requests of ``--new-tokens`` tokens at once, all constrained the same way (an on-device JSON-schema
automaton; host masks for a schema with numeric bounds) or none of them, in turn after a warmup;
the ratios are taken run by run. All use ``ignore_eos`` so every row decodes exactly
``--new-tokens`` tokens (a constrained row that completes its schema keeps sampling the EOS its
accepting state allows): the batch, and so the work per step, is the same in all. A host-masked
row samples one token per engine step (it waits for the host's next mask); when every live row is
one, a step is a decode call of one step, so what is left is a call's fixed cost per token.
Automaton sizes are given in states and in device bytes (the grammar table's int16 entries, in
its tiled layout) for the 3B model's vocabulary (50,304 ids).

The host-mask overlap part serves a mixed batch (half the rows under the bounded schema's host
masks, half unconstrained) with the scheduler's two-call steps (the masks computed from the first
call's tokens while the second call runs) and with one call per step (the masks computed between
calls), side by side run by run, with llguidance's own masks and with each mask made
``--mask-delay-us`` slower by a sleep in the matcher's mask call (simulated: what a large
vocabulary and a complex grammar cost per mask; not llguidance's time on this vocabulary). The
outputs are the same tokens in both (asserted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

import jax
import numpy as np

from benchmarks.common import write_result
from laplace_jax.config import load_run_config
from laplace_jax.data.tokenizer import ByteTokenizer
from laplace_jax.models.gla_lm import init_params
from laplace_jax.sampling import grammar_tiles_shape
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.engine import Engine
from laplace_jax.serve.request import SamplingParams
from laplace_jax.serve.slot_programs import GRAMMAR_DTYPE
from laplace_jax.serve.structured import Compiler, Constraint, LLGuidance, OutlinesCore

VOCAB_3B = 50_304
SCHEMA = {  # a typical extraction schema (strings bounded, an enum, a boolean, an array)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "category": {"enum": ["book", "film", "music", "game"]},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "note": {"type": "string"},
    },
    "required": ["name", "category", "in_stock"],
}
TOOLS_REQUIRED = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"],
            }
            for n, p in (
                (
                    "weather",
                    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
                ),
                ("search", {"type": "object", "properties": {"query": {"type": "string", "maxLength": 64}}}),
            )
        ]
    },
}
RECORD = {  # an extraction record whose every string is bounded (a greedy random model ends it)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "category": {"enum": ["book", "film", "music", "game"]},
        "in_stock": {"type": "boolean"},
        "year": {"type": "string", "pattern": "^(19|20)[0-9]{2}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "category", "in_stock", "year", "tags"],
}
BOUNDED = {**SCHEMA, "properties": {**SCHEMA["properties"], "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
CONSTRAINTS = {
    "json schema (extraction)": Constraint("json", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object", ""),
    "tool_choice required (2 tools)": Constraint("json", json.dumps(TOOLS_REQUIRED)),
    "regex (ISO date)": Constraint("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    "choice (4)": Constraint("choice", json.dumps(["positive", "negative", "neutral", "mixed"])),
}


def _compiler(tok: ByteTokenizer, vocab: int, max_states: int) -> Compiler:
    tb = tok.token_bytes()
    return Compiler(OutlinesCore(tb, tok.eos_id), vocab, tok.eos_id, max_states, LLGuidance(tb, tok.eos_id, vocab))


def _sizes(tok: ByteTokenizer, vocab: int) -> dict:
    out = {}
    for name, c in CONSTRAINTS.items():
        compiler = _compiler(tok, vocab, 1 << 20)
        t0 = time.perf_counter()
        a = compiler.compile(c)
        out[name] = {
            "compile_s": time.perf_counter() - t0,
            "states": a.states,
            "device_bytes_3b_vocab": math.prod(grammar_tiles_shape(a.states, VOCAB_3B)) * GRAMMAR_DTYPE.dtype.itemsize,
        }
        print(name, out[name])
    return out


def _mask_us(grammar, eos_id: int, steps: int = 400) -> float:
    """Median microseconds of one host mask (llguidance) along random walks of ``grammar``."""
    rng, took = np.random.default_rng(0), []
    matcher = grammar.matcher()
    for _ in range(steps):
        t0 = time.perf_counter()
        allowed = grammar.allowed(matcher)
        took.append(time.perf_counter() - t0)
        t = int(rng.choice(np.flatnonzero(allowed)))
        if t == eos_id:
            matcher = grammar.matcher()
        else:
            matcher.consume_token(t)
    return statistics.median(took) * 1e6


def _forced_share(a, outs, eos_id: int) -> float:
    """The share of the output tokens the automaton forced (the only token its state allowed)."""
    forced = total = 0
    for o in outs:
        s = 0
        for t in o.tokens:
            forced += int(np.sum(a.table[s] >= 0) == 1)
            total += 1
            s = int(a.table[s, t]) if t != eos_id else s
    return forced / total


class _Slowed:
    """A host grammar backend whose every mask takes ``delay_s`` more (a sleep: the host waits as
    for a costlier mask, the device is free)."""

    def __init__(self, backend: LLGuidance, delay_s: float):
        self.backend, self.delay_s = backend, delay_s

    def allowed(self, matcher) -> np.ndarray:
        time.sleep(self.delay_s)
        return self.backend.allowed(matcher)


def _host_overlap(engine: Engine, grammar, a: argparse.Namespace) -> dict:
    """A mixed batch (half host-grammar rows of ``--new-tokens`` / 8, half unconstrained rows of
    ``--new-tokens``, sampled, ``ignore_eos``: the two halves take about as many steps) with
    two-call steps (``one_step`` on: the masks overlap the second call) and one call per step
    (off), side by side run by run."""
    prompts = [list(f"item {i}: ".encode()) for i in range(a.width)]
    out = {}
    for delay_us in (0, a.mask_delay_us):
        slowed = (
            grammar if not delay_us else dataclasses.replace(grammar, backend=_Slowed(grammar.backend, delay_us / 1e6))
        )
        sps = [
            SamplingParams(max_tokens=a.new_tokens // 8, temperature=1.0, seed=i, ignore_eos=True, automaton=slowed)
            if i % 2 == 0
            else SamplingParams(max_tokens=a.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(a.width)
        ]

        def run(split: bool, sps=sps):
            engine.scheduler.one_step = split
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sps)
            return time.perf_counter() - t0, [o.tokens for o in outs]

        run(True), run(False)
        times = []
        for _ in range(a.repeats):
            (t_on, o_on), (t_off, o_off) = run(True), run(False)
            assert o_on == o_off, "two-call steps changed an output"
            times.append((t_on, t_off))
        n = sum(len(t) for t in o_on)
        out[f"mask_delay_{delay_us}us"] = {
            "tokens": n,
            "overlapped_tok_s": n / statistics.median(t for t, _ in times),
            "between_calls_tok_s": n / statistics.median(t for _, t in times),
            "speedup": statistics.median(t_off / t_on for t_on, t_off in times),
        }
        print("host overlap", delay_us, out[f"mask_delay_{delay_us}us"])
    engine.scheduler.one_step = True
    return out


def _jump_forward(cfg, params, tok: ByteTokenizer, a: argparse.Namespace) -> dict:
    """Engines with ``jump_forward`` 0 and K side by side, run by run: JSON-schema outputs decoded
    greedily to their end (the same tokens in both: the output is unchanged), compact (no free
    whitespace, as ``disable_any_whitespace``) and with whitespace allowed; and unconstrained
    sampled rows (``ignore_eos``), the cost of the verify branch to requests that draft nothing."""
    compiler = _compiler(tok, cfg.vocab_size, 4096)
    work = {
        "json_compact_greedy": compiler.compile(Constraint("json", json.dumps(RECORD), "")),
        "json_greedy": compiler.compile(Constraint("json", json.dumps(RECORD))),
        "plain": None,
    }
    engines = {}
    for k in (0, a.jump_forward):
        serve = ServeConfig(
            devices=1, max_num_seqs=a.width, steps_per_call=a.steps_per_call, prefix_cache_bytes=0, jump_forward=k
        )
        engines[k] = Engine(cfg, params, serve, eos_id=tok.eos_id)
        engines[k].warmup()
    prompts = [list(f"record {i} as JSON: ".encode()) for i in range(a.width)]

    def run(k: int, kind: str):
        auto = work[kind]
        sps = [
            SamplingParams(max_tokens=200, temperature=0.0, automaton=auto)
            if auto is not None
            else SamplingParams(max_tokens=a.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(a.width)
        ]
        t0 = time.perf_counter()
        outs = engines[k].generate(prompts, sps)
        return time.perf_counter() - t0, outs

    K = a.jump_forward
    for k in engines:
        for kind in work:
            run(k, kind)
    before = sum(e.compiles.total("serving") for e in engines.values())  # (each counts the other's warmup)
    times, shares = {kind: [] for kind in work}, {}
    for _ in range(a.repeats):
        for kind in work:
            (t0, o0), (tk, ok) = run(0, kind), run(K, kind)
            if work[kind] is not None:
                assert [x.tokens for x in o0] == [x.tokens for x in ok], "jump-forward changed a greedy output"
                shares[kind] = (_forced_share(work[kind], o0, tok.eos_id), sum(len(x.tokens) for x in o0))
            else:
                shares[kind] = (0.0, sum(len(x.tokens) for x in o0))
            times[kind].append((t0, tk))
    compiled = sum(e.compiles.total("serving") for e in engines.values()) - before
    out = {"jump_forward": K, "compiles_while_serving": compiled}
    for kind, ts in times.items():
        n = shares[kind][1]
        out[kind] = {
            "tokens": n,
            "forced_share": shares[kind][0],
            "off_tok_s": n / statistics.median(t for t, _ in ts),
            "on_tok_s": n / statistics.median(t for _, t in ts),
            "speedup": statistics.median(t0 / tk for t0, tk in ts),
        }
        print(kind, out[kind])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--width", type=int, default=8, help="requests at once (= slots)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--jump-forward", type=int, default=4, help="K of the jump-forward comparison")
    ap.add_argument("--mask-delay-us", type=int, default=1000, help="the simulated extra cost of a host mask")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_run_config(a.config).model
    tok = ByteTokenizer()
    if cfg.vocab_size != tok.vocab_size:
        raise SystemExit(f"{a.config}: the byte tokenizer needs vocab_size 256; got {cfg.vocab_size}")
    params = init_params(cfg, jax.random.key(0))
    serve = ServeConfig(devices=1, max_num_seqs=a.width, steps_per_call=a.steps_per_call, prefix_cache_bytes=0)
    engine = Engine(cfg, params, serve, eos_id=tok.eos_id)
    engine.warmup()
    compiler = _compiler(tok, cfg.vocab_size, 4096)
    automata = {
        "plain": None,
        "json_schema": compiler.compile(CONSTRAINTS["json schema (extraction)"]),
        "host_json_schema": compiler.compile(Constraint("json", json.dumps(BOUNDED))),
    }
    prompts = [list(f"item {i}: ".encode()) for i in range(a.width)]

    def run(kind: str) -> float:
        sps = [
            SamplingParams(
                max_tokens=a.new_tokens,
                temperature=1.0,
                seed=i,
                ignore_eos=True,
                automaton=automata[kind],
            )
            for i in range(a.width)
        ]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sps)
        took = time.perf_counter() - t0
        assert all(len(o.tokens) == a.new_tokens for o in outs)
        return took

    for kind in automata:  # warm: the grammar table's rows written once
        run(kind)
    times = [{kind: run(kind) for kind in automata} for _ in range(a.repeats)]
    tokens = a.width * a.new_tokens
    res = {
        "config": a.config,
        "width": a.width,
        "new_tokens": a.new_tokens,
        "steps_per_call": a.steps_per_call,
        "structured_states": serve.structured_states,
        "throughput": {
            **{f"{kind}_tok_s": tokens / statistics.median(t[kind] for t in times) for kind in automata},
            "ratio": statistics.median(t["plain"] / t["json_schema"] for t in times),
            "host_ratio": statistics.median(t["plain"] / t["host_json_schema"] for t in times),
            "compiles_while_serving": engine.compiles.total("serving"),
        },
        "constraints": _sizes(tok, cfg.vocab_size),
    }
    res["host_mask_us"] = _mask_us(automata["host_json_schema"], tok.eos_id)
    print(res["throughput"], res["host_mask_us"])
    before = engine.compiles.total("serving")
    res["host_overlap"] = _host_overlap(engine, automata["host_json_schema"], a)
    res["host_overlap"]["mask_delay_us"] = a.mask_delay_us
    res["host_overlap"]["compiles_while_serving"] = engine.compiles.total("serving") - before
    res["jump_forward"] = _jump_forward(cfg, params, tok, a)
    write_result(res, "bench_structured", argv, a.out)


if __name__ == "__main__":
    main()
