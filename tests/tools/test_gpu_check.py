"""The static GPU check (tools.gpu_check) on a small shape: the Pallas kernels lower for cuda on
this CPU machine, compile with triton for sm_90, and the assembler's report is read."""

import json
import math

import pytest

from laplace_jax.tools.gpu_check import BLOCKS, SHAPES, UnsupportedError, block_sweep, main, report, sweep

FORWARD = ("gla_states", "gla_scores", "gla_out")
BACKWARD = ("gla_dstates", "gla_dscores", "gla_dqkg", "gla_dv")


def _report():
    try:
        return report("small", [90])
    except UnsupportedError as e:  # a jaxlib without the Python Triton lowering (newer than 0.10)
        pytest.skip(str(e))


def test_small_shape_lowers_compiles_and_reports_resources(tmp_path):
    rep = _report()
    B, T, H, K, V = SHAPES["small"]
    C = 128  # chunk_gla's default chunk
    got = {(k["pass"], k["kernel"]) for k in rep["kernels"]}
    assert got == {("forward", n) for n in FORWARD} | {("gradient", n) for n in FORWARD + BACKWARD}
    programs = {  # the grids: sequential passes over (batch*head, key tile, value tile), the rest per chunk
        "gla_states": B * H * (K // 32) * (V // 64),
        "gla_dstates": B * H * (K // 32) * (V // 64),
        "gla_scores": (T // C) * B * H * (C // 16),
        "gla_dscores": (T // C) * B * H * (C // 16),
        "gla_out": (T // C) * B * H * (V // 64),
        "gla_dv": (T // C) * B * H * (V // 64),
        "gla_dqkg": (T // C) * B * H * (K // 32),
    }
    for k in rep["kernels"]:
        assert k["arch"] == "sm_90" and 0 < k["registers"] <= 255
        assert k["programs"] == math.prod(k["grid"]) == programs[k["kernel"]], k["kernel"]
        assert k["shared_bytes"] > 0 and k["spill_store_bytes"] >= 0
        assert any(m.startswith(("mma.sync", "wgmma")) for m in k["mma"])  # the dots run on tensor cores
        # bf16 operands everywhere but the 0/1 triangular sums of log-decays and gate-gradient terms
        assert k["dots"].get("bf16", 0) >= 1 and set(k["dots"]) <= {"bf16", "f32_ieee"}, k["dots"]
        assert ("f32_ieee" in k["dots"]) == (k["kernel"] in ("gla_scores", "gla_dqkg")), k["dots"]
    assert main(["--shape", "small", "--arch", "90", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["shape"] == "small"


@pytest.mark.slow
def test_sweep_compiles_each_kernel_under_every_launch_setting_and_marks_the_chosen_one():
    _report()
    rows = sweep("small", 90)
    names = {r["kernel"] for r in rows}
    assert names == set(FORWARD + BACKWARD)
    for name in names:
        mine = [r for r in rows if r["kernel"] == name]
        assert len(mine) == 6 and sum(r["chosen"] for r in mine) == 1
        assert len({(r["num_warps"], r["num_stages"]) for r in mine}) == 6


@pytest.mark.slow
def test_block_sweep_compiles_the_gradient_under_each_tiling():
    _report()
    rows = block_sweep("small", 90)
    B, _, H, K, V = SHAPES["small"]
    for bk, bv in BLOCKS:
        mine = {r["kernel"]: r for r in rows if (r["block_k"], r["block_v"]) == (bk, bv)}
        assert set(mine) == set(FORWARD + BACKWARD)
        tiles = max(1, K // min(bk, K)) * max(1, V // min(bv, V))  # tiles never exceed the (power-of-two) widths
        assert mine["gla_states"]["programs"] == mine["gla_dstates"]["programs"] == B * H * tiles
