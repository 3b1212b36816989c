"""Check that figures quoted in README.md, BENCHMARKS.md and docs/ are the ones in their committed JSON.

    python -m benchmarks.check_figures              # exit 1 and list every mismatch
    python -m benchmarks.check_figures --uncovered  # also list numbers with a unit no claim backs

Each claim names a document, a JSON file under ``benchmarks/results/`` and how the quoted text
is formatted from it; the check passes when that exact text appears in the document. A figure
re-measured without updating the document (or the other way round) fails here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

from benchmarks import tables
from benchmarks.not_measured import NOT_MEASURED
from benchmarks.tables import GiB, _ms_cell, _sci, _width

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVELOPMENT = "docs/development.md"
MODEL = "docs/model.md"
KERNELS = "docs/kernels.md"
TRAINING = "docs/training.md"
SERVING = "docs/serving.md"
ACCELERATORS = "docs/accelerators.md"
EVALUATION = "docs/evaluation.md"
# every document whose prose figures are checked (uncovered: each must be claimed or declared)
DOCUMENTS = ("README.md", "BENCHMARKS.md", DEVELOPMENT, MODEL, KERNELS, TRAINING, SERVING, ACCELERATORS, EVALUATION)


def _pol(r: dict, name: str) -> dict:
    return next(p for p in r["policies"] if p["remat"] == name)


def _policy(name: str) -> Callable[[dict], str]:
    return lambda r: f"{_pol(r, name)['memory']['temporaries'] / GiB:.1f} GiB"


def _decode(width: int) -> Callable[[dict], str]:
    return lambda r: f"{_width(r, width)['temporaries_bytes'] / GiB:.2f} GiB"


def _state(r: dict, width: int) -> str:
    return f"{_width(r, width)['state_bytes'] / 1e9:.2f} GB"


_VS_RECURRENT = "vs_jax_grad_recurrent_max"


def _kernel_memory(r: dict, sep: str) -> str:
    """ "11.0 GiB (29x" / "11.0 GiB, 29x": a kernel report's temporaries and their ratio to I/O."""
    return f"{r['kernel']['temporaries_bytes'] / GiB:.1f} GiB{sep}{r['kernel']['temporaries_over_io']:.0f}x"


def _grads(r: dict, kernel: str) -> dict:
    return r["gradients_max_rel"][kernel]


def _grad_range(r: dict, kernel: str, name: str) -> str:
    g = _grads(r, kernel)
    return f"{_sci(g['vs_float64_min'])} to {_sci(g['vs_float64_max'])} ({name})"


def _sweep(r: dict, kernel: str, warps: int, stages: int) -> int:
    """Spill bytes of one kernel under one launch setting of the static report's sweep."""
    rows = r["sweep"]
    return next(x for x in rows if (x["kernel"], x["num_warps"], x["num_stages"]) == (kernel, warps, stages))[
        "spill_store_bytes"
    ]


def _fewest_programs(r: dict) -> str:
    """The smallest launch of the static report: "at least 576 programs (4.36 per SM"."""
    k = min((k for k in r["kernels"] if k["arch"] == "sm_90"), key=lambda k: k["programs"])
    return f"at least {k['programs']:,} programs ({k['programs_per_sm']:.2f} per SM"


def _k(r: dict, dtype: str) -> str:
    """A numerics report's forward speed in thousands of tokens per second: "37.8k"."""
    return f"{r['forward_tokens_per_s'][dtype] / 1e3:.1f}k"


def _held(r: dict) -> str:
    """A soak's prefix-cache bytes at the end: "30.3 MB"."""
    return f"{r['prefix_cache_bytes_after'] / 1e6:.1f} MB"


def _coll(r: dict, kind: str) -> float:
    return r["train_step_collectives_per_device"][kind]["bytes"]


