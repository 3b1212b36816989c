"""The info CLI: model facts and the compiled Muon communication report for 3B on 64 fake devices."""

import json
import subprocess
import sys

import pytest
from helpers import child_env


def _info(*args):
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "laplace_jax.info", *args], capture_output=True, text=True, env=env)
    return proc


def test_3b_table_and_json():
    proc = _info("--config", "configs/3b.py", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["params"] == 3_029_528_064 and rep["state_bytes_per_sequence"] == 29_491_200
    table = _info("--config", "configs/3b.py").stdout
    assert "29,491,200 B" in table and "81.9x" in table


def test_config_typo_is_a_clear_error():
    proc = _info("--config", "configs/3b.py", "--config.model.nheads=3")
    assert proc.returncode != 0
    assert "n_heads" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("comm_dtype,limit", [("float32", 0.45e9), ("bfloat16", 0.23e9)])
def test_muon_report_3b_on_64_devices(comm_dtype, limit):
    proc = _info("--config", "configs/3b.py", "--muon", "--devices", "64", "--comm_dtype", comm_dtype, "--json")
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)["muon"]
    assert m["hidden_matrices"] == 192
    assert m["all_to_all_ops_per_step"] == 2
    assert m["all_to_all_bytes_per_rank"] <= limit
    assert m["other_collective_bytes_per_rank"] == 0
    assert 10.8e9 <= m["gather_baseline_bytes_per_rank"] <= 10.9e9
    assert m["gather_baseline_bytes_per_rank"] / m["all_to_all_bytes_per_rank"] >= 24
    assert m["ns_busiest_over_mean"] <= 1.25
