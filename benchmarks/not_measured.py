"""Numbers with a unit in README.md, BENCHMARKS.md and docs/ that are not this repository's stored
measurements, by section, each with its kind. ``check_figures --uncovered`` lists every other
number that no claim checks, and a test keeps that list empty, so a new figure must come with a
claim (a committed JSON) or an entry here.

Kinds:
  target     a goal from an issue or a test bound
  input      a setting, shape, workload share or definition
  reference  a figure from outside: the original team, a hardware spec, an issue's measurement
  derived    arithmetic on figures checked elsewhere or on the configs' shapes (reproducible with
             ``python -m laplace_jax.info`` or by hand from the quoted figures)
  history    a comparison with an earlier version of the code (or an alternative that was tried
             and dropped), from a run that was not stored; re-measuring it needs that version
A current measurement has no kind here: it needs a claim (the tests refuse any other kind).
"""

B = "BENCHMARKS.md"
DEVELOPMENT = "docs/development.md"
MODEL = "docs/model.md"
KERNELS = "docs/kernels.md"
TRAINING = "docs/training.md"
SERVING = "docs/serving.md"
EVALUATION = "docs/evaluation.md"
ACCELERATORS = "docs/accelerators.md"

NOT_MEASURED: dict[tuple[str, str], dict[str, str]] = {
    (B, "# Benchmarks"): {"24 GiB": "input"},
    (B, "## GLA kernel (`chunk_gla`)"): {"3x": "input", "5x": "target"},
    (B, "### Pallas kernel: status"): {
        "67 MB": "derived",
        "134 MB": "derived",
        "151 MB": "derived",
        "1,872 B": "history",
        "5,328 B": "history",
        "16 x": "input",
    },
    (B, "### Gate gradient across decays"): {
        "5%": "input",
        "491 ms": "history",
        "538 ms": "history",
        "176 ms": "history",
    },
    (B, "### Kernel memory"): {"4x": "target", "0.14 GiB": "derived", "0.13 GiB": "derived"},
    (B, "### Train-step memory per remat policy"): {
        "248 GiB": "reference",
        "120 GiB": "target",
        "5.3 GiB": "derived",
        "7.5 GiB": "derived",
        "4.5 GiB": "derived",
        "1.5 GiB": "derived",
        "110 GiB": "reference",
        "2.2 GiB": "derived",
        "13.6 GiB": "target",
        "13.5 GiB": "history",
        "80 GB": "reference",
        "24 GiB": "reference",
    },
    (B, "## Training step"): {
        "28.9%": "target",
        "70.7 s": "history",
        "4%": "history",
        "29.3%": "history",
        "0.6%": "history",
        "151.8 GB": "history",
        "0.37 GB": "history",
        "35%": "target",
        "10%": "derived",
    },
    (B, "## Distributed Muon (3B, 64 ranks, read from compiled HLO)"): {
        "0.45 GB": "target",
        "0.23 GB": "target",
        "24x": "target",
        "1.759x": "derived",
        "1.181x": "derived",
        "1%": "derived",
        "0.8%": "derived",
    },
    (B, "## 3B training plan (64 fake devices, nothing allocated)"): {
        "12.78 GiB": "history",
        "7.88 GiB": "history",
        "11.6 GB": "target",
        "3.03e9 x": "input",
        "4 B": "input",
        "10 MB": "target",
        "13.15 GiB": "target",
        "23.0 GB": "reference",
        "11.5 GB": "reference",
        "11.50 GB": "derived",
        "11.93 GB": "derived",
        "22.6 GB": "derived",
        "0.53x": "derived",
        "3%": "derived",
        "0.62 GB": "derived",
        "11.32 GB": "derived",
        "0.50x": "derived",
    },
    (B, "### Time and cost of the whole run (printed by `--plan`)"): {
        "6 x": "input",
        "3 x": "input",
        "119,934 tokens/s": "reference",
    },
    (B, "## Serving (tiny model, random weights, CPU)"): {
        "3,973 tok/s": "history",
        "6.5 ms": "history",
        "0.5%": "reference",
        "1.1%": "reference",
        "47.5%": "reference",
        "3 s": "derived",
        "14.9 s": "history",
        "4.1 s": "history",
        "14%": "derived",
        "5,084 tok/s": "derived",
    },
    (B, "### What logprobs, penalties and the other sampling controls cost a decode call"): {"5%": "target"},
    (B, "## Prefix-state cache (tiny and ~100M models, random weights, CPU)"): {
        "1 GiB": "input",
        "0.2x": "target",
        "3%": "target",
        "29.5 MB": "derived",
    },
    (B, "### Decode step memory (3B, compiled on CPU, nothing allocated)"): {
        "1 GiB": "target",
        "1.60 GiB": "history",
        "1.05x": "target",
        "2.29x": "derived",
        "8.64x": "derived",
        "2.68x": "derived",
        "0.62 GB": "derived",
        "24 GiB": "reference",
        "141 GB": "reference",
    },
    (B, "### The sampler's share of a decode step (3B, W=256, compiled cost analysis)"): {
        "5%": "target",
        "0.32 GB": "derived",
    },
    (B, "### Decode against the bandwidth roofline, and 8 devices"): {
        "1 GiB": "input",
        "2.4 MB": "derived",
        "8 x": "input",
        "2.0x": "derived",
        "50%": "target",
        "2.5 ms": "target",
    },
    (B, "## Serving soak (tiny model, random weights, CPU)"): {
        "75%": "input",
        "20%": "input",
        "5%": "input",
        "1 GiB": "input",
    },
    (B, "## Recall vs state size (`configs/recall_tiny.py`, CPU)"): {
        "1x": "input",
        "4x": "input",
        "32 x": "input",
    },
    (B, "## Numerics report, default vs `--exact` (runs/recall_1x, CPU)"): {"2 x": "input"},
    (KERNELS, "## Numerical tolerances you can rely on"): {"1e-4 x": "target", "1e-5 x": "target"},
    (KERNELS, "## The kernel"): {"16 x": "input"},
    (MODEL, "## Figures for the 3B config"): {
        "29,491,200 B": "derived",
        "28,311,552 B": "derived",
        "1,179,648 B": "derived",
        "2,415,919,104 B": "derived",
        "81.9x": "derived",
        "29.5 MB": "reference",
    },
    (TRAINING, "## Muon"): {"1%": "derived"},
    (TRAINING, "# Training"): {
        "36 GB": "derived",
        "110 GB": "derived",
        "1 x": "input",
        "2 x": "input",
        "119,934 tokens/s": "reference",
        "96 GiB": "reference",
        "11.5 GB": "reference",
    },
    (SERVING, "# Serving"): {
        "29,491,200 B": "derived",
        "1 GiB": "input",
        "29.5 MB": "reference",
        "0.5 MB": "derived",
        "1.7%": "derived",
    },
    (SERVING, "## Limits, failures, auth and shutdown"): {
        "50 ms": "input",
        "10 s": "input",
        "0.5 s": "input",
        "3 s": "target",
        "30 s": "input",
        "1 s": "input",
        "20%": "input",
        "5%": "input",
    },
    (EVALUATION, "# Evaluation"): {"100%": "derived"},
    (EVALUATION, "## Recall vs state size: what a fixed state remembers"): {
        "1x": "input",
        "4x": "input",
        "29.5 MB": "reference",
    },
    (EVALUATION, "## Hybrids: what an attention window buys"): {"3x": "input"},  # control_3x's steps
    (EVALUATION, "## `--exact`"): {"2 x": "input"},
    (DEVELOPMENT, "## Tests and CI"): {
        "85%": "reference",
    },
}
