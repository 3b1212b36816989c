"""Checkpoints under faults: every kind of damage is caught, set aside (never deleted) and the run
resumes exactly from the newest intact step; loaders name the damaged step and the flag."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import ROOT, child_env, micro_config, persistent_compile_cache

from laplace_jax.checkpoint import CHECKSUMS, damage, load_trained
from laplace_jax.errors import CheckpointError
from laplace_jax.train.loop import run

CFG = dict(train=dict(steps=12, ckpt_every=4))


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(compile_cache_dir):
    """Every run here compiles the same step: the persistent cache compiles it once."""
    with persistent_compile_cache(compile_cache_dir):
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _compile_cache):
    """An uninterrupted 12-step run, and a run stopped at step 8 (checkpoints 4, 8) to damage."""
    root = tmp_path_factory.mktemp("runs")
    straight = run(micro_config(**CFG), str(root / "straight"), devices=jax.devices()[:1], log=lambda *_: None)
    run(micro_config(**CFG), str(root / "base"), max_steps=8, devices=jax.devices()[:1], log=lambda *_: None)
    return {h["step"]: h["loss"] for h in straight["history"]}, root / "base"


def _data_files(step_dir):
    d = step_dir / "state" / "ocdbt.process_0" / "d"
    return sorted(d.iterdir(), key=lambda p: p.stat().st_size)


def _flip_bit(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))


def _zero_64(path):
    b = bytearray(path.read_bytes())
    mid = len(b) // 2
    b[mid : mid + 64] = bytes(64)
    path.write_bytes(bytes(b))


FAULTS = {
    "bit flip, largest data file": lambda s: _flip_bit(_data_files(s)[-1]),
    "bit flip, smallest data file": lambda s: _flip_bit(_data_files(s)[0]),
    "64 zeroed bytes": lambda s: _zero_64(_data_files(s)[-1]),
    "truncated data file": lambda s: os.truncate(_data_files(s)[-1], _data_files(s)[-1].stat().st_size // 2),
    "deleted metadata file": lambda s: (s / "state" / "_METADATA").unlink(),
    "missing commit marker": lambda s: (s / "commit_success.txt").unlink(),
    "damaged config item": lambda s: (s / "config" / "metadata").write_text("{not json"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_exactly(runs, tmp_path, fault):
    straight, base = runs
    work = tmp_path / "w"
    shutil.copytree(base, work)
    step8 = work / "checkpoints" / "8"
    assert (step8 / CHECKSUMS).is_file() and damage(str(step8)) is None
    FAULTS[fault](step8)
    assert damage(str(step8)) is not None  # caught from the bytes alone, before any restore
    lines = []
    resumed = run(micro_config(**CFG), str(work), devices=jax.devices()[:1], log=lines.append)
    damaged = [line for line in lines if line.startswith("checkpoint step")]
    assert len(damaged) == 1 and "step 8" in damaged[0] and "8.corrupt" in damaged[0], lines
    assert any("resumed from step 4" in line for line in lines)
    assert (work / "checkpoints" / "8.corrupt").is_dir()  # set aside, not deleted
    got = {h["step"]: h["loss"] for h in resumed["history"]}
    assert sorted(got) == list(range(5, 13))
    for s, loss in got.items():
        assert loss == straight[s], s  # bitwise, data order included


def test_with_no_intact_checkpoint_the_run_stops_instead_of_starting_afresh(runs, tmp_path):
    _, base = runs
    work = tmp_path / "w"
    shutil.copytree(base, work)
    for step in ("4", "8"):
        _flip_bit(_data_files(work / "checkpoints" / step)[-1])
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        run(micro_config(**CFG), str(work), devices=jax.devices()[:1], log=lambda *_: None)
    assert sorted(os.listdir(work / "checkpoints")) == ["4.corrupt", "8.corrupt"]
    assert not (work / "metrics.jsonl").read_text().count('"step": 9')  # nothing trained past them


def test_loaders_name_the_damaged_step_and_the_flag(runs, tmp_path):
    _, base = runs
    work = tmp_path / "w"
    shutil.copytree(base, work)
    _zero_64(_data_files(work / "checkpoints" / "8")[-1])
    before = sorted(p for p in work.rglob("*"))
    with pytest.raises(CheckpointError, match=r"step 8 .* is damaged .*--step N \(step=N\) \(other steps: 4\)"):
        load_trained(str(work))
    _, _, params = load_trained(str(work), step=4)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))
    assert sorted(p for p in work.rglob("*")) == before  # reading moved, created and deleted nothing
    with pytest.raises(CheckpointError, match="no checkpoint at step 5"):
        load_trained(str(work), step=5)


@pytest.mark.slow
@pytest.mark.parametrize("context", [1, 2])
def test_kill_9_during_checkpoint_writes_then_rerun_resumes_exactly(tmp_path, context):
    """train.py writing a checkpoint every step is killed with SIGKILL mid-run; the rerun resumes
    from the last complete checkpoint (and the programs the killed run left in the compile cache)
    and ends with the losses of an uninterrupted run. Also with each sequence split over 2 devices
    (mesh.context=2)."""
    args = ["--config", "configs/tiny.py", "--config.train.steps=10", "--config.train.ckpt_every=1"]
    args += ["--config.train.eval_every=0", "--config.data.embedded_max_chars=300000"]
    env = child_env(context)
    if context > 1:
        args += [f"--config.mesh.context={context}", "--config.mesh.fsdp=1"]
    err = open(tmp_path / "a.err", "wb")  # noqa: SIM115  (the uninterrupted run's messages, read at the end)
    straight = subprocess.Popen(  # the uninterrupted run, beside the one to kill (2 cores: ~one run's time)
        [sys.executable, "train.py", *args, f"--workdir={tmp_path / 'a'}"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    cache = f"--compile_cache_dir={tmp_path / 'compile_cache'}"  # the rerun loads the killed run's programs
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args, cache, f"--workdir={tmp_path / 'b'}"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def newest():
        return max((int(p.name) for p in (tmp_path / "b" / "checkpoints").glob("*") if p.name.isdigit()), default=0)

    deadline = time.time() + 300
    while time.time() < deadline and newest() < 4:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)  # mid-run: with a checkpoint every step, most likely mid-write
    proc.wait()
    killed_at = newest()
    assert killed_at < 10
    again = subprocess.run(
        [sys.executable, "train.py", *args, cache, f"--workdir={tmp_path / 'b'}"], cwd=ROOT, env=env,
        capture_output=True,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step {killed_at}".encode() in again.stdout + again.stderr
    assert straight.wait(300) == 0, (tmp_path / "a.err").read_text()[-2000:]
    err.close()
    read = lambda p: {r["step"]: r["loss"] for r in map(eval_json, p.read_text().splitlines()) if "loss" in r}  # noqa: E731
    a, b = read(tmp_path / "a" / "metrics.jsonl"), read(tmp_path / "b" / "metrics.jsonl")
    assert a[10] == b[10] and all(a[s] == b[s] for s in b)


def eval_json(line):
    import json

    return json.loads(line)


def test_serve_and_eval_say_one_line_for_a_damaged_checkpoint(runs, tmp_path, capsys):
    import serve
    from laplace_jax.eval.__main__ import main as eval_main

    _, base = runs
    work = tmp_path / "w"
    shutil.copytree(base, work)
    _flip_bit(_data_files(work / "checkpoints" / "8")[0])
    assert serve.main(["--checkpoint", str(work), "--tokenizer", "byte"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 8" in err[0] and "damaged" in err[0] and "--step N" in err[0], err
    code = eval_main(["numerics", "--checkpoint", str(work), "--out", str(tmp_path / "o"), "--length", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "step 8" in err[0] and "--step N" in err[0], err