# (document, JSON file, formatter of the quoted text)
CLAIMS: list[tuple[str, str, Callable[[dict], str]]] = [
    ("BENCHMARKS.md", "memory_kernel_3b_layer.json", lambda r: f"{r['kernel']['temporaries_bytes'] / GiB:.2f} GiB"),
    (KERNELS, "memory_kernel_3b_layer.json", lambda r: f"{r['kernel']['temporaries_bytes'] / GiB:.2f} GiB"),
    (KERNELS, "memory_kernel_3b_layer.json", lambda r: f"{r['kernel']['temporaries_over_io']:.1f}x"),
    (KERNELS, "memory_step_340m.json", _policy("none")),
    (KERNELS, "memory_step_340m.json", _policy("full")),
    (KERNELS, "memory_step_340m.json", _policy("save_dots")),
    (KERNELS, "memory_step_340m.json", _policy("save_gla")),
    ("BENCHMARKS.md", "gla_cpu.json", lambda r: f"{r['impls']['chunk128']['fwd_bwd_speedup_over_recurrent']:.1f}x"),
    ("BENCHMARKS.md", "gla_cpu.json", lambda r: f"{r['matmul_peak_flops'] / 1e9:.0f} GFLOP/s"),
    (MODEL, "import_memory.json", lambda r: f"{r['overhead_over_largest_shard']:.2f}x the largest shard"),
    (TRAINING, "checkpoint_3b.json", lambda r: f"takes {100 * r['seal_over_save']:.1f}% of the time"),
    ("BENCHMARKS.md", "plan_3b.json", lambda r: f"chunk FLOPs = {r['flops_per_token']:.2e}".replace("e+", "e")),
    (KERNELS, "memory_kernel_3b_layer_autodiff.json", lambda r: f"needed {_kernel_memory(r, ' (')})"),
    ("BENCHMARKS.md", "memory_kernel_3b_layer_autodiff.json", lambda r: f"before: {_kernel_memory(r, ', ')})"),
    (SERVING, "sampler_3b.json", lambda r: f"{100 * r['sampler'][0]['share_of_bytes']:.1f}% of the decode step"),
    (TRAINING, "muon_3b.json", lambda r: f"{r['float32']['ns_executed_over_mean']:.3f}x the mean NS FLOPs"),
    (SERVING, "decode_memory_3b_bf16.json", _decode(256)),
    (SERVING, "decode_memory_3b_fp32.json", _decode(256)),
    (TRAINING, "plan_3b.json", lambda r: f"{r['memory_per_device']['total'] / GiB:.2f} GiB of 24 GiB"),
    (
        "BENCHMARKS.md",
        "plan_3b_concurrent_schedule.json",
        lambda r: f"temporaries are {r['memory_per_device']['temporaries'] / GiB:.2f} GiB again",
    ),
    (
        "BENCHMARKS.md",
        "plan_3b_concurrent_schedule.json",
        lambda r: f"{r['memory_per_device']['temporaries'] / GiB:.2f} GiB before\nthe package set",
    ),
    ("BENCHMARKS.md", "plan_3b.json", lambda r: f"{100 * r['cost']['seed']['mfu']:.0f}% MFU"),
    (TRAINING, "plan_3b.json", lambda r: f"{_coll(r, 'all-gather') / 1e9:.2f} GB of all-gather"),
    (KERNELS, "numerics_kernels.json", lambda r: f"<= {_sci(r['forward_max_rel']['chunk'])} (XLA)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"<= {_sci(r['forward_max_rel']['pallas'])} (Pallas, interp"),
    (KERNELS, "numerics_kernels.json", lambda r: f"<= {_sci(r['forward_max_rel']['recurrent'])} (recurrent)"),
    (KERNELS, "numerics_kernels.json", lambda r: _grad_range(r, "chunk", "XLA")),
    (KERNELS, "numerics_kernels.json", lambda r: _grad_range(r, "pallas", "Pallas")),
    (KERNELS, "numerics_kernels.json", lambda r: f"<= {_sci(_grads(r, 'chunk')[_VS_RECURRENT])} (XLA)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"<= {_sci(_grads(r, 'pallas')[_VS_RECURRENT])} (Pallas)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"{_sci(r['bf16_rms_rel']['kernel_chunk'])} (XLA)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"{_sci(r['bf16_rms_rel']['kernel_pallas'])} (Pallas)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"{_sci(r['bf16_rms_rel']['gradients_chunk'])} (XLA grads)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"{_sci(r['bf16_rms_rel']['gradients_pallas'])} (Pallas grads)"),
    (KERNELS, "numerics_kernels.json", lambda r: f"< 3e-2 | {_sci(r['bf16_rms_rel']['model_logits'])} |"),
    (
        "BENCHMARKS.md",
        "serve_cpu_8dev.json",
        lambda r: f"{r['configs']['tiny']['concurrency']['32']['output_throughput']:,.0f}",
    ),
    ("BENCHMARKS.md", "soak_cpu_tiny.json", lambda r: f"{r['requests']:,} requests"),
    (
        "BENCHMARKS.md",
        "soak_cpu_tiny_before.json",
        lambda r: f"against {r['rss_growth_mb']:.1f} MB before the\nserving",
    ),
    ("BENCHMARKS.md", "soak_cpu_tiny_nocache.json", lambda r: f"the growth is {r['rss_growth_mb']:.1f} MB over"),
    (
        "BENCHMARKS.md",
        "soak_cpu_tiny.json",
        lambda r: f"({_held(r)}\nheld for {r['rss_growth_mb']:.1f} MB of growth",
    ),
    ("BENCHMARKS.md", "soak_cpu_tiny_6000.json", lambda r: f"{_held(r)} for {r['rss_growth_mb']:.1f} MB over 6,000"),
    ("BENCHMARKS.md", "numerics_recall_1x.json", lambda r: f"fp32 {_k(r, 'float32')} tok/s default"),
    ("BENCHMARKS.md", "numerics_recall_1x_exact.json", lambda r: f"{_k(r, 'float32')} with `--exact`"),
    ("BENCHMARKS.md", "numerics_recall_1x.json", lambda r: f"bf16 {_k(r, 'bfloat16')} default"),
    ("BENCHMARKS.md", "numerics_recall_1x_exact.json", lambda r: f"{_k(r, 'bfloat16')} exact"),
    ("README.md", "first_run_tiny.json", lambda r: f"Eval loss ends near {r['final_eval_loss']:.2f}"),
    ("BENCHMARKS.md", "first_run_tiny.json", lambda r: f"eval loss **{r['final_eval_loss']:.3f} nats/byte**"),
    (
        "BENCHMARKS.md",
        "first_run_tiny.json",
        lambda r: f"took {int(r['wall_s'] // 60)} min {round(r['wall_s'] % 60)} s wall",
    ),
    ("BENCHMARKS.md", "gpu_static_3b.json", _fewest_programs),
    ("BENCHMARKS.md", "gpu_static_3b.json", lambda r: f"(4 warps spill {_sweep(r, 'gla_dqkg', 4, 2):,} B\nat 2 and 3"),
    (
        "BENCHMARKS.md",
        "serve_cpu_tiny.json",
        lambda r: f"**{r['configs']['tiny']['decode_step_vs_context']['ratio_8192_vs_128']:.2f}x**",
    ),
    (
        "BENCHMARKS.md",
        "serve_cpu_tiny.json",
        lambda r: f"cold (empty `--compile-cache-dir`) {r['configs']['tiny']['time_to_ready']['cold']:.1f} s",
    ),
]


def _roof_cells(r: dict, config: str) -> str:
    """ "2,166 / 5,084 / 8,052 | 30.4% / 19.6% / 10.6%": tok/s and roofline fractions over buckets."""
    b = r["configs"][config]["roofline"]["buckets"]
    tps = " / ".join(f"{b[w]['tokens_per_s']:,.0f}" for w in b)
    frac = " / ".join(f"{b[w]['fraction_of_bandwidth']:.1%}" for w in b)
    return f"{tps} | {frac}"


def _speedup(r: dict, c: str, base: str) -> float:
    x = r["configs"]["small_100m"]["concurrency"]
    return x[c]["output_throughput"] / x[base]["output_throughput"]


SERVE_CLAIMS: list[tuple[str, str, Callable[[dict], str]]] = [
    (
        "BENCHMARKS.md",
        "serve_cpu_tiny.json",
        lambda r: f"takes {_ms_cell(r['configs']['tiny']['decode_step_vs_context']['128'], 2)}",
    ),
    (
        "BENCHMARKS.md",
        "serve_cpu_tiny.json",
        lambda r: f"and {_ms_cell(r['configs']['tiny']['decode_step_vs_context']['8192'], 2)} after 8,192",
    ),
    ("BENCHMARKS.md", "serve_cpu_tiny.json", lambda r: f"warm {r['configs']['tiny']['time_to_ready']['warm']:.1f} s"),
    (
        "BENCHMARKS.md",
        "serve_cpu_tiny.json",
        lambda r: _roof_cells(r, "tiny").replace(" | ", " tok/s, ") + " (the tiny",
    ),
    ("BENCHMARKS.md", "serve_cpu_100m.json", lambda r: f"gives {_speedup(r, '16', '1'):.1f}x"),
]
CLAIMS += SERVE_CLAIMS


def _spread(config: str, lead: str, sep: str, fmt: str) -> Callable[[dict], str]:
    """The min-max of the no-sharing throughput runs, cache off then on: "5,249-6,420 off, 5,598-6,787"."""

    def text(r: dict) -> str:
        runs = (r["configs"][config]["prefix_cache"][k]["no_sharing_output_throughput"] for k in ("off", "on"))
        return lead + sep.join(f"{min(v):{fmt}}-{max(v):{fmt}}" for v in runs)

    return text


def _gla_ratio(r: dict, num: str, den: str, key: str) -> float:
    return r["impls"][num][key] / r["impls"][den][key]


CLAIMS += [
    (
        "BENCHMARKS.md",
        "gla_cpu.json",
        lambda r: f"C=128 forward+backward **{_gla_ratio(r, 'baseline128', 'chunk128', 'fwd_bwd_s'):.2f}x**",
    ),
    ("BENCHMARKS.md", "gla_cpu.json", lambda r: f"forward {_gla_ratio(r, 'baseline128', 'chunk128', 'fwd_s'):.2f}x"),
    ("BENCHMARKS.md", "gla_cpu.json", lambda r: f"**{_gla_ratio(r, 'baseline128', 'chunk64', 'fwd_bwd_s'):.1f}x**"),
    (
        "BENCHMARKS.md",
        "gla_cpu.json",
        lambda r: (
            f"**{r['impls']['chunk128']['fwd_bwd_speedup_over_recurrent']:.1f}x** (C=128) and "
            f"**{r['impls']['chunk64']['fwd_bwd_speedup_over_recurrent']:.1f}x** (C=64)"
        ),
    ),
    ("BENCHMARKS.md", "gla_cpu.json", lambda r: f"**{r['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s**"),
]


CLAIMS += [
    ("BENCHMARKS.md", "plan_3b.json", lambda r: f"Communication is {r['cost']['comm_over_compute']:.2f} of compute"),
]


def _ab(row: str, text: str) -> Callable[[dict], str]:
    """A median ratio of the side-by-side serving run, quoted as ``text`` with {} for the ratio."""
    return lambda r: text.format(f"{r['rows'][row]['ratio_median']:.2f}x")


CLAIMS += [
    ("BENCHMARKS.md", "serve_cpu_unrolled_decode_ab.json", _ab(row, text))
    for row, text in (
        ("tiny roofline 1", "({} for one row's decode call, "),
        ("tiny concurrency 16", "{} at\n  concurrency 16)"),
        ("small_100m roofline 1", "({} for one row's decode call, "),
        ("small_100m concurrency 1", "{} at concurrency 1)"),
        ("small_100m concurrency 16", "faster at\n  concurrency 16 ({})"),
    )
]


CLAIMS += [
    ("BENCHMARKS.md", "muon_3b.json", lambda r: f"{r['float32']['ns_flops_total']:.2e} FLOPs".replace("e+", "e")),
    (
        "BENCHMARKS.md",
        "sampler_3b.json",
        lambda r: f"written once: {r['sampler'][0]['decode_min_bytes'] / 1e9:.2f} GB)",
    ),
]


def _w1024(r: dict) -> str:
    d = _width(r, 1024)
    args = d["weights_bytes"] + d["state_bytes"]
    return (
        f"{d['temporaries_bytes'] / GiB:.2f} GiB of temporaries on {args / 1e9:.1f} GB of arguments "
        f"(weights {d['weights_bytes'] / 1e9:.2f} GB, state\n  {d['state_bytes'] / 1e9:.1f} GB): "
        f"{(args + d['temporaries_bytes']) / 1e9:.1f} GB in all"
    )


CLAIMS += [
    ("BENCHMARKS.md", "checkpoint_3b.json", lambda r: f"parameter: {r['bytes_per_device'] / 1e9:.2f} GB)"),
    (TRAINING, "checkpoint_3b.json", lambda r: f"the 3B state ({r['bytes_per_device'] / 1e9:.2f} GB)"),
    ("BENCHMARKS.md", "decode_memory_3b_bf16.json", _w1024),
    (
        "BENCHMARKS.md",
        "sampler_3b.json",
        lambda r: f"Most of the {r['sampler'][0]['sampler_bytes_accessed'] / 1e9:.2f} GB",
    ),
    (
        SERVING,
        "sampler_3b.json",
        lambda r: f"reads {r['sampler'][0]['sampler_bytes_accessed'] / 1e9:.2f} GB per step",
    ),
    (SERVING, "sampler_3b.json", lambda r: f"({100 * r['sampler'][1]['share_of_bytes']:.1f}% with rbg)"),
    (
        SERVING,
        "sampler_3b_before.json",
        lambda r: f"against {100 * r['sampler'][0]['share_of_bytes']:.1f}% for the sort",
    ),
    (SERVING, "decode_memory_3b_bf16.json", lambda r: f"for a\n  {_state(r, 256)} state"),
    (SERVING, "decode_memory_3b_fp32.json", lambda r: f"fp32: {_decode(256)(r)} for {_state(r, 256)}"),
    (
        TRAINING,
        "muon_3b.json",
        lambda r: f"{r['float32']['all_to_all_bytes_per_rank'] / 1e9:.3f} GB per rank per step",
    ),
    (TRAINING, "muon_3b.json", lambda r: f"or {r['bfloat16']['all_to_all_bytes_per_rank'] / 1e9:.3f} GB in bf16"),
    (
        TRAINING,
        "muon_3b.json",
        lambda r: (
            f"baseline is {r['float32']['gather_baseline_bytes_per_rank'] / 1e9:.2f} GB\n  "
            f"({r['float32']['reduction_vs_gather']:.0f}x / {r['bfloat16']['reduction_vs_gather']:.0f}x less)"
        ),
    ),
    (TRAINING, "muon_3b.json", lambda r: f"owns {r['float32']['ns_busiest_over_mean']:.3f}x the mean"),
    (
        TRAINING,
        "plan_3b.json",
        lambda r: (
            f"({r['memory_per_device']['arguments'] / GiB:.2f} GiB of arguments, "
            f"{r['memory_per_device']['temporaries'] / GiB:.2f} GiB"
        ),
    ),
    (
        TRAINING,
        "plan_3b.json",
        lambda r: f"{_coll(r, 'all-gather') / 1e9:.2f} GB of all-gather and {_coll(r, 'reduce-scatter') / 1e9:.2f} GB",
    ),
    (
        MODEL,
        "import_memory.json",
        lambda r: (
            f"checkpoint of {r['checkpoint_bytes'] / 1e9:.2f} GB (largest shard "
            f"{r['largest_shard_bytes'] / 1e9:.2f} GB) peaked {r['import_overhead_bytes'] / 1e9:.2f} GB above\nthe "
            f"{r['params_fp32_bytes'] / 1e9:.2f} GB"
        ),
    ),
    (
        "BENCHMARKS.md",
        "numerics_recall_1x.json",
        lambda r: f"(argmax agreement {r['jit_vs_eager_bf16']['argmax_agree']:.1%})",
    ),
]


CLAIMS += [
    (
        "BENCHMARKS.md",
        "memory_kernel_3b_layer.json",
        lambda r: (
            f"= {r['kernel']['temporaries_over_io']:.1f}x its inputs + outputs "
            f"({r['kernel']['inputs_plus_outputs_bytes'] / GiB:.3f} GiB)"
        ),
    ),
    (
        KERNELS,
        "memory_step_100m.json",
        lambda r: (
            f"small_100m: {_pol(r, 'save_gla')['step_seconds']:.1f} s per step vs "
            f"{_pol(r, 'full')['step_seconds']:.1f} s\n  `full` and {_pol(r, 'none')['step_seconds']:.1f} s `none`"
        ),
    ),
]


CLAIMS.append(
    (
        "BENCHMARKS.md",
        "decode_cost_prefix.json",
        lambda r: (
            f"median ratio {r['configs']['tiny']['ratio_median']:.3f} (tiny)\n  and "
            f"{r['configs']['small_100m']['ratio_median']:.3f} (~100M)"
        ),
    )
)


CLAIMS += [
    (DEVELOPMENT, "tests_cpu.json", lambda r: f"included: {r['passed']} passed in {r['wall_s']:,.0f} s on 2 CPU cores"),
    *((DEVELOPMENT, "tests_cpu.json", lambda r, i=i: f" {r['slowest'][i]['seconds']:.1f} s") for i in range(5)),
]


CLAIMS += [
    ("BENCHMARKS.md", "prefix_cache_cpu.json", _spread("small_100m", "runs spread over ", " tok/s off\n  and ", ".1f")),
    ("BENCHMARKS.md", "prefix_cache_cpu.json", _spread("tiny", "spread between alternated runs: ", " off, ", ",.0f")),
    (
        "BENCHMARKS.md",
        "memory_step_340m_standin.json",
        lambda r: f"**{_pol(r, 'none')['memory']['temporaries'] / GiB:.1f} GiB**",
    ),
    (
        "BENCHMARKS.md",
        "memory_step_100m.json",
        lambda r: (
            f"{_pol(r, 'save_gla')['memory']['temporaries'] / _pol(r, 'full')['memory']['temporaries']:.1f}x `full`'s"
        ),
    ),
]


_DECODE_MEMORY = ("### Decode step memory (3B, compiled on CPU, nothing allocated)",)
# (document, result JSON) -> the headings of the sections allowed to quote its figures
LOCATIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("BENCHMARKS.md", "checkpoint_3b.json"): ("## Checkpoint checksums (one device's share of the 3B state)",),
    (TRAINING, "checkpoint_3b.json"): ("# Training",),
    (DEVELOPMENT, "tests_cpu.json"): ("## Tests and CI",),
    ("BENCHMARKS.md", "decode_memory_3b_bf16.json"): _DECODE_MEMORY,
    ("BENCHMARKS.md", "serve_cpu_unrolled_decode_ab.json"): _DECODE_MEMORY,
    ("BENCHMARKS.md", "gla_cpu.json"): ("## GLA kernel (`chunk_gla`)", "## Training step"),
    ("BENCHMARKS.md", "memory_kernel_3b_layer.json"): ("### Kernel memory",),
    ("BENCHMARKS.md", "memory_kernel_3b_layer_autodiff.json"): ("### Kernel memory",),
    ("BENCHMARKS.md", "muon_3b.json"): ("## Distributed Muon (3B, 64 ranks, read from compiled HLO)",),
    ("BENCHMARKS.md", "plan_3b_concurrent_schedule.json"): (
        "## 3B training plan (64 fake devices, nothing allocated)",
    ),
    ("BENCHMARKS.md", "plan_3b.json"): (
        "## 3B training plan (64 fake devices, nothing allocated)",
        "## Distributed Muon (3B, 64 ranks, read from compiled HLO)",
        "### Time and cost of the whole run (printed by `--plan`)",
    ),
    ("BENCHMARKS.md", "sampler_3b.json"): (
        "### The sampler's share of a decode step (3B, W=256, compiled cost analysis)",
    ),
    ("BENCHMARKS.md", "serve_cpu_8dev.json"): ("### Decode against the bandwidth roofline, and 8 devices",),
    ("BENCHMARKS.md", "serve_cpu_tiny.json"): ("## Serving (tiny model, random weights, CPU)",),
    ("BENCHMARKS.md", "memory_step_100m.json"): ("### Train-step memory per remat policy",),
    ("BENCHMARKS.md", "memory_step_340m_standin.json"): ("### Train-step memory per remat policy",),
    ("BENCHMARKS.md", "decode_cost_prefix.json"): (
        "## Prefix-state cache (tiny and ~100M models, random weights, CPU)",
    ),
    ("BENCHMARKS.md", "prefix_cache_cpu.json"): ("## Prefix-state cache (tiny and ~100M models, random weights, CPU)",),
    ("BENCHMARKS.md", "serve_cpu_100m.json"): ("## Serving (~100M model, random weights, CPU)",),
    ("BENCHMARKS.md", "soak_cpu_tiny.json"): ("## Serving soak (tiny model, random weights, CPU)",),
    ("BENCHMARKS.md", "soak_cpu_tiny_6000.json"): ("## Serving soak (tiny model, random weights, CPU)",),
    ("BENCHMARKS.md", "soak_cpu_tiny_nocache.json"): ("## Serving soak (tiny model, random weights, CPU)",),
    ("BENCHMARKS.md", "soak_cpu_tiny_before.json"): ("## Serving soak (tiny model, random weights, CPU)",),
    ("BENCHMARKS.md", "gpu_static_3b.json"): ("### Pallas kernel: status",),
    ("README.md", "first_run_tiny.json"): ("# laplace-jax",),
    ("BENCHMARKS.md", "first_run_tiny.json"): ("## Training step",),
    ("BENCHMARKS.md", "numerics_recall_1x.json"): ("## Numerics report, default vs `--exact` (runs/recall_1x, CPU)",),
    ("BENCHMARKS.md", "numerics_recall_1x_exact.json"): (
        "## Numerics report, default vs `--exact` (runs/recall_1x, CPU)",
    ),
    (MODEL, "import_memory.json"): ("## fla checkpoints and Hugging Face",),
    (SERVING, "decode_memory_3b_bf16.json"): ("# Serving",),
    (SERVING, "decode_memory_3b_fp32.json"): ("# Serving",),
    (KERNELS, "memory_kernel_3b_layer.json"): ("## The kernel",),
    (KERNELS, "memory_kernel_3b_layer_autodiff.json"): ("## The kernel",),
    (KERNELS, "memory_step_340m.json"): ("## The kernel",),
    (KERNELS, "memory_step_100m.json"): ("## The kernel",),
    (TRAINING, "muon_3b.json"): ("## Muon",),
    (KERNELS, "numerics_kernels.json"): ("## Numerical tolerances you can rely on",),
    (SERVING, "sampler_3b_before.json"): ("# Serving",),
    (TRAINING, "plan_3b.json"): ("# Training",),
    (SERVING, "sampler_3b.json"): ("# Serving",),
}


def sections(text: str) -> list[tuple[str, int, int]]:
    """(heading, start, end) of every markdown section (headings in code fences are not headings)."""
    heads, pos, fenced = [], 0, False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            heads.append((line.strip(), len(line) - len(line.lstrip("#")), pos))
        pos += len(line)
    out = []
    for i, (head, level, start) in enumerate(heads):
        end = next((st for _, lv, st in heads[i + 1 :] if lv <= level), len(text))
        out.append((head, start, end))
    return out


def _located(doc_text: str, figure: str, headings: tuple[str, ...]) -> bool:
    """Whether ``figure`` appears inside a section whose heading starts with one of ``headings``
    (a subsection counts as part of its section)."""
    spans = [(st, en) for head, st, en in sections(doc_text) if head.startswith(headings)]
    at = doc_text.find(figure)
    while at != -1:
        if any(st <= at < en for st, en in spans):
            return True
        at = doc_text.find(figure, at + 1)
    return False


def check(root: str = ROOT) -> list[str]:
    """Every claim whose formatted figure is missing from its document, or is not in the section
    ``LOCATIONS`` gives for its result (empty: all match)."""
    bad = []
    docs: dict[str, str] = {}
    for doc, result, fmt in CLAIMS:
        if doc not in docs:
            with open(os.path.join(root, doc)) as f:
                docs[doc] = f.read()
        with open(os.path.join(root, "benchmarks", "results", result)) as f:
            text = fmt(json.load(f))
        where = LOCATIONS.get((doc, result))
        if text not in docs[doc]:
            bad.append(f"{doc}: expected {text!r} (from benchmarks/results/{result})")
        elif where is None:
            bad.append(f"{doc}: {result} has no entry in LOCATIONS (the section that quotes it)")
        elif not _located(docs[doc], text, where):
            bad.append(f"{doc}: {text!r} (from {result}) is not under {' or '.join(where)}")
    return bad


# A number with a unit of measure: what a reader takes for a measured figure.
MEASURE = re.compile(
    r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)"
    r"(?:\s?(?:ms|s|min|tok/s|tokens/s|x|%|nats/byte|GFLOP/s)|\s(?:GiB|GB|MB|KB|B))(?![\w/])"
)


def uncovered(root: str = ROOT, exempt: bool = True) -> list[tuple[str, str, str]]:
    """(document, section heading, figure) for every number with a unit, outside code blocks and
    the tables ``benchmarks/tables.py`` generates from JSON (checked by ``tables.py --check``), that
    no claim's quoted text covers and (with ``exempt``) ``not_measured.NOT_MEASURED`` does not
    list for its section: the figures still quoted without a JSON check."""
    out = []
    for doc in DOCUMENTS:
        with open(os.path.join(root, doc)) as f:
            text = f.read()
        covered = bytearray(len(text))
        for d, result, fmt in CLAIMS:
            if d != doc:
                continue
            with open(os.path.join(root, "benchmarks", "results", result)) as f:
                quoted = fmt(json.load(f))
            at = text.find(quoted)
            while at != -1:
                covered[at : at + len(quoted)] = b"\1" * len(quoted)
                at = text.find(quoted, at + 1)
        fences = [m.span() for m in re.finditer(r"```.*?```", text, flags=re.S)]
        generated = [m.span() for m in tables.BLOCK.finditer(text)]
        heads = sections(text)
        found = []
        for m in MEASURE.finditer(text):
            st, en = m.span(1)  # the number itself (its unit may sit on the next line)
            if any(a <= st < b for a, b in fences):
                continue
            head = max((h for h in heads if h[1] <= st < h[2]), key=lambda h: h[1], default=("(top)", 0, 0))
            in_table = any(a <= st < b for a, b in generated)  # rendered from its JSON: checked by tables --check
            found.append((head, " ".join(m.group().split()), in_table or all(covered[st:en])))
        # a figure restated in prose counts when the same text is checked (or generated) elsewhere in its section
        checked = {(head[0], fig) for head, fig, ok in found if ok}
        out += [(doc, head[0], fig) for head, fig, ok in found if not ok and (head[0], fig) not in checked]
    if exempt:
        out = [(d, h, f) for d, h, f in out if f not in NOT_MEASURED.get((d, h), {})]
    return out


def not_measured_counts() -> dict[str, int]:
    """Entries of ``NOT_MEASURED`` by kind."""
    counts: dict[str, int] = {}
    for figures in NOT_MEASURED.values():
        for kind in figures.values():
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = check()
    for line in bad:
        print(line)
    print(f"{len(CLAIMS) - len(bad)} of {len(CLAIMS)} quoted figures match their JSON")
    if "--uncovered" in argv:
        rest = uncovered()
        for doc, head, fig in rest:
            print(f"  not backed: {doc} {head}: {fig}")
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(not_measured_counts().items()))
        print(f"{len(rest)} numbers with a unit are neither checked against a JSON nor listed in not_measured.py")
        print(f"not_measured.py lists {sum(not_measured_counts().values())}: {kinds}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
