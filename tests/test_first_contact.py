"""First contact: what a new user's first commands print and leave behind."""

import json
import os
import re
import time

import jax
import pytest
from helpers import ROOT, micro_config

from laplace_jax.checkpoint import TrainCheckpointer
from laplace_jax.errors import UserError
from laplace_jax.train import loop as loop_mod
from laplace_jax.train import trainer as trainer_mod
from laplace_jax.train.loop import run


def test_a_refused_run_leaves_no_directory(tmp_path):
    work = tmp_path / "runs" / "too_big"
    with pytest.raises(UserError, match=r"needs .* GiB per device"):
        run(micro_config(train=dict(device_memory_gib=1e-6)), str(work), devices=jax.devices()[:1], log=lambda *_: None)
    assert not (tmp_path / "runs").exists()


def test_rerunning_a_finished_run_trains_nothing_and_says_so(tmp_path, capsys):
    cfg = micro_config(train=dict(steps=6, eval_every=3, ckpt_every=3))
    lines = []
    first = run(cfg, str(tmp_path), devices=jax.devices()[:1], log=lines.append)
    assert any(line.startswith("done: step 6") for line in lines)
    assert "step 3: eval loss" in capsys.readouterr().out  # eval losses reach the console, not only the log
    before = (tmp_path / "metrics.jsonl").read_text()
    lines.clear()
    out = run(cfg, str(tmp_path), devices=jax.devices()[:1], log=lines.append)
    assert out["history"] == [] and any(line.startswith("nothing to train") for line in lines), lines
    assert not any("compiling the step" in line for line in lines), lines  # read from the workdir, nothing built
    assert (out["step"], out["eval_loss"], out["skipped"]) == (6, first["eval_loss"], first["skipped"])
    assert not any("nan" in line for line in lines)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # no second final eval
    evals = [r for r in map(json.loads, before.splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]


def test_a_workdir_of_another_run_is_refused_before_data_and_compile(tmp_path, monkeypatch):
    """The saved config is checked first (it took 44 s of data and compile before); the run
    checkpoints every ckpt_every steps and at its end, not at step 1."""
    run(micro_config(train=dict(steps=6, ckpt_every=5)), str(tmp_path), devices=jax.devices()[:1], log=lambda *_: None)
    assert TrainCheckpointer(str(tmp_path), read_only=True).steps() == [5, 6]

    def built(*_):
        raise AssertionError("the data was built before the workdir was checked")

    monkeypatch.setattr(loop_mod, "TrainingData", built)
    with pytest.raises(UserError, match=r"different data config \(differs in: seq_len\).*new --workdir"):
        run(micro_config(data=dict(seq_len=32)), str(tmp_path), devices=jax.devices()[:1], log=lambda *_: None)


def test_readme_python_snippet_runs_as_written():
    with open(os.path.join(ROOT, "README.md")) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    scope: dict = {}
    exec(code, scope)
    assert scope["logits"].shape == (1, 256) and scope["token"].shape == (1,)


def test_entry_points_name_a_missing_file_in_one_line(tmp_path, capsys):
    import serve
    from laplace_jax import cli

    assert serve.main(["--checkpoint", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} does not exist; pass --checkpoint a " + (
        "train.py workdir or a model directory"
    )
    with pytest.raises(SystemExit, match=r"config file configs/nope\.py does not exist .*tiny\.py"):
        cli._parse(["train.py", "--config", "configs/nope.py"])


def test_step_times_hold_each_steps_compute_and_nothing_between_steps(tmp_path, monkeypatch):
    """Every step's compute is made to last >= 0.1 s (a host callback inside the step) and every
    evaluation 1 s: each recorded step time must hold its own compute, whether the backend ran it
    inside the dispatch call (CPU with a callback does) or later, including the steps checkpointed
    or evaluated right after (before: 11 ms against ~290 ms for the others, mfu 292%), and none may
    hold an evaluation or a checkpoint write."""
    nap_s, eval_s = 0.1, 1.0
    real_step, real_eval = trainer_mod.train_step, trainer_mod.Trainer.eval_loss

    def slow_step(*args, **kwargs):
        state, metrics = real_step(*args, **kwargs)

        def nap(x):
            time.sleep(nap_s)
            return x

        loss = jax.pure_callback(nap, jax.ShapeDtypeStruct((), metrics["loss"].dtype), metrics["loss"])
        return state, {**metrics, "loss": loss}

    def slow_eval(self, *args):
        time.sleep(eval_s)
        return real_eval(self, *args)

    monkeypatch.setattr(trainer_mod, "train_step", slow_step)
    monkeypatch.setattr(trainer_mod.Trainer, "eval_loss", slow_eval)
    cfg = micro_config(train=dict(steps=6, eval_every=3, ckpt_every=3))
    out = run(cfg, str(tmp_path), devices=jax.devices()[:1], log=lambda *_: None)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]  # the case this guards: saves right after steps
    times = {r["step"]: r["step_s"] for r in out["history"]}
    assert sorted(times) == [1, 2, 3, 4, 5, 6]
    assert all(nap_s <= t < eval_s for t in times.values()), times
