"""Markdown tables generated from the committed benchmark JSON, so a table cannot drift from its data.

    python -m benchmarks.tables            # rewrite every table in the docs from benchmarks/results/
    python -m benchmarks.tables --check    # exit 1 (and name the table) where a doc differs

A doc holds a generated table between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``;
everything between the markers is replaced by ``TABLES[NAME]`` rendered from its JSON, whose
path is written under the table with the command that produced it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
from collections.abc import Callable

RESULTS = os.path.join("benchmarks", "results")
DOCS = (
    "README.md",
    "BENCHMARKS.md",
    *(
        os.path.join("docs", f)
        for f in (
            "tpu.md",
            "context.md",
            "hybrid.md",
            "model.md",
            "training.md",
            "serving.md",
            "kernels.md",
            "evaluation.md",
            "development.md",
            "data.md",
        )
    ),
)


def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:,.3f} s"
    return f"{s * 1e3:,.2f} ms" if s < 0.01 else f"{s * 1e3:,.1f} ms"


def _ms_cell(s: float, digits: int = 1) -> str:
    """Milliseconds at a fixed number of decimals (a table column's unit)."""
    return f"{s * 1e3:,.{digits}f} ms"


def _sci(x: float) -> str:
    """1.2e-7 style: one decimal, no padded exponent."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(c) + " |" for c in rows]


def _width(report: dict, width: int) -> dict:
    """A decode-memory report's entry for one decode width."""
    return next(d for d in report["decode"] if d["width"] == width)


def _sweep_worst(sweep: dict, kinds: tuple[str, ...]) -> float:
    """The decay sweep's worst relative gradient error of any kernel, over every decay and gradient."""
    return max(
        e[kind]
        for d in sweep["decays"].values()
        for gradients in (d["chunk"], d["pallas"], d["mosaic"])
        for e in gradients.values()
        for kind in kinds
        if kind in e
    )


GiB = 2**30


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def _mesh(sizes: dict) -> str:
    return " x ".join(f"{k} {v}" for k, v in sizes.items())


def _tpu_programs(r: dict) -> list[str]:
    rows = ["| program | TPU | compiler estimate | hand-counted limit | estimate / limit | temporaries per chip |"]
    rows.append("|---|---|---|---|---|---|")
    for rep in (*r["rows"].get("kernel", []), *r["rows"].get("decode", [])):
        lim = rep["limit"]
        name = rep["program"]
        if "steps_per_call" in rep:  # one call decodes several tokens: say so, with the time per token
            name += f", {rep['steps_per_call']} tokens per call ({_ms(rep['per_token_s'])} per token"
            if "per_token_optional_skipped_s" in rep:  # platform.skip_unless's work skipped
                name += f"; {_ms(rep['per_token_optional_skipped_s'])} for a greedy batch with nothing optional"
            name += ")"
        if rep.get("mosaic"):  # timed as Mosaic kernels are (tpu.MOSAIC_LABEL)
            name += " [Mosaic: static schedule or DMA floor]"
        rows.append(
            f"| {name} | {rep['chip']} | {_ms(rep['estimate_s'])} | {_ms(rep['limit_s'])} ({lim['bound']}) "
            f"| {rep['estimate_over_limit']:.1f}x | {_gib(rep['memory']['temporaries'])} |"
        )
    return rows


def _tpu_train(r: dict) -> list[str]:
    rows = ["| config | topology | mesh | step (estimate) | tokens/s | MFU | memory per chip | temporaries |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for t in r["rows"].get("train", []):
        run, mem = t["run"], t["memory"]
        over = ", ".join(f"{b}.{k}={v}" for b, kv in t["overrides"].items() for k, v in kv.items())
        mesh = _mesh(t["mesh"])
        rows.append(
            f"| `{t['config']}`{' ' + over if over else ''} | {t['topology']} | {mesh} | {_ms(run['step_s'])} | "
            f"{run['tokens_per_s']:,.0f} | {100 * run['mfu']:.1f}% | {_gib(mem['total'])} | "
            f"{_gib(mem['temporaries'])} |"
        )
    return rows


def _tpu_remat(r: dict) -> list[str]:
    """The 3B train step under each remat policy (``bench_tpu --only remat``), as the train table."""
    return _tpu_train({"rows": {"train": r["rows"]["remat"]}})


def _tpu_sources(r: dict) -> list[str]:
    rows = ["| program | share of the estimate | JAX source (primitives) |", "|---|---|---|"]
    for rep in (*r["rows"].get("kernel", []), *r["rows"].get("decode", []), *r["rows"].get("train", [])):
        name = f"train step, `{rep['config']}`{_impl(rep)} on {rep['topology']}" if "config" in rep else rep["program"]
        for src in rep["top_sources"][:3]:
            prims = sorted(src["primitives"].items(), key=lambda kv: -kv[1])[:2]
            names = ", ".join(p for p, _ in prims)
            rows.append(f"| {name} ({rep['chip']}) | {100 * src['share']:.1f}% | `{src['source']}` ({names}) |")
    return rows


def _impl(t: dict) -> str:
    """A train row's kernel override, as its name shows it (empty for the default)."""
    impl = t["overrides"].get("model", {}).get("attn_impl")
    return f", model.attn_impl={impl}" if impl else ""


def _program_rows(r: dict) -> dict[str, tuple[str, float, float | None]]:
    """program name -> (TPU, estimated seconds, MFU or None) for every row of a tpu_programs JSON."""
    out = {}
    for rep in (*r["rows"].get("kernel", []), *r["rows"].get("decode", [])):
        out[f"{rep['program']} ({rep['chip']})"] = (rep["chip"], rep["estimate_s"], None)
    for t in r["rows"].get("train", []):
        out[f"train step, `{t['config']}`{_impl(t)}"] = (t["topology"], t["run"]["step_s"], t["run"]["mfu"])
    return out


def _wave3_name(name: str) -> str:
    """The baseline row a program is compared with: the same program with wave 3's kernel."""
    return name.replace("mosaic_gla", "chunk_gla").replace(", model.attn_impl=mosaic", "")


def _tpu_before_after(r: dict, baseline: dict) -> list[str]:
    before = _program_rows(baseline)
    rows = ["| program | TPU | before (wave 3) | now | now / before |", "|---|---|---|---|---|"]
    for name, (chip, now_s, mfu) in _program_rows(r).items():
        was = before.get(_wave3_name(name))
        if was is not None:
            mfus = f" (MFU {100 * was[2]:.1f}% -> {100 * mfu:.1f}%)" if mfu is not None else ""
            rows.append(f"| {name} | {chip} | {_ms(was[1])} | {_ms(now_s)}{mfus} | {now_s / was[1]:.2f} |")
    return rows


def _decode_one_row(now: dict, before: dict) -> list[str]:
    """One sequence's decode step before and after the one-row product is padded to two rows."""
    was = {rep["program"]: rep for rep in before["reports"]}
    rows = ["| program | TPU | before (8b13770) | now | hand-counted limit | share of the limit, before -> now |"]
    rows.append("|---|---|---|---|---|---|")
    for rep in now["reports"]:
        lim, now_s = rep["limit"]["seconds"], rep["estimate"]["seconds"]
        old = was.get(rep["program"])  # a weight form added since has no before
        old_s = old["estimate"]["seconds"] if old else None
        rows.append(
            f"| {rep['program']} | {rep['chip']} | {_ms(old_s) if old else '-'} | {_ms(now_s)} | {_ms(lim)} | "
            + (f"{100 * lim / old_s:.0f}% -> " if old else "")
            + f"{100 * lim / now_s:.0f}% |"
        )
    return rows


def _tpu_prefill(r: dict) -> list[str]:
    head = ["prompt (1 row)", "weights", "TPU", "compiler estimate", "tokens/s per chip", "FLOP limit"]
    rows = ["| " + " | ".join([*head, "share of the limit"]) + " |", "|---|---|---|---|---|---|---|"]
    for p in r["rows"].get("prefill", []):
        lim = p["limit"]
        form = p["program"].split(", ", 2)[2] if p["program"].count(", ") >= 2 else "bf16 weights"
        rows.append(
            f"| {p['tokens']:,} tokens | {form} | {p['chip']} | {_ms(p['estimate_s'])} | {p['tokens_per_s']:,.0f} | "
            f"{_ms(lim['compute_s'])} | {100 * lim['compute_s'] / p['estimate_s']:.0f}% |"
        )
    return rows


def _tpu_calibration(r: dict) -> list[str]:
    rows = ["| program | chip | compiler estimate | rate | share of the published limit |", "|---|---|---|---|---|"]
    for c in r["rows"]["calibration"]:  # a Mosaic row's estimate is its static schedule (tpu.MOSAIC_LABEL)
        rate = f"{c['rate'] / 1e12:,.1f} TFLOP/s" if "matmul" in c["program"] else f"{c['rate'] / 1e9:,.0f} GB/s"
        rows.append(f"| {c['program']} | {c['chip']} | {_ms(c['estimate_s'])} | {rate} | {100 * c['share']:.0f}% |")
    return rows


def _context_plans(r: dict) -> list[str]:
    tpu = r["topology"] is not None
    step = "step (compiler estimate)" if tpu else "step at peak"
    rows = [
        f"| run | mesh | tokens per device | memory per device | fits | context all-gather per op: received "
        f"(formula) | all collectives on the wire | {step} | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        if "refused" in x:
            rows.append(f"| {x['name']} | | {x['tokens_per_device']:,} | not compiled: {x['refused']} | | | | | |")
            continue
        mesh = _mesh(x["mesh"])
        mem = f"{_gib(x['memory']['total'])} of {_gib(x['device_memory'])}"
        gather = x.get("context_all_gather")
        cell = (
            "none"
            if gather is None
            else (
                f"{gather['received_bytes_per_op'] / 1e6:,.2f} MB ({gather['formula_bytes'] / 1e6:,.2f} MB), "
                f"{gather['ops']:.0f} ops"
            )
        )
        if tpu:
            t = x["tpu_run"]
            time, rate = _ms(t["step_s"]), f"{t['tokens_per_s']:,.0f}"
        else:
            time, rate = _ms(x["cost"]["compute_s_at_peak"]), f"{x['cost']['tokens_per_s']:,.0f}"
        rows.append(
            f"| {x['name']} | {mesh} | {x['tokens_per_device']:,} | {mem} | {'yes' if x['fits'] else 'no'} | "
            f"{cell} | {x['wire_bytes'] / 1e9:,.2f} GB | {time} | {rate} |"
        )
    return rows


def _context_kernel_tpu(r: dict) -> list[str]:
    k = r["kernel"]
    ctx = k["collectives"]["context"]["all-gather"]
    return [
        "| program | chips | compiler estimate | one chip, same slice from a zero state | added | temporaries "
        "(one chip) | all-gather received (formula) |",
        "|---|---|---|---|---|---|---|",
        f"| {k['name']} | {k['chips']} | {_ms(k['context_s'])} | {_ms(k['one_chip_s'])} | "
        f"{100 * k['overhead']:.1f}% | {_gib(k['context_temporaries'])} ({_gib(k['one_chip_temporaries'])}) | "
        f"{ctx['wire'] / 1e6:,.2f} MB ({k['formula_bytes'] / 1e6:,.2f} MB) |",
    ]


def _hybrid_recall(r: dict) -> list[str]:
    """MQAR accuracy per (context length, pairs), every run's in each cell (in the runs' order), the window marked."""
    acc = {n: {(c["length"], c["level"]): c["accuracy"] for c in run["grid"]} for n, run in r["runs"].items()}
    levels = [p for p in r["levels"] if any((n, p) in acc["hybrid"] for n in r["lengths"])]
    rows = [f"| context (tokens): {' / '.join(acc)} | " + " | ".join(f"{p} pair{'s' * (p > 1)}" for p in levels) + " |"]
    rows.append("|---|" + "---|" * len(levels))
    for n in r["lengths"]:
        where = "inside" if n <= r["window"] else "beyond"
        cells = [
            " / ".join(f"{a[(n, p)]:.2f}" for a in acc.values()) if (n, p) in acc["hybrid"] else "" for p in levels
        ]
        rows.append(f"| {n:,} ({where} the window) | " + " | ".join(cells) + " |")
    runs = r["runs"]
    rows += [
        "",
        "| run | parameters | attention | state per sequence | steps x windows x tokens | final eval loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in runs.items():
        attn = ", ".join(f"layers {a['layers']}, window {a['window_size']}" for a in x["attn"]) or "none"
        rows.append(
            f"| {name} | {x['params']:,} | {attn} | {x['state_bytes']:,} B | {x['steps']} x {x['global_batch']} x "
            f"{x['seq_len']} | {x['eval_loss']:.4f} |"
        )
    return rows


def _attention_tpu(r: dict) -> list[str]:
    rows = [
        "| TPU | pass | window | compiler estimate | hand-counted limit | estimate / limit | temporaries | "
        "largest shares of the estimate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        lim = x["limit"]
        top = ", ".join(
            f"{max(b['primitives'], key=b['primitives'].get)} at {b['source'].split()[0]} {100 * b['share']:.0f}%"
            for b in x["estimate"]["by_source"][:3]
        )
        rows.append(
            f"| {x['chip']} | {x['pass']} | {x['window'] or 'full'} | {_ms(x['estimate']['seconds'])} | "
            f"{_ms(lim['seconds'])} ({lim['bound']}) | {x['estimate_over_limit']:.1f}x | "
            f"{_gib(x['memory']['temporaries'])} | {top} |"
        )
    return rows


def _headlines(first_run: dict, sweep: dict, tpu: dict, auto: dict, decode: dict, muon: dict) -> list[str]:
    """README's short list: one figure per part of the product, each read from its JSON."""
    worst = _sweep_worst(sweep, ("per_element", "summed"))
    kernel = {(x["program"].split()[0], x["chip"], x["program"].rsplit(", ", 1)[1]): x for x in tpu["rows"]["kernel"]}
    fwd, both = kernel["mosaic_gla", "v5e", "forward"], kernel["mosaic_gla", "v5e", "forward + backward"]
    train = next(t for t in tpu["rows"]["train"] if t["config"] == "configs/3b.py" and _impl(t))
    steps = {x["attn_impl"]: x for x in auto["rows"]["decode"]}
    mosaic, step = steps["auto"], steps["chunk"]
    per_layer = next(x for x in tpu["rows"]["decode"] if "unstack_weights" in x["program"])
    w256 = _width(decode, 256)
    bf16 = muon["bfloat16"]
    rows = [
        [
            "first command: `configs/tiny.py`, 300 steps",
            f"eval loss {first_run['final_eval_loss']:.2f} nats/byte in {first_run['wall_s'] / 60:.1f} min",
            "2 CPU cores",
        ],
        [
            "GLA gradients (XLA and both Pallas kernels) vs a float64 recurrence, decays -0.01 to -16 nats/token",
            f"worst {_sci(worst)} relative",
            "CPU, fp32",
        ],
        [
            "GLA kernel at the 3B layer (B4 T4096 H16), bf16, the Pallas TPU kernel (what `auto` runs on TPU)",
            f"forward {_ms(fwd['estimate_s'])}, forward + backward {_ms(both['estimate_s'])} "
            f"({fwd['estimate_over_limit']:.1f}x and {both['estimate_over_limit']:.1f}x their hand-counted limits)",
            "TPU v5e, the compiler's estimate (of a Mosaic kernel: its static schedule; no TPU ran)",
        ],
        [
            "3B train step on 16 chips (Muon, FSDP), the Pallas TPU kernel",
            f"MFU {100 * train['run']['mfu']:.1f}%, {train['run']['tokens_per_s']:,.0f} tokens/s "
            f"(the original team measured {train['seed']['tokens_per_s']:,.0f} on {train['seed']['chips']} "
            "Trainium2 chips)",
            "TPU v5p:2x2x4, the compiler's estimate",
        ],
        [
            "3B decode step, 256 sequences, bf16 weights placed per layer as serving places them on TPU "
            "(the Mosaic matmul); stacked, with `auto` (the Pallas TPU steps); with the XLA steps (`chunk`)",
            f"{_ms(per_layer['estimate_s'])} ({100 / per_layer['estimate_over_limit']:.0f}% of its hand-counted "
            f"memory limit); {_ms(mosaic['estimate_s'])} ({100 / mosaic['estimate_over_limit']:.0f}%); "
            f"{_ms(step['estimate_s'])} ({100 / step['estimate_over_limit']:.0f}%)",
            "TPU v5p, the compiler's estimate (Mosaic kernels: static schedule or DMA floor at XLA's streaming rate)",
        ],
        [
            "3B decode step temporaries, 256 sequences",
            f"{_gib(w256['temporaries_bytes'])} beside a {w256['state_bytes'] / 1e9:.2f} GB state",
            "XLA:CPU compile",
        ],
        [
            "Muon's two all-to-alls, 3B on 64 ranks, bf16 payload",
            f"{bf16['all_to_all_bytes_per_rank'] / 1e9:.3f} GB per rank per step, "
            f"{bf16['reduction_vs_gather']:.0f}x less than gathering",
            "compiled HLO",
        ],
    ]
    return _grid(["what", "figure", "measured how"], rows)


def _import_memory(r: dict) -> list[str]:
    row = [
        f"{r['shards']} shards, {r['checkpoint_bytes'] / 1e9:.2f} GB (largest {r['largest_shard_bytes'] / 1e9:.2f} GB)",
        f"{r['params_fp32_bytes'] / 1e9:.2f} GB",
        f"{r['import_overhead_bytes'] / 1e9:.2f} GB",
        f"{r['overhead_over_largest_shard']:.2f}x",
    ]
    head = ["bf16 checkpoint", "fp32 parameters returned", "peak above them", "peak over the largest shard"]
    return _grid(head, [row])


def _prepare(r: dict) -> list[str]:
    labels = {"byte_1x": "byte, 1x", "byte_4x": "byte, 4x", "bpe_1x": "BPE at GPT-2's vocabulary (50,257), 1x"}
    rows = []
    for name, run in r["prepare"].items():
        limit = r["encode_limit"].get(name)
        rows.append(
            [
                labels[name],
                f"{run['tokens'] / 1e6:,.1f} M",
                f"{run['tokens_per_s'] / 1e6:,.2f} M",
                f"{limit['tokens_per_s'] / 1e6:,.2f} M" if limit else "",
                f"{run['share_of_limit']:.0%}" if limit else "",
                f"{run['peak_rss_bytes'] / 2**20:,.0f} MiB",
            ]
        )
    head = ["tokenizer, data", "tokens", "tokens/s per worker", "encode_batch alone, same core", "share", "peak RSS"]
    lines = _grid(head, rows)
    reader, ray, ex = r["reader"], r.get("ray"), r["extrapolation"]
    lines += [
        "",
        f"Peak RSS at 4x the data: {r['rss_4x_over_1x']:.2f}x the 1x run (one worker). The training reader "
        f"(seq_len {reader['seq_len']}, global batch {reader['global_batch']}, shuffled windows over the 4x shards): "
        f"{reader['tokens_per_s'] / 1e6:,.1f} M tokens/s on this host, against {reader['per_host_need']:,.0f} per "
        f"host that the 3B step on 16 v5p chips (4 hosts) consumes by the TPU compiler's estimate.",
    ]
    if ray:
        lines += [
            "",
            f"Ray executor (a local `ray start --head`, 2 CPUs, byte 1x): {ray['tokens'] / 1e6:,.1f} M tokens in "
            f"{ray['seconds']:.1f} s wall; manifest "
            f"{'identical to' if ray['manifest_equals_local'] else 'differs from'} the local executor's.",
        ]
    hours = ", ".join(f"{float(h):,.2f} h on {n} workers" for n, h in ex["hours"].items())
    lines += [
        "",
        f"Extrapolated from the BPE rate ({ex['per_worker_tokens_per_s'] / 1e6:.2f} M tokens/s per worker, this text "
        f"and tokenizer), {ex['tokens']:.0e} tokens: {hours}.",
    ]
    return lines


def _cluster(r: dict) -> list[str]:
    labels = {"one_server": "one server, 2 devices", "router": "sglang-router + 2 replicas of 1 device"}
    rows = []
    for setup, workloads in r["setups"].items():
        for workload, m in workloads.items():
            if workload == "guidellm":
                n = m["requests_by_outcome"]
                ok, served, hits, spread = n["successful"], sum(n.values()), "", ""
                workload = f"guidellm {m['guidellm_version']}, {m['streams']} streams"
            else:
                ok, served = m["completed"], m["completed"] + m["failed"]
                hits, spread = f"{m['prefix_hit_rate']:.0%}", " / ".join(f"{n:.0f}" for n in m["finished_per_server"])
            rows.append(
                [
                    labels[setup],
                    workload.replace("_", "-"),
                    f"{ok}/{served}",
                    f"{m['request_throughput']:.2f}",
                    f"{m['output_throughput']:.0f}",
                    _ms(m["ttft_p50_s"]),
                    _ms(m["ttft_p99_s"]),
                    hits,
                    spread,
                ]
            )
    head = ["setup", "workload", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "prefix hits", "per server"]
    burst = r["health_under_burst"]
    worst = ", ".join(f"{s:.2f}" for s in burst["health_max_s"])
    return [
        *_grid(head, rows),
        "",
        f"Prefix-cache hit rate through the router: {r['prefix_hit_rate_router_over_one']:.2f}x one server's "
        f"(prefix-heavy). `/health` with an API key while {burst['bodies_per_burst']} concurrent ~1 MiB bodies "
        f"arrive, slowest answer per burst: {worst} s (statuses {burst['statuses']}).",
    ]


def _speculative(r: dict) -> list[str]:
    head = ["workload", "verify kernel", "same tokens", "plain tok/s", "speculative tok/s", "speedup", "accepted",
            "tokens per verify"]  # fmt: skip
    n = r["new_tokens"]
    rows = [
        [
            m["workload"],
            m["verify_impl"],
            "yes" if m["identical_to_plain"] else "NO",
            f"{n / m['plain_s']:,.0f}",
            f"{n / m['speculative_s']:,.0f}",
            f"{m['speedup']:.2f}x",
            f"{m['acceptance_rate']:.0%}",
            f"{m['tokens_per_verify']:.2f}",
        ]
        for m in r["runs"].values()
    ]
    return [
        *_grid(head, rows),
        "",
        f"{r['config']}, random weights, W={r['width']}, greedy, {n} new tokens, K={r['k']}; medians of paired runs.",
    ]


def _speculative_serve(r: dict) -> list[str]:
    head = ["workload", "W", "plain tok/s", "speculative tok/s", "speedup", "plain ms per token",
            "speculative ms per token", "draft tokens accepted", "tokens from verify steps"]  # fmt: skip
    rows = [
        [
            m["workload"],
            str(m["width"]),
            f"{m['plain_tok_s']:,.0f}",
            f"{m['speculative_tok_s']:,.0f}",
            f"{m['speedup']:.2f}x",
            f"{m['plain_tpot_ms']:.2f}",
            f"{m['speculative_tpot_ms']:.2f}",
            f"{m['acceptance_rate']:.0%}",
            f"{m['verified_share']:.0%}",
        ]
        for m in r["runs"].values()
    ]
    return [
        *_grid(head, rows),
        "",
        f"{r['config']}, random weights, {r['max_tokens']} tokens per request, `{r['speculative_config']}`; "
        f"medians of {r['rounds']} rounds, the speedup round by round; compiles after warmup: "
        f"{r['compiles_after_warmup']}.",
    ]


def _speculative_tpu(*reports: dict) -> list[str]:
    """One verify step against K + 1 plain steps, per verify kernel (one report each), width and
    rollback (the trace a verify keeps)."""
    r0 = reports[0]
    head = ["verify kernel", "W", f"{r0['k'] + 1} plain steps (ms)", "rollback", "verify step (ms)",
            "temporaries (MB)", f"speedup, {r0['k']} of {r0['k']} accepted", "tokens per verify to break even",
            "a model replay would add (ms)"]  # fmt: skip
    rows = [
        [
            f"`{r['verify_impl']}`",
            w,
            f"{m['plain_k1_steps_s'] * 1e3:.2f}",
            f"`{keep}`" + (" (serving)" if keep == r["serving_keeps"] else ""),
            f"{m[keep]['verify_s'] * 1e3:.2f}",
            f"{m[keep]['temporaries_bytes'] / 1e6:,.0f}",
            f"{m[keep]['speedup_all_accepted']:.2f}x",
            f"{m[keep]['break_even_tokens']:.2f}",
            f"{m['model_replay_s'] * 1e3:.2f}",
        ]
        for r in reports
        for w, m in r["widths"].items()
        for keep in ("verify_inputs", "verify_states")
    ]
    return [
        *_grid(head, rows),
        "",
        f"{r0['config']}, {r0['topology']}, K={r0['k']}: {r0['label']}, not a measurement (`auto` compiles the "
        "Pallas TPU chunk kernel, counted at its static schedule or DMA floor). The rollback `verify_inputs` "
        "replays each GLA layer's k, v and gates over the emitted tokens; `verify_states` keeps the state after "
        "every position. The last column is the second pass through the model the rollback replaced.",
    ]


def _structured(r: dict) -> list[str]:
    t = r["throughput"]
    head = ["constraint", "compile (ms)", "automaton states", "device table, 3B vocabulary (MiB)"]
    rows = [
        [name, f"{c['compile_s'] * 1e3:.1f}", f"{c['states']:,}", f"{c['device_bytes_3b_vocab'] / 2**20:.1f}"]
        for name, c in r["constraints"].items()
    ]
    speed = [f"W={r['width']}, {r['new_tokens']} tokens per row", "unconstrained tok/s",
             "JSON schema tok/s (on device)", "vs unconstrained", "bounded schema tok/s (host masks)",
             "vs unconstrained",
             "compiles while serving"]  # fmt: skip
    measured = [r["config"], f"{t['plain_tok_s']:,.0f}", f"{t['json_schema_tok_s']:,.0f}", f"{t['ratio']:.2f}x",
                f"{t['host_json_schema_tok_s']:,.0f}", f"{t['host_ratio']:.2f}x",
                str(t["compiles_while_serving"])]  # fmt: skip
    j = r["jump_forward"]
    names = {
        "json_compact_greedy": "JSON schema, no free whitespace, greedy to its end",
        "json_greedy": "JSON schema, default whitespace, greedy to its end",
        "plain": "unconstrained, sampled, ignore_eos",
    }
    jump_head = [f"W={r['width']}, jump_forward 0 vs {j['jump_forward']}", "output tokens", "forced share",
                 "tok/s off", "tok/s on", "on / off (median of runs)"]  # fmt: skip
    jump_rows = [
        [names[k], f"{j[k]['tokens']:,}", f"{j[k]['forced_share']:.0%}", f"{j[k]['off_tok_s']:,.0f}",
         f"{j[k]['on_tok_s']:,.0f}", f"{j[k]['speedup']:.2f}x"]
        for k in names
    ]  # fmt: skip
    h = r["host_overlap"]
    overlap_head = [f"W={r['width']}, half host-mask rows, half unconstrained", "output tokens",
                    "masks between calls tok/s", "masks during the second call tok/s",
                    "speedup (median of runs)"]  # fmt: skip
    overlap_rows = []
    for k, v in h.items():
        if k.startswith("mask_delay_") and k != "mask_delay_us":
            what = (
                "llguidance's masks"
                if k == "mask_delay_0us"
                else f"each mask {h['mask_delay_us']:,} us slower (simulated)"
            )
            overlap_rows.append([what, f"{v['tokens']:,}", f"{v['between_calls_tok_s']:,.0f}",
                                 f"{v['overlapped_tok_s']:,.0f}", f"{v['speedup']:.2f}x"])  # fmt: skip
    return [
        *_grid(speed, [measured]),
        "",
        f"One host mask (llguidance, the bounded schema, this vocabulary): {r['host_mask_us']:.1f} us (median).",
        "",
        f"Host masks while the device runs (the same engine, two-call steps on and off, side by side run by run; the "
        f"outputs are the same tokens; compiles while serving: {h['compiles_while_serving']}):",
        "",
        *_grid(overlap_head, overlap_rows),
        "",
        *_grid(head, rows),
        "",
        "Jump-forward in the middle of an output (two engines side by side, run by run; the greedy outputs are "
        f"the same tokens in both; compiles while serving: {j['compiles_while_serving']}):",
        "",
        *_grid(jump_head, jump_rows),
    ]


def _structured_tpu(serve: dict, layouts: dict) -> list[str]:
    decode, plain, masked = (
        next(r for r in serve["reports"] if r["program"].startswith(start) and (mask in r["program"]) == want)
        for start, mask, want in (("decode", "mask", False), ("sampler", "mask", False), ("sampler", "mask", True))
    )
    head = ["table layout", "shape", "masked sampler (ms)", "over the plain sampler (ms)", "whole-table copies"]
    rows = [
        [name, " x ".join(map(str, x["shape"])), f"{x['masked_sampler_s'] * 1e3:.3f}", f"{x['over_plain_s'] * 1e3:.3f}",
         str(x["table_copies"])]
        for name, x in layouts["layouts"].items()
    ]  # fmt: skip
    return [
        *_grid(head, rows),
        "",
        f"TPU compiler estimates for {layouts['chip']}, W={layouts['width']}, {layouts['states']:,} table rows, "
        f"vocabulary {layouts['vocab']:,}; plain sampler {layouts['plain_sampler_s'] * 1e3:.3f} ms. Serving (3B, "
        f"{decode['chip']}, the `tiles` layout): `{decode['program']}` {decode['estimate']['seconds'] * 1e3:.2f} ms "
        f"per call with the mask's branch counted; the sampler alone {plain['estimate']['seconds'] * 1e3:.3f} ms "
        f"plain, {masked['estimate']['seconds'] * 1e3:.3f} ms masked.",
    ]


def _auto_tpu(kernel: dict, r: dict) -> list[str]:
    rows = []
    for group, res in (("kernel", kernel), ("decode", r), ("train", r)):
        for row in res["rows"].get(group, []):
            program = row["program"].split(" chunk ")[0] + (
                ", " + row["program"].split(", ")[-1] if group == "kernel" else ""
            )
            if group == "train":
                program = f"{row['config'].removeprefix('configs/')} train step ({row['topology']})"
            mfu = f"{100 * row['mfu']:.1f}%" if "mfu" in row else ""
            share = f"{100 * row['floor_share']:.1f}%" if "floor_share" in row else ""
            rows.append(
                [
                    program.replace("gla(impl=auto)", "gla").replace("mosaic_gla", "gla").replace("chunk_gla", "gla"),
                    row["chip"],
                    f"`{row['attn_impl']}`",
                    ", ".join(k.replace(" (Mosaic)", "") for k in row["gla_kernels"]),
                    _ms(row["estimate_s"]),
                    f"{row['estimate_over_limit']:.1f}x",
                    mfu or share,
                    _gib(row["memory_total"]),
                ]
            )
    head = [
        "program",
        "TPU",
        "attn_impl",
        "GLA kernels in the compiled HLO",
        "estimate",
        "/ limit",
        "MFU or floor share",
        "memory",
    ]
    return [*_grid(head, rows), "", "Every time is the TPU compiler's estimate (its cost model), never a measurement."]


def _xla_kernel_bound(r: dict) -> list[str]:
    """The XLA kernel and its stand-ins (``bench_xla_kernel_bound``): forward and forward + backward."""
    cells = {(row["variant"], row["program"]): row for row in r["rows"]}

    def cell(variant: str, program: str) -> str:
        row = cells[variant, program]
        return f"{_ms(row['estimate_s'])} ({row['estimate_over_limit']:.1f}x)"

    variants = {row["variant"]: row["description"] for row in r["rows"]}  # in the benchmark's order
    rows = [[f"`{v}`: {what}", cell(v, "forward"), cell(v, "forward + backward")] for v, what in variants.items()]
    limit = cells["exact", "forward"]["limit_s"], cells["exact", "forward + backward"]["limit_s"]
    shape = " ".join(f"{k}{v}" for k, v in r["shape"].items())
    return [
        *_grid(["variant", "forward (/ limit)", "forward + backward (/ limit)"], rows),
        "",
        f"TPU compiler estimates for {r['chip']}, one 3B layer ({shape}, chunk {r['chunk']}, bf16, the full "
        f"layout); limits {_ms(limit[0])} and {_ms(limit[1])}. Goals: 8x and 10x. The stand-ins are wrong "
        "numbers, compiled for their cost only.",
    ]


def _tests_cpu(r: dict) -> list[str]:
    total = f"{r['passed']} passed, {r['skipped']} skipped, {r['failed']} failed in {r['wall_s']:,.0f} s"
    rows = [["the whole suite (2 CPU cores, README's command)", total]]
    rows += [[f"`{t['name'].replace('tests.', '', 1)}`", f"{t['seconds']:.1f} s"] for t in r["slowest"][:5]]
    return [*_grid(["tests", "time"], rows), *(["", f"Measured {r['note']}."] if "note" in r else [])]


# ----- BENCHMARKS.md's tables ------------------------------------------------------------------


GLA_ROWS = (
    ("chunk64", "chunk, C=64"),
    ("chunk128", "chunk, C=128"),
    ("chunk256", "chunk, C=256"),
    ("baseline128", "wave 3 kernel (16-row sub-blocks), C=128"),
    ("recurrent", "`recurrent_gla`"),
)


def _gla_cpu(r: dict) -> list[str]:
    base = r["impls"]["baseline128"]
    rows = []
    for impl, label in GLA_ROWS:
        x = r["impls"][impl]
        rows.append(
            [
                label,
                f"{1e3 * x['fwd_s']:,.0f}",
                f"{1e3 * x['fwd_bwd_s']:,.0f}",
                f"{x['fwd_fraction_of_flop_peak']:.1%}",
                f"{x['fwd_bwd_fraction_of_flop_peak']:.1%}",
                f"{x['fwd_bwd_fraction_of_bandwidth']:.1%}",
                f"{x['fwd_bwd_speedup_over_recurrent']:.1f}x",
                f"{base['fwd_s'] / x['fwd_s']:.2f}x / {base['fwd_bwd_s'] / x['fwd_bwd_s']:.2f}x",
            ]
        )
    head = ["implementation", "fwd ms", "f+b ms", "fwd % FLOP peak", "f+b % FLOP peak", "f+b % bandwidth"]
    peaks = (
        f"Peaks in this run: {r['matmul_peak_flops'] / 1e9:.0f} GFLOP/s (2048^3 fp32 matmul) and "
        f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (elementwise copy, read + write)."
    )
    return [*_grid([*head, "f+b vs recurrent", "vs wave 3 (fwd / f+b)"], rows), "", peaks]


PALLAS_KERNELS = ("gla_states", "gla_scores", "gla_out", "gla_dstates", "gla_dscores", "gla_dqkg", "gla_dv")
TILINGS = ((32, 32), (32, 64), (64, 64), (32, 128))  # tools.gpu_check.BLOCKS


def _gpu_static(r: dict) -> list[str]:
    rows = []
    for name in PALLAS_KERNELS:
        k90, k80 = (next(k for k in r["kernels"] if (k["kernel"], k["arch"]) == (name, a)) for a in ("sm_90", "sm_80"))
        mma = "wgmma m64n64k16" if any("wgmma" in m for m in k90["mma"]) else "mma.sync m16n8k16"
        rows.append(
            [
                name,
                " x ".join(map(str, k90["grid"])),
                f"{k90['programs']:,} ({k90['programs_per_sm']:.2f})",
                f"{k90['num_warps']} / {k90['num_stages']}",
                f"{k90['registers']}, {k90['spill_store_bytes']:,} B",
                f"{k80['registers']}, {k80['spill_store_bytes']:,} B",
                f"{k90['shared_bytes'] / 1024:.0f} KiB",
                mma,
                f"{k90['dots'].get('bf16', 0)} / {k90['dots'].get('f32_ieee', 0)}",
            ]
        )
    head = ["kernel", "grid", "programs (per H200 SM)", "warps / stages", "sm_90 registers, spills"]
    head += ["sm_80 registers, spills", "sm_90 shared", "sm_90 MMA", "dots in the IR (bf16 / IEEE fp32)"]
    return _grid(head, rows)


def _gpu_tilings(r: dict) -> list[str]:
    rows = []
    for bk, bv in TILINGS:
        ks = {x["kernel"]: x for x in r["blocks"] if (x["block_k"], x["block_v"]) == (bk, bv)}
        worst = max(ks.values(), key=lambda x: x["spill_store_bytes"])
        spills = f"{worst['spill_store_bytes']:,} B" + (f" ({worst['kernel']})" if worst["spill_store_bytes"] else "")
        regs = " / ".join(str(ks[k]["registers"]) for k in ("gla_out", "gla_dv", "gla_dqkg"))
        rows.append([f"{bk} x {bv}", f"{ks['gla_states']['programs']:,}", spills, regs])
    head = [
        "key x value tile",
        "state-pass programs",
        "spills (worst kernel)",
        "registers: gla_out / gla_dv / gla_dqkg",
    ]
    return _grid(head, rows)


def _decay_sweep(r: dict) -> list[str]:
    def cell(g: dict) -> str:
        return f"{_sci(g['per_element'])} / {_sci(g['summed'])} / {_sci(g['per_channel'])}"

    def others(x: dict) -> str:
        return _sci(max(x[n]["per_element"] for n in ("q", "k", "v", "s0")))

    rows = []
    for decay, row in r["decays"].items():
        x, p, m, b = row["chunk"], row["pallas"], row["mosaic"], row["baseline"]
        rows.append(
            [decay, cell(x["g"]), cell(p["g"]), cell(m["g"]), f"{others(x)} / {others(p)} / {others(m)}", cell(b["g"])]
        )
    head = ["g per token", "dg, XLA", "dg, Pallas GPU", "dg, Pallas TPU", "others", "dg, kernel before (XLA)"]
    return _grid(head, rows)


REMAT_RECOMPUTES = {  # what each policy's backward recomputes (model.remat's definitions)
    "none": "nothing",
    "full": "the whole layer from its input",
    "save_dots": "norms, gates, the GLA kernel, activations",
    "save_gla": "projections, norms, MLP; not the GLA kernel",
}


def _remat_memory(r: dict, standin: dict) -> list[str]:
    rows = [
        [
            p["remat"] + label,
            f"{p['memory']['temporaries'] / GiB:.1f} GiB",
            f"{p['memory']['arguments'] / GiB:.1f} GiB",
            REMAT_RECOMPUTES[p["remat"]],
        ]
        for report, label in ((r, ""), (standin, ", kernel stand-in (its autodiff keeps only its inputs)"))
        for p in report["policies"]
    ]
    return _grid(["`model.remat`", "temporaries", "arguments", "what the backward recomputes"], rows)


def _kernel_memory(now: dict, before: dict) -> list[str]:
    rows = [
        [
            label,
            _gib(r["kernel"]["temporaries_bytes"]),
            _gib(r["kernel"]["inputs_plus_outputs_bytes"]),
            f"{r['kernel']['temporaries_over_io']:.1f}x",
        ]
        for label, r in (("hand-written backward (now)", now), ("autodiff of the forward (before)", before))
    ]
    return _grid(["`jax.grad` of `chunk_gla`", "temporaries", "inputs + outputs", "temporaries / I/O"], rows)


def _remat_time(r: dict) -> list[str]:
    rows = [
        [p["remat"], f"{p['memory']['temporaries'] / GiB:.1f} GiB", f"{p['step_seconds']:.1f} s"] for p in r["policies"]
    ]
    return _grid(["`model.remat`", "temporaries (16 x 2048)", "step time (1 x 2048, CPU)"], rows)


def _train_cpu(r: dict) -> list[str]:
    rows = []
    for name, x in r["runs"].items():
        step = f"{x['step_s']:.2f} s" if x["step_s"] < 10 else f"{x['step_s']:.1f} s"
        rows.append(
            [
                name,
                f"{x['params'] / 1e6:.1f}M",
                f"{x['tokens_per_step']:,}",
                step,
                f"{x['tokens_per_s']:,.0f}",
                f"{100 * x['mfu']:.1f}%",
                f"{x['memory']['total'] / GiB:.2f} GiB",
            ]
        )
    mfu = f"MFU vs measured fp32 matmul ({r['peak_flops'] / 1e9:.0f} GFLOP/s)"
    return _grid(["config", "params", "tokens/step", "step", "tokens/s", mfu, "compiled memory"], rows)


def _first_run(r: dict) -> list[str]:
    minutes, seconds = divmod(round(r["wall_s"]), 60)
    row = [
        r["config"],
        f"{r['steps']:,}",
        f"{minutes} min {seconds} s",
        f"{r['final_train_loss']:.2f}",
        f"**{r['final_eval_loss']:.3f}**",
    ]
    return _grid(["config", "steps", "wall, command to end", "train loss", "eval loss (nats/byte)"], [row])


def _muon(r: dict) -> list[str]:
    rows = []
    for payload, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        x = r[dtype]
        rows.append(
            [
                payload,
                f"{x['all_to_all_ops_per_step']:.0f}",
                f"{x['all_to_all_bytes_per_rank'] / 1e9:.3f} GB",
                f"{x['ideal_all_to_all_bytes_per_rank'] / 1e9:.3f} GB",
                f"{x['gather_baseline_bytes_per_rank'] / 1e9:.3f} GB",
                f"{x['reduction_vs_gather']:.1f}x",
                f"{x['ns_busiest_over_mean']:.3f}",
                f"{x['ns_executed_over_mean']:.3f}",
            ]
        )
    head = ["payload", "all-to-alls / step", "bytes / rank / step (both)", "ideal", "gather-everything baseline"]
    head += ["reduction", "NS FLOPs owned, busiest / mean", "NS FLOPs run per rank / mean"]
    total = f"Newton-Schulz work per step, all ranks together: {_sci(r['float32']['ns_flops_total'])} FLOPs."
    return [*_grid(head, rows), "", total]


def _checkpoint(r: dict) -> list[str]:
    row = [f"{r['bytes_per_device'] / 1e9:.2f} GB"] + [f"{r['median_s'][k]:.2f} s" for k in ("save", "seal", "verify")]
    head = ["bytes per device", "save", "seal", "verify", "seal / save"]
    return _grid(head, [[*row, f"**{100 * r['seal_over_save']:.1f}%**"]])


def _plan_memory(r: dict, concurrent: dict) -> list[str]:
    rows = []
    for label, report in (("memory-ordered (the package's default)", r), ("concurrency-optimized", concurrent)):
        m, hbm = report["memory_per_device"], report["device_memory"]
        total = f"{m['total'] / GiB:.2f} GiB of {hbm / GiB:.0f} GiB ({m['total'] / hbm:.0%})"
        rows.append([label, f"{m['arguments'] / GiB:.2f} GiB", f"{m['temporaries'] / GiB:.2f} GiB", total])
    return _grid(["XLA:CPU scheduler", "arguments", "temporaries", "total"], rows)


def _plan_tpu(r: dict) -> list[str]:
    """One TPU plan's row; the per-chip column compares with the original team's measured figure only
    for a plan of the model they trained (the JSON carries ``seed`` then)."""
    m, run, seed = r["tpu"]["memory"], r["tpu_run"], r.get("seed")
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    wire = sum(r["wire_bytes_per_device"].values())
    per_chip = f"{run['tokens_per_s_per_chip']:,.0f}"
    if seed:
        per_chip += f" ({run['tokens_per_s_per_chip'] / seed['tokens_per_s_per_chip']:.2f}x)"
    row = [
        r["topology"],
        mesh,
        f"{m['total'] / GiB:.2f} GiB of {m['hbm'] / GiB:.0f} GiB",
        f"{wire / 1e9:.2f} GB",
        f"{1e3 * run['step_s']:,.1f} ms",
        f"{run['tokens_per_s']:,.0f}",
        per_chip,
        f"{100 * run['mfu']:.1f}%",
    ]
    head = [
        "topology",
        "mesh",
        "memory per chip",
        "collectives on the wire per chip",
        "step (compiler estimate)",
        "tokens/s",
        "per chip (x the original team's, measured)" if seed else "per chip",
        "MFU",
    ]
    return _grid(head, [row])


PLAN_ROWS = (  # label, collective, JAX source (None: every source), whether the wire bytes are quoted
    ("all-to-all: Muon (shard_map, bf16 payload)", "all-to-all", None, True),
    ("all-gather: weights in bf16 (`gathered`, forward and rematerialised backward)", "all-gather", "weights", False),
    ("all-gather: the embedding table in bf16 (forward)", "all-gather", "embeddings", False),
    ("all-gather: total", "all-gather", None, True),
    ("reduce-scatter: every gradient to its shard, fp32", "reduce-scatter", None, True),
    ("all-reduce: loss, norm gains, gradient norm", "all-reduce", None, True),
)


def _plan_collectives(r: dict) -> list[str]:
    rows = []
    for label, kind, source, wire in PLAN_ROWS:
        x = (
            r["train_step_collectives_by_source"][source][kind]
            if source
            else r["train_step_collectives_per_device"][kind]
        )
        w = f"{r['wire_bytes_per_device'][kind] / 1e9:.3f} GB" if wire else ""
        rows.append([label, f"{x['ops']:.0f}", f"{x['bytes'] / 1e9:.3f} GB", w])
    return _grid(["collective", "ops", "bytes", "wire"], rows)


def _plan_cost(r: dict) -> list[str]:
    c, rows = r["cost"], []
    for label, key in (
        ("roofline, communication overlapped", "overlapped"),
        ("roofline, communication serial", "serial"),
        ("Laplace 3B, original team (measured)", "seed"),
    ):
        x = c[key]
        mfu = x.get("mfu", x["tokens_per_s"] / c["overlapped"]["tokens_per_s"])
        rows.append(
            [
                label,
                f"{x['tokens_per_s']:,.0f}",
                f"{x['step_s']:.2f} s",
                f"{x['days']:.1f}",
                f"{x['instance_hours']:.0f}",
                f"{100 * mfu:.0f}%",
            ]
        )
    line = (
        f"Model FLOPs per token: {_sci(r['flops_per_token'])}; communication at peak: "
        f"{c['comm_over_compute']:.2f} of compute."
    )
    return [*_grid(["", "tokens/s", "step", "days for 100e9 tokens", "instance-hours", "MFU"], rows), "", line]


def _recall_grid(r: dict) -> list[str]:
    """Accuracy per (N pairs, context length); the report's values are its cells."""
    cells = {(c["level"], c["length"]): c["accuracy"] for c in r.values()}
    lengths, levels = sorted({t for _, t in cells}), sorted({n for n, _ in cells})
    rows = [[str(n), *(f"{cells[n, t]:.2f}" if (n, t) in cells else "" for t in lengths)] for n in levels]
    return _grid(["N \\ length", *map(str, lengths)], rows)


def _serve_concurrency(r: dict) -> list[str]:
    ((config, x),) = r["configs"].items()
    fmt = ",.0f" if config == "tiny" else ",.1f"
    rows = [
        [c, f"{v['output_throughput']:{fmt}}", _ms_cell(v["tpot_s"]["median"]), _ms_cell(v["tpot_s"]["p99"])]
        for c, v in x["concurrency"].items()
    ]
    return _grid(["concurrency", "output tok/s", "TPOT p50", "TPOT p99"], rows)


def _serve_context(r: dict) -> list[str]:
    tiny = r["configs"]["tiny"]
    call = tiny["decode_step_vs_context"]
    rows = [
        [
            f"{int(n):,}",
            _ms_cell(v["tpot_median_s"], 2),
            _ms_cell(v["cost_per_output_token_s"], 2),
            _ms_cell(call[n], 2) if n in call else "",
        ]
        for n, v in tiny["context"].items()
        if n.isdigit()
    ]
    head = ["prompt tokens", "TPOT p50 (HTTP)", "cost per output token incl. prefill"]
    head.append("compiled decode call (8 x 4 rows)")
    ratio = call["ratio_8192_vs_128"]
    flat = f"Decode call after 8,192-token prompts over after 128: **{ratio:.2f}x** (target <= 1.05)."
    return [*_grid(head, rows), "", flat]


DECODE_COST_LABELS = {"tiny": "tiny (d 128, 2 layers)", "small_100m": "small_100m (d 768, 14 layers)"}


def _decode_cost(r: dict) -> list[str]:
    rows = []
    for config, x in r["configs"].items():
        this, base = x["this_call_s"], x["baseline_call_s"]
        cells = [_ms_cell(this, 2 if this < 0.1 else 1), _ms_cell(base, 2 if base < 0.1 else 1)]
        rows.append([DECODE_COST_LABELS[config], *cells, f"{x['ratio_median']:.3f}"])
    return _grid(["config", "decode call, this", "before", "ratio (median of 15 rounds)"], rows)


def _prefix_cache(r: dict) -> list[str]:
    rows = []
    for config, v in r["configs"].items():
        x = v["prefix_cache"]
        ttft = [_ms_cell(x[k]["shared_prefix"]["ttft_rest_median_s"]) for k in ("off", "on")]
        runs = [x[k]["no_sharing_output_throughput"] for k in ("off", "on")]
        fmt = ",.0f" if statistics.median(runs[0]) > 1000 else ".1f"
        rates = " / ".join(f"{statistics.median(t):{fmt}}" for t in runs)
        spread = " / ".join(f"{min(t):{fmt}}-{max(t):{fmt}}" for t in runs)
        label = "tiny" if config == "tiny" else "~100M"
        rows.append(
            [label, *ttft, f"**{x['ttft_hit_over_miss']:.3f}**", rates, spread, f"{x['throughput_on_over_off']:.3f}"]
        )
    head = ["model", "TTFT, cache off", "TTFT, cache on (hit)", "hit / miss"]
    head += ["no-sharing output tok/s, off / on (medians of 5)", "spread of the 5 runs, off / on", "on / off"]
    return _grid(head, rows)


def _prefix_turns(r: dict) -> list[str]:
    """The chat's ids per turn; the models must agree (the table says "both models alike")."""
    keys = ("prompt_tokens", "new_tokens", "prefilled_tokens", "restored_tokens")
    per_model = [
        [[t[k] for k in keys] for label in ("off", "on") for t in v["prefix_cache"][label]["multi_turn"]]
        for v in r["configs"].values()
    ]
    if any(m != per_model[0] for m in per_model):
        raise SystemExit("prefix_cache_cpu.json: the models' chat counts differ; the table assumes they agree")
    first = next(iter(r["configs"].values()))["prefix_cache"]
    rows = [
        [
            str(i + 1),
            f"{on['prompt_tokens']:,}",
            f"{on['new_tokens']:,}",
            f"{off['prefilled_tokens']:,.0f}",
            f"{on['prefilled_tokens']:,.0f}",
            f"{on['restored_tokens']:,.0f}",
        ]
        for i, (off, on) in enumerate(zip(first["off"]["multi_turn"], first["on"]["multi_turn"], strict=True))
    ]
    head = ["turn", "prompt ids", "new ids", "prefilled, cache off", "prefilled, cache on", "restored from the cache"]
    return _grid(head, rows)


DECODE_ROWS = (  # file (one of the table's inputs, in order), label, width, bold
    (0, "before wave 3 (fp32 / fp32, state as the layer scan's xs/ys)", 256, False),
    (1, "fp32 / fp32", 256, True),
    (1, "fp32 / fp32", 1, False),
    (2, "bf16 / bf16 (accelerator serving)", 256, True),
    (2, "bf16 / bf16", 1, False),
    (2, "bf16 / bf16", 1024, False),
    (3, "bf16 / fp32", 256, True),
    (4, "fp32 / bf16", 256, True),
    (5, "bf16 / bf16, packed (serving's CPU form)", 256, True),
    (6, "bf16 / bf16, XLA:CPU's default schedule", 256, False),
)
DECODE_FILES = (
    "decode_memory_3b_fp32_before.json",
    "decode_memory_3b_fp32.json",
    "decode_memory_3b_bf16.json",
    "decode_memory_3b_bf16w_fp32c.json",
    "decode_memory_3b_fp32w_bf16c.json",
    "decode_memory_3b_bf16_packed.json",
    "decode_memory_3b_bf16_concurrent_schedule.json",
)


def _decode_memory(*reports: dict) -> list[str]:
    rows = []
    for i, label, width, bold in DECODE_ROWS:
        d = _width(reports[i], width)
        temp = f"{d['temporaries_bytes'] / GiB:.2f} GiB"
        rows.append(
            [
                label,
                f"{width:,}",
                f"**{temp}**" if bold else temp,
                f"{d['weights_bytes'] / 1e9:.2f} GB",
                f"{d['state_bytes'] / 1e9:.2f} GB",
                f"{d['bytes_over_min']:.3f}",
            ]
        )
    return _grid(["weights / compute", "W", "temporaries", "weights", "state", 'XLA "bytes accessed" / minimum'], rows)


AB_KINDS = {"roofline": "compiled decode call, tok/s", "concurrency": "HTTP output tok/s"}


def _serve_ab(r: dict) -> list[str]:
    """Alternating before/now rounds of bench_serve: the median ratio per model, section and width."""
    rows = []
    for name, x in r["rows"].items():
        config, kind, width = name.split()
        cell = f"{x['ratio_median']:.2f}x"
        rows.append([config, AB_KINDS[kind], width, f"**{cell}**" if x["ratio_median"] < 1 else cell])
    ratio = f"now / {r['baseline_commit']} (median of {r['rounds']})"
    return _grid(["config", "measure", "rows / concurrency", ratio], rows)


SAMPLER_ROWS = (  # report (0: now, 1: before), key type (0: threefry, 1: rbg), label, keys, bold share
    (0, 0, "1,024 candidates' top-k, a draw by block (now)", "threefry2x32", True),
    (0, 1, "1,024 candidates' top-k, one categorical (now)", "rbg (Neuron)", True),
    (1, 0, "full sort of every row (before; `sampler_3b_before.json`)", "threefry2x32", False),
    (1, 1, "full sort of every row (before)", "rbg", False),
)


def _sampler(*reports: dict) -> list[str]:
    rows = []
    for which, i, label, keys, bold in SAMPLER_ROWS:
        x = reports[which]["sampler"][i]
        share = f"{100 * x['share_of_bytes']:.1f}%"
        bytes_ = f"{x['sampler_bytes_accessed'] / 1e9:.3f} GB"
        rows.append([label, keys, bytes_, f"**{share}**" if bold else share, f"{100 * x['share_of_flops']:.2f}%"])
    return _grid(["sampler", "keys", "bytes accessed", "share of bytes", "share of FLOPs"], rows)


def _sampler_ab(r: dict) -> list[str]:
    rows = []
    for key, now in r["now_s"].items():
        kind, width = key.rsplit(" W=", 1)
        before = r["before_s"][key]
        rows.append([kind, width, f"{1e3 * before:,.2f}", f"{1e3 * now:,.2f}", f"{r['speedup'][key]:.2f}x"])
    lines = _grid(["requests (every row)", "W", f"before ({r['baseline']}), ms", "now, ms", "speedup"], rows)
    note = f"`sample_rows` alone on {r['device']}, {r['vocab']:,} logits per row; medians of {r['calls']} calls"
    return [*lines, "", f"{note}, {r['rounds']} alternating rounds, the speedup the median of the rounds' ratios."]


def _roofline(one: dict, eight: dict) -> list[str]:
    def cells(buckets: dict) -> list[str]:
        return [
            " / ".join(f"{b['tokens_per_s']:,.0f}" for b in buckets.values()),
            " / ".join(f"{b['fraction_of_bandwidth']:.1%}" for b in buckets.values()),
        ]

    rows = [
        ["~100M, 1", w, f"{b['tokens_per_s']:,.0f}", f"{b['fraction_of_bandwidth']:.1%}"]
        for w, b in one["configs"]["small_100m"]["roofline"]["buckets"].items()
    ]
    tiny = one["configs"]["tiny"]["roofline"]["buckets"]
    rows.append(["tiny, 1", " / ".join(tiny), *cells(tiny)])
    tiny8 = eight["configs"]["tiny"]["roofline"]["buckets"]
    rows.append(["tiny, 8 fake", " / ".join(tiny8), *cells(tiny8)])
    return _grid(["model, devices", "W per device", "decode tok/s", "fraction of the roofline"], rows)


def _http_8dev(r: dict) -> list[str]:
    c = r["configs"]["tiny"]["concurrency"]
    rows = [
        ["output tok/s", *(f"{v['output_throughput']:,.0f}" for v in c.values())],
        ["TPOT p50", *(_ms_cell(v["tpot_s"]["median"]) for v in c.values())],
    ]
    return _grid(["concurrency", *c], rows)


def _soak(base: dict, long: dict, nocache: dict, before: dict) -> list[str]:
    def rss(r: dict) -> str:
        return f"{r['rss_growth_mb']:.1f} MB ({r['rss_before_mb']:.1f} -> {r['rss_after_mb']:.1f} MB)"

    o = base["outcomes"]
    counts = f"{o['valid:ok']:,} / {o['disconnect:disconnected']:,} / {o['invalid:refused']:,}"
    sent = base["requests"]
    rows = [
        ["requests (valid / disconnecting / invalid)", counts],
        ["outcomes as expected (finished / left mid-stream / refused with a 4xx envelope)", counts],
        ["errors by kind (5xx, wrong 4xx, streams without `[DONE]`, transport errors)", f"{base['errors_total']:,}"],
        ["leaked slots after the run (`laplace:num_requests_running`)", f"{base['leaked_slots']:.0f}"],
        ["compiles after warmup (JAX events, phase `serving`)", f"{base['compiles_after_warmup']:,}"],
        ["engine restarts", f"{base['engine_restarts']:.0f}"],
        [f"server RSS growth over {sent:,} requests", rss(base)],
        [
            "prefix-cache bytes held at the end (states + 4 KiB per entry)",
            f"{base['prefix_cache_bytes_after'] / 1e6:.1f} MB",
        ],
        [f"server RSS growth over {long['requests']:,} requests (second run)", rss(long)],
        ["prefix-cache bytes held at the end of that run", f"{long['prefix_cache_bytes_after'] / 1e6:.1f} MB"],
        [f"server RSS growth over {nocache['requests']:,} requests, `--prefix-cache-bytes 0`", rss(nocache)],
        [f"the same before the serving features (no prefix cache; {before['requests']:,} requests)", rss(before)],
        ["wall time", f"{base['duration_s']:.1f} s"],
    ]
    return _grid(["measure", "result"], rows)


def _compile_share(r: dict) -> list[str]:
    rows = []
    for mode, label in (("pow2", "pow2 buckets"), ("exact", "exact (compile per new width)")):
        x = r["configs"]["tiny"]["compile_share"][mode]
        share = f"{100 * x['compile_share_of_decode_time']:.1f}%"
        rows.append([label, f"{x['serving_compiles']:.0f}", share, _ms_cell(x["tpot_p99_s"])])
    ready = r["configs"]["tiny"]["time_to_ready"]
    line = f"Time to ready: cold (empty `--compile-cache-dir`) {ready['cold']:.1f} s, warm {ready['warm']:.1f} s."
    return [*_grid(["decode widths", "serving compiles", "share of decode time compiling", "TPOT p99"], rows), "", line]


NUMERICS_ROWS = (  # label, report key, whether the argmax agreement is quoted
    ("bf16 compute, jit vs op-by-op, RMS relative error (argmax agreement)", "jit_vs_eager_bf16", True),
    ("fp32 compute, jit vs op-by-op", "jit_vs_eager", False),
    ("fp32 vs bf16 compute (argmax agreement)", "fp32_vs_bf16", True),
    ("chunked vs recurrent, fp32", "chunk_vs_recurrent", False),
)


def _numerics_exact(default: dict, exact: dict) -> list[str]:
    def cell(x: dict, with_argmax: bool) -> str:
        err = "**0.0**" if x["rms_rel"] == 0 else _sci(x["rms_rel"])
        agree = "100%" if x["argmax_agree"] == 1 else f"{x['argmax_agree']:.1%}"
        return f"{err} ({agree})" if with_argmax else err

    def greedy(r: dict) -> str:
        g = r["greedy_fp32_vs_bf16"]
        return "all agree" if g["agree"] == 1 else f"{round(g['agree'] * g['steps'])} of {g['steps']} agree"

    rows = [[label, cell(default[k], a), cell(exact[k], a)] for label, k, a in NUMERICS_ROWS]
    steps = default["greedy_fp32_vs_bf16"]["steps"]
    rows.append([f"greedy decode, fp32 vs bf16, {steps} tokens", greedy(default), greedy(exact)])
    for dtype, name in (("float32", "fp32"), ("bfloat16", "bf16")):
        speed = [f"{r['forward_tokens_per_s'][dtype] / 1e3:.1f}k" for r in (default, exact)]
        rows.append([f"forward tokens/s, {name} (median of 5; one process each)", *speed])
    return _grid(["", "default", "`--exact`"], rows)


TOLERANCES = (  # comparison, the bound its test asserts, the measured cell (None: "passes", nothing stored)
    (
        "`chunk_gla` (XLA kernel), the Pallas GPU and TPU kernels and `recurrent_gla` (fp32) vs the float64 "
        "recurrence, T in {1, 100, 128, 300, 2048} (Pallas, interpreted: {100, 128, 2048}), weak and strong decay "
        "(per-token log-decay down to -50), with and without an initial state",
        "max abs error <= 1e-4 x max abs output",
        "forward",
    ),
    (
        "gradients of the three kernels (hand-written backwards: dq, dk, dv, dg, d initial state; output "
        "and final-state cotangents) vs the float64 reverse-time gradient, T=150",
        "same bound",
        "gradients",
    ),
    (
        "gate gradient across decays: all five gradients of the three kernels vs float64 torch autograd, per-token "
        "log-decay -0.01, -0.1, -1, -4, -8, -16 and mixed per channel, T=150",
        "per element <= 2e-6, summed over positions <= 1e-5, dg per channel <= 2e-6",
        "decays",
    ),
    (
        "whole 2-layer model, gate normalizer 1 and gate bias -4 (~4 nats/token), every parameter's gradient vs "
        "float64 torch autograd",
        "2e-5 relative",
        None,
    ),
    ("same gradients vs `jax.grad` of `recurrent_gla`, fp32, T=300", "same bound", "vs_recurrent"),
    (
        "Pallas kernels vs XLA kernel: chunk sizes 16/64/256, odd K and V (padding), edge shapes (T=1, one "
        "sub-block per chunk, partial tiles, K96/V192 and K128/V256 at chunk 128: outputs and all five "
        "gradients), whole model logits and gradients under `jit`; the GPU kernel's value tiles",
        "1e-4 x max abs output; model gradients 1e-4 relative + 1e-5 x max",
        None,
    ),
    (
        "gradients of a 2-layer model under each `model.remat` policy vs `none`",
        "1e-4 relative + 1e-5 x max abs gradient",
        None,
    ),
    (
        "whole model vs PyTorch reference loaded through `convert` (short conv on/off, GQA on/off, T=150)",
        "elementwise 1e-4 x (abs ref + max abs ref)",
        None,
    ),
    ("prefill + N decode steps vs one forward pass, fp32", "1e-5 x max abs logit", None),
    (
        "each kernel with bf16 inputs vs fp32: output, and gradients (worst of dq, dk, dv, dg)",
        "RMS relative error < 2e-2",
        "bf16_kernel",
    ),
    ("bf16 compute vs fp32 compute, logits of a random 2-layer model", "RMS relative error < 3e-2", "bf16_model"),
    ("fla export -> import", "bit-exact", None),
    ("numerics report, fp32: jitted vs op-by-op (`jax.disable_jit`)", "RMS relative error <= 1e-5", "report_fp32"),
    (
        "numerics report, bf16 compute: jitted vs op-by-op",
        "RMS relative error <= 3e-2; with `--exact` <= 1e-6",
        "report_bf16",
    ),
    ("greedy decode, fp32 vs bf16 compute, trained model", "not bounded: bf16 may flip a near-tie argmax", "greedy"),
)


def _tolerances(kernels: dict, sweep: dict, default: dict, exact: dict) -> list[str]:
    """docs/kernels.md's table: each tested bound beside the figure measured for it ("passes" where the
    test is the measurement and nothing is stored)."""
    fwd, grads, bf16 = kernels["forward_max_rel"], kernels["gradients_max_rel"], kernels["bf16_rms_rel"]

    def span(kernel: str) -> str:
        return f"{_sci(grads[kernel]['vs_float64_min'])} to {_sci(grads[kernel]['vs_float64_max'])}"

    def vs_recurrent(kernel: str) -> str:
        return _sci(grads[kernel]["vs_jax_grad_recurrent_max"])

    worst = _sweep_worst(sweep, ("per_element", "summed", "per_channel"))
    greedy = default["greedy_fp32_vs_bf16"]
    measured = {
        "forward": f"<= {_sci(fwd['chunk'])} (XLA), <= {_sci(fwd['pallas'])} (Pallas GPU, interpreted), "
        f"<= {_sci(fwd['mosaic'])} (Pallas TPU, interpreted), <= {_sci(fwd['recurrent'])} (recurrent); "
        "outputs and final states",
        "gradients": f"{span('chunk')} (XLA), {span('pallas')} (Pallas GPU), {span('mosaic')} (Pallas TPU)",
        "decays": f"worst {_sci(worst)} over the decays and the three kernels (BENCHMARKS.md, `bench_decay_sweep`)",
        "vs_recurrent": f"<= {vs_recurrent('chunk')} (XLA), <= {vs_recurrent('pallas')} (Pallas GPU), "
        f"<= {vs_recurrent('mosaic')} (Pallas TPU)",
        "bf16_kernel": f"{_sci(bf16['kernel_chunk'])} (XLA), {_sci(bf16['kernel_pallas'])} (Pallas GPU), "
        f"{_sci(bf16['kernel_mosaic'])} (Pallas TPU); gradients {_sci(bf16['gradients_chunk'])} (XLA), "
        f"{_sci(bf16['gradients_pallas'])} (Pallas GPU), {_sci(bf16['gradients_mosaic'])} (Pallas TPU)",
        "bf16_model": _sci(bf16["model_logits"]),
        "report_fp32": _sci(default["jit_vs_eager"]["rms_rel"]),
        "report_bf16": f"{_sci(default['jit_vs_eager_bf16']['rms_rel'])}; with `--exact` "
        f"{exact['jit_vs_eager_bf16']['rms_rel']:.1f}",
        "greedy": f"{round(greedy['agree'] * greedy['steps'])} of {greedy['steps']} tokens agree",
    }
    rows = [[c, bound, "passes" if key is None else measured[key]] for c, bound, key in TOLERANCES]
    return _grid(["comparison", "bound (tested)", "measured"], rows)


# name -> (JSON files under benchmarks/results, renderer taking their contents in that order)
TABLES: dict[str, tuple[tuple[str, ...], Callable[..., list[str]]]] = {
    "headlines": (
        (
            "first_run_tiny.json",
            "decay_sweep.json",
            "tpu_programs.json",
            "auto_tpu.json",
            "decode_memory_3b_bf16.json",
            "muon_3b.json",
        ),
        _headlines,
    ),
    "gla_cpu": (("gla_cpu.json",), _gla_cpu),
    "gpu_static": (("gpu_static_3b.json",), _gpu_static),
    "gpu_tilings": (("gpu_static_3b.json",), _gpu_tilings),
    "decay_sweep": (("decay_sweep.json",), _decay_sweep),
    "kernel_memory": (("memory_kernel_3b_layer.json", "memory_kernel_3b_layer_autodiff.json"), _kernel_memory),
    "remat_memory_340m": (("memory_step_340m.json", "memory_step_340m_standin.json"), _remat_memory),
    "remat_time_100m": (("memory_step_100m.json",), _remat_time),
    "train_cpu": (("train_cpu.json",), _train_cpu),
    "first_run": (("first_run_tiny.json",), _first_run),
    "muon_3b": (("muon_3b.json",), _muon),
    "checkpoint_3b": (("checkpoint_3b.json",), _checkpoint),
    "plan_memory": (("plan_3b.json", "plan_3b_concurrent_schedule.json"), _plan_memory),
    "plan_collectives": (("plan_3b.json",), _plan_collectives),
    "plan_cost": (("plan_3b.json",), _plan_cost),
    "plan_3b_32k_tpu": (("plan_3b_32k_tpu.json",), _plan_tpu),
    "plan_340m_tpu": (("plan_340m_tpu.json",), _plan_tpu),
    "recall_1x": (("recall_mqar_1x.json",), _recall_grid),
    "recall_4x": (("recall_mqar_4x.json",), _recall_grid),
    "recall_1x_context4": (("recall_mqar_1x_1k_context4.json",), _recall_grid),
    "serve_tiny_concurrency": (("serve_cpu_tiny.json",), _serve_concurrency),
    "serve_tiny_context": (("serve_cpu_tiny.json",), _serve_context),
    "decode_cost": (("decode_cost.json",), _decode_cost),
    "decode_cost_prefix": (("decode_cost_prefix.json",), _decode_cost),
    "prefix_cache": (("prefix_cache_cpu.json",), _prefix_cache),
    "prefix_turns": (("prefix_cache_cpu.json",), _prefix_turns),
    "decode_memory": (DECODE_FILES, _decode_memory),
    "serve_unrolled_ab": (("serve_cpu_unrolled_decode_ab.json",), _serve_ab),
    "sampler": (("sampler_3b.json", "sampler_3b_before.json"), _sampler),
    "sampler_cpu_ab": (("sampler_cpu_ab.json",), _sampler_ab),
    "sampler_draw_cpu_ab": (("sampler_draw_cpu_ab.json",), _sampler_ab),
    "sampler_layout_cpu_ab": (("sampler_layout_cpu_ab.json",), _sampler_ab),
    "roofline": (("serve_cpu_roofline.json", "serve_cpu_8dev.json"), _roofline),
    "http_8dev": (("serve_cpu_8dev.json",), _http_8dev),
    "soak": (
        ("soak_cpu_tiny.json", "soak_cpu_tiny_6000.json", "soak_cpu_tiny_nocache.json", "soak_cpu_tiny_before.json"),
        _soak,
    ),
    "serve_100m_concurrency": (("serve_cpu_100m.json",), _serve_concurrency),
    "compile_share": (("serve_cpu_tiny.json",), _compile_share),
    "import_memory": (("import_memory.json",), _import_memory),
    "tests_cpu": (("tests_cpu.json",), _tests_cpu),
    "prepare": (("prepare_cpu.json",), _prepare),
    "cluster": (("cluster_cpu.json",), _cluster),
    "speculative": (("speculative_cpu.json",), _speculative),
    "speculative_serve": (("speculative_serve_cpu.json",), _speculative_serve),
    "speculative_tpu": (("speculative_tpu.json", "speculative_tpu_auto.json"), _speculative_tpu),
    "structured": (("structured_cpu.json",), _structured),
    "structured_tpu": (("structured_tpu.json", "structured_tpu_layouts.json"), _structured_tpu),
    "structured_ab": (("serve_cpu_structured_ab.json",), _serve_ab),
    "speculation_ab": (("serve_cpu_speculation_ab.json",), _serve_ab),
    "auto_tpu": (("auto_tpu_kernel.json", "auto_tpu.json"), _auto_tpu),
    "tolerances": (
        ("numerics_kernels.json", "decay_sweep.json", "numerics_recall_1x.json", "numerics_recall_1x_exact.json"),
        _tolerances,
    ),
    "numerics_exact": (("numerics_recall_1x.json", "numerics_recall_1x_exact.json"), _numerics_exact),
    "tpu_programs": (("tpu_programs.json",), _tpu_programs),
    "tpu_decode": (("tpu_decode.json",), _tpu_programs),
    "tpu_train": (("tpu_programs.json",), _tpu_train),
    "tpu_sources": (("tpu_programs.json",), _tpu_sources),
    "tpu_prefill": (("tpu_programs.json",), _tpu_prefill),
    "decode_one_row": (("decode_w1_tpu.json", "decode_w1_tpu_before.json"), _decode_one_row),
    "tpu_calibration": (("tpu_calibration.json",), _tpu_calibration),
    "tpu_remat": (("tpu_remat.json",), _tpu_remat),
    "tpu_before_after": (("tpu_programs.json", "tpu_baseline.json"), _tpu_before_after),
    "context_plans": (("context_plans.json",), _context_plans),
    "context_plans_tpu": (("context_plans_tpu.json",), _context_plans),
    "context_kernel_tpu": (("context_plans_tpu.json",), _context_kernel_tpu),
    "hybrid_recall": (("hybrid_recall.json",), _hybrid_recall),
    "attention_tpu": (("attention_tpu.json",), _attention_tpu),
    "xla_kernel_bound": (("xla_kernel_bound.json",), _xla_kernel_bound),
}
# The command of a result file that does not record its own.
COMMANDS = {
    "gpu_static_3b.json": "python -m laplace_jax.tools.gpu_check --shape 3b --sweep --blocks --out "
    "benchmarks/results/gpu_static_3b.json",
    "serve_cpu_100m.json": "python -m benchmarks.bench_serve --configs small_100m --out "
    "benchmarks/results/serve_cpu_100m.json",
    "numerics_recall_1x.json": "python -m laplace_jax.eval numerics --checkpoint runs/recall_1x",
    "numerics_recall_1x_exact.json": "python -m laplace_jax.eval numerics --checkpoint runs/recall_1x --exact",
    "plan_340m_tpu.json": "python train.py --config configs/gla_340m.py --config.data.global_batch=16 "
    "--config.model.dtype=bfloat16 --plan --topology v5e:2x2 --json > benchmarks/results/plan_340m_tpu.json",
    "plan_3b.json": "python train.py --config configs/3b.py --plan --json > benchmarks/results/plan_3b.json",
    "plan_3b_concurrent_schedule.json": "XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=true python "
    "train.py --config configs/3b.py --plan --json > benchmarks/results/plan_3b_concurrent_schedule.json",
    "recall_mqar_1x_1k_context4.json": "python -m laplace_jax.eval recall --checkpoint runs/1x_1k_context4 --suite "
    "mqar --lengths 128 256 512 1024 2048 4096 8192 --levels 1 2 4 8 16 32 64 128 256 --samples 16",
    **{
        f"recall_mqar_{v}.json": "python -m laplace_jax.eval recall --checkpoint runs/recall_1x runs/recall_4x "
        "--suite mqar --lengths 128 256 512 1024 2048 4096 8192 --levels 1 2 4 8 16 32 64 128 256 --samples 16"
        for v in ("1x", "4x")
    },
}
BLOCK = re.compile(r"(<!-- table:([\w\-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


def render(name: str, load: Callable[[str], dict]) -> str:
    """Table ``name`` as markdown, with its source JSON files and their commands under it; ``load``
    reads one result file by name."""
    files, fn = TABLES[name]
    datas = [load(file) for file in files]
    lines = fn(*datas)
    pairs = zip(files, datas, strict=True)
    sources = "; ".join(f"`{RESULTS}/{file}`, written by `{d.get('command') or COMMANDS[file]}`" for file, d in pairs)
    lines += ["", f"From {sources}."]
    return "\n".join(lines) + "\n"


def regenerate(root: str = ".") -> dict[str, str]:
    """{doc: new text} for every doc whose generated tables differ from their JSON (each JSON read once)."""

    @functools.cache
    def load(file: str) -> dict:
        with open(os.path.join(root, RESULTS, file)) as f:
            return json.load(f)

    changed = {}
    for doc in DOCS:
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()

        unknown = [m.group(2) for m in BLOCK.finditer(text) if m.group(2) not in TABLES]
        if unknown:
            raise SystemExit(f"{doc}: no table named {unknown[0]!r} (known: {', '.join(TABLES)})")
        new = BLOCK.sub(lambda m: m.group(1) + render(m.group(2), load) + m.group(4), text)
        if new != text:
            changed[doc] = new
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report docs whose tables differ from their JSON")
    a = ap.parse_args(argv)
    changed = regenerate()
    for doc, text in changed.items():
        if a.check:
            print(f"{doc}: a generated table differs from its JSON (run python -m benchmarks.tables)")
        else:
            with open(doc, "w") as f:
                f.write(text)
            print(f"rewrote the tables in {doc}")
    return 1 if a.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
