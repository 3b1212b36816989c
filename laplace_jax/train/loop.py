"""The training run: ``run(config, workdir)`` trains, resuming from the newest checkpoint in
``workdir``. The pieces live beside it: ``Trainer`` (mesh, shardings, compiled step),
``data.sources.TrainingData``, ``train.metrics`` (records, plots), ``checkpoint`` (Orbax)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import jax

from laplace_jax import platform
from laplace_jax.checkpoint import TrainCheckpointer, damage
from laplace_jax.config import RunConfig
from laplace_jax.data.pipeline import train_batches
from laplace_jax.data.sources import TrainingData
from laplace_jax.errors import UserError
from laplace_jax.hlo_stats import memory_report
from laplace_jax.profiling import StepTrace
from laplace_jax.train.accounting import check_fit, flops_per_token
from laplace_jax.train.metrics import MetricsWriter, StepLog, plot_loss
from laplace_jax.train.trainer import Trainer


def _config_dict(config: RunConfig) -> dict:
    """The config as the JSON a checkpoint records (tuples become lists)."""
    return json.loads(json.dumps(config.to_dict()))


def _check_workdir(workdir: str) -> None:
    """Fail early if ``workdir`` cannot be written, without creating it (a refused run leaves nothing)."""
    probe = os.path.abspath(workdir)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f"workdir {workdir} is not writable ({probe} is a file); pass --workdir to a directory")
    try:
        # A unique name: every process of a multi-host run probes the same shared workdir.
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".write_test_"):
            pass
    except OSError as e:
        raise UserError(
            f"workdir {workdir} is not writable ({e.strerror}); pass --workdir to a writable directory"
        ) from e


def _same_run(saved: dict, current: dict) -> None:
    for section in ("model", "data"):
        a, b = saved.get(section), current.get(section)
        if a != b:
            diff = sorted(k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k))
            raise UserError(
                f"the checkpoints in this workdir were written with a different {section} config (differs in: "
                f"{', '.join(diff)}); resume with the same config or pass a new --workdir"
            )


def _banner(trainer: Trainer, mem: dict[str, int], peak: float, peak_src: str) -> str:
    return (
        f"{trainer.n_params:,} params | mesh {dict(trainer.mesh.shape)} on {jax.devices()[0].platform} | "
        f"{trainer.tokens_per_step:,} tokens/step | step memory {mem['total'] / 2**20:.0f} MiB/device | "
        f"peak {peak / 1e12:.3f} TFLOP/s/device ({peak_src})"
    )


def run(
    config: RunConfig,
    workdir: str,
    *,
    max_steps: int | None = None,
    devices: list | None = None,
    profile_steps: tuple[int, int] | None = None,
    log=print,
) -> dict[str, Any]:
    """Train (or resume) and return a summary. ``max_steps`` stops early; ``devices`` defaults to
    all; ``profile_steps`` (first, last): a ``jax.profiler`` trace of those steps into <workdir>/tb."""
    _check_workdir(workdir)
    if (done := _finished(config, workdir, log)) is not None:
        return done
    _refuse_other_run(config, workdir)
    lead, t = jax.process_index() == 0, config.train
    if lead:
        log(f"{workdir}: building the training data and compiling the step (tens of seconds on a CPU)")
    trainer = Trainer(config, devices)
    data = TrainingData(config.data, config.model)
    compiled = trainer.compile()
    mem = memory_report(compiled)
    check_fit(mem, platform.device_memory_bytes(t.device_memory_gib), trainer.mesh.size)
    data_iter = iter(
        train_batches(
            data.train,
            global_batch=config.data.global_batch,
            seed=config.data.seed,
            num_steps=trainer.steps,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    )
    _make_workdir(workdir)  # only now: a run refused above leaves no directory behind
    ckpt = TrainCheckpointer(workdir, keep=t.keep_checkpoints, every=t.ckpt_every)
    config_json = _config_dict(config)
    start, state = ckpt.restore_latest(
        trainer.abstract_state, data_iter, accept=lambda saved: _same_run(saved, config_json), log=log
    )
    if start is not None:
        log(f"resumed from step {start} in {ckpt.directory}")
    else:
        start, state = 0, trainer.init(config.data.seed)
    end = trainer.steps if max_steps is None else min(trainer.steps, max_steps)
    peak, peak_src = platform.peak_flops_per_device(t.peak_tflops)
    if lead:
        log(_banner(trainer, mem, peak, peak_src))
    writer = MetricsWriter(workdir, lead)
    steps = _step_log(trainer, writer, peak, start, end, lead)
    tracer = _step_trace(workdir, profile_steps, start, end, log if lead else lambda _: None)
    pending, last_eval = None, None
    try:
        for step in range(start, end):
            steps.start(step + 1)
            if tracer is not None:
                tracer.before(step + 1)
            state, metrics = compiled(state, trainer.batch(next(data_iter)))
            if tracer is not None:
                tracer.after(step + 1, (state, metrics))
            steps.dispatched(step + 1, metrics)
            if pending is not None:  # the previous step's metrics: no host stall on this one
                steps.record(*pending)
            pending = (step + 1, metrics)
            evaluating = t.eval_every and (step + 1) % t.eval_every == 0
            if evaluating or ckpt.should_save(step + 1):
                steps.record(*pending)  # waits for it: what follows is between steps
                pending = None
            ckpt.save(step + 1, state, data_iter, config_json)
            if evaluating:
                last_eval = (step + 1, trainer.eval_loss(state["params"], data.val))
                writer.write(step + 1, {"eval_loss": last_eval[1]})
                steps.note(f"step {step + 1}: eval loss {last_eval[1]:.4f}")
        if pending is not None:
            steps.record(*pending)
    finally:
        if tracer is not None:
            tracer.close()
        steps.close()
        ckpt.wait()
    return _finish(trainer, state, data, ckpt, data_iter, config_json, writer, steps.history, workdir, log, last_eval)


def _step_log(trainer: Trainer, writer: MetricsWriter, peak: float, start: int, end: int, show: bool) -> StepLog:
    return StepLog(
        writer,
        train=trainer.config.train,
        tokens_per_step=trainer.tokens_per_step,
        flops_per_step=flops_per_token(trainer.model_cfg, trainer.n_params, trainer.config.data.seq_len)
        * trainer.tokens_per_step,
        peak_flops=peak * trainer.mesh.size,
        start=start,
        end=end,
        show=show,
    )


def _refuse_other_run(config: RunConfig, workdir: str) -> None:
    """A workdir whose newest intact checkpoint was written with another model or data config is
    refused here, before the data is built and the step compiled (seconds to minutes)."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return
    ckpt = TrainCheckpointer(workdir, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is not None and damage(ckpt.step_dir(step)) is None:
            _same_run(ckpt.saved_config(step), _config_dict(config))
    finally:
        ckpt.close()


def _finished(config: RunConfig, workdir: str, log) -> dict[str, Any] | None:
    """The summary of a run that already reached ``train.steps``, read from its newest checkpoint's
    config and its metrics.jsonl without building data or compiling; None whenever anything is
    left to do or to check (the full path then resumes, verifies or refuses as usual)."""
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if jax.process_count() > 1 or not os.path.exists(metrics_path):
        return None
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return None
    ckpt = TrainCheckpointer(workdir, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is None or step < config.train.steps or damage(ckpt.step_dir(step)) is not None:
            return None
        try:
            _same_run(ckpt.saved_config(step), _config_dict(config))
        except UserError:
            return None
        counters = ckpt.restore_counters(step)
    finally:
        ckpt.close()
    with open(metrics_path) as f:
        evals = [r["eval_loss"] for r in map(json.loads, f) if r.get("step") == step and "eval_loss" in r]
    if not evals or counters["step"] != step:
        return None
    log(
        f"nothing to train: {workdir} already reached step {step} (train.steps); eval loss {evals[-1]:.4f}. "
        "Raise --config.train.steps to train further, or pass a new --workdir"
    )
    return {
        "step": step,
        "eval_loss": evals[-1],
        "skipped": counters["skipped"],
        "history": [],
        "loss_png": plot_loss(workdir),
        "workdir": os.path.abspath(workdir),
    }


def _make_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"workdir {workdir} is not writable ({e.strerror}); pass --workdir to a writable directory"
        ) from e


def _step_trace(workdir: str, steps: tuple[int, int] | None, start: int, end: int, log) -> StepTrace | None:
    """The trace of ``steps`` if any of them runs in this call (steps start+1 .. end)."""
    if steps is None:
        return None
    first, last = steps
    if last <= start or first > end:
        log(f"--profile_steps {first}:{last}: no such step runs now (steps {start + 1}..{end}); nothing traced")
        return None
    return StepTrace(os.path.join(workdir, "tb"), max(first, start + 1), min(last, end), log)


def _finish(
    trainer, state, data, ckpt, data_iter, config_json, writer, history, workdir, log, last_eval
) -> dict[str, Any]:
    """Final checkpoint, eval and plot; the run's summary. ``last_eval``: (step, loss) of the
    loop's last evaluation, reused when it was at the final step."""
    final_step = int(jax.device_get(state["step"]))
    ckpt.save(final_step, state, data_iter, config_json, force=final_step not in ckpt.manager.all_steps())
    if last_eval is not None and last_eval[0] == final_step:
        eval_loss = last_eval[1]
    else:
        eval_loss = trainer.eval_loss(state["params"], data.val)
        if history:  # a rerun of a finished run trains nothing and records nothing new
            writer.write(final_step, {"eval_loss": eval_loss})
    ckpt.wait()
    ckpt.close()
    writer.close()
    lead = jax.process_index() == 0
    png = plot_loss(workdir) if lead else None
    if lead and history:
        log(f"done: step {final_step}, train loss {history[-1]['loss']:.4f}, eval loss {eval_loss:.4f}; plot {png}")
    elif lead:
        log(
            f"nothing to train: {workdir} already reached step {final_step} (train.steps); eval loss "
            f"{eval_loss:.4f}. Raise --config.train.steps to train further, or pass a new --workdir"
        )
    return {
        "step": final_step,
        "eval_loss": eval_loss,
        "skipped": int(jax.device_get(state["skipped"])),
        "history": history,
        "loss_png": png,
        "workdir": os.path.abspath(workdir),
    }
