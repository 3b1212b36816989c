"""Device traces: train.py's --profile_steps and serve.py's /start_profile, /stop_profile write
jax.profiler trace files that TensorBoard / XProf read (checked on CPU for the files)."""

import os

import jax
import pytest
from helpers import micro_config
from serving_helpers import Running

from laplace_jax.errors import UserError
from laplace_jax.profiling import parse_steps, trace_files
from laplace_jax.train.loop import run


def test_parse_steps_takes_first_and_last_both_included():
    assert parse_steps("10:12") == (10, 12)
    assert parse_steps(" 3 : 3 ") == (3, 3)
    for bad in ("12:10", "0:2", "10", "a:b", "10:12:14", "-1:2"):
        with pytest.raises(UserError, match="FIRST:LAST"):
            parse_steps(bad)


def _train_tracing_steps_2_3(workdir, steps: int) -> list[str]:
    lines = []
    cfg = micro_config(train=dict(steps=steps))
    run(cfg, str(workdir), devices=jax.devices()[:1], profile_steps=(2, 3), log=lines.append)
    return lines


def test_train_traces_the_chosen_steps_into_the_workdir(tmp_path):
    lines = _train_tracing_steps_2_3(tmp_path, 4)
    (trace,) = trace_files(str(tmp_path / "tb"))
    assert os.path.getsize(trace) > 0
    assert any("profile of steps 2-3" in line and trace in line for line in lines), lines
    lines = _train_tracing_steps_2_3(tmp_path, 6)  # resumed past the range: nothing traced, and the log says so
    assert len(trace_files(str(tmp_path / "tb"))) == 1
    assert any("no such step runs now (steps 5..6)" in line for line in lines), lines


def test_serve_profile_window_writes_a_trace(tmp_path):
    s = Running(max_num_seqs=1, prefill_chunk=16, decode_buckets="1", profile_dir=str(tmp_path))
    try:
        assert s.post(route="/stop_profile").status_code == 409  # nothing running yet
        r = s.post(route="/start_profile")
        assert r.status_code == 200 and r.json()["status"] == "started"
        assert s.post(route="/start_profile").status_code == 409
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert s.post(body).status_code == 200
        r = s.post(route="/stop_profile")
        assert r.status_code == 200
        assert r.json()["trace"] in trace_files(str(tmp_path)) and os.path.getsize(r.json()["trace"]) > 0
    finally:
        s.close()


def test_profile_routes_are_off_without_a_directory():
    s = Running(max_num_seqs=1, prefill_chunk=16, decode_buckets="1")
    try:
        r = s.post(route="/start_profile")
        assert r.status_code == 404 and "--profile-dir" in r.json()["error"]["message"]
    finally:
        s.close()
