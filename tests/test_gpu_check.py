"""The static GPU check (tools.gpu_check) on a small shape: the Pallas kernels lower for cuda on
this CPU machine, compile with triton for sm_90, and the assembler's report is read."""

import json

from laplace_jax.tools.gpu_check import SHAPES, main, report


def test_small_shape_lowers_compiles_and_reports_resources(tmp_path):
    rep = report("small", [90])
    B, _, H, _, V = SHAPES["small"]
    got = {(k["pass"], k["kernel"]) for k in rep["kernels"]}
    assert got == {("forward", "gla_fwd"), ("gradient", "gla_fwd"), ("gradient", "gla_bwd")}
    for k in rep["kernels"]:
        assert k["arch"] == "sm_90" and 0 < k["registers"] <= 255
        assert k["programs"] == B * H * max(1, V // 64)  # one program per (batch, head, 64-wide value tile)
        assert k["shared_bytes"] > 0 and k["spill_store_bytes"] >= 0
        assert any(m.startswith(("mma.sync", "wgmma")) for m in k["mma"])  # the dots run on tensor cores
    assert main(["--shape", "small", "--arch", "90", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["shape"] == "small"
