"""What a training run records: metrics.jsonl and TensorBoard events, the loss plot, and the
per-step record (loss, norms, lr, tokens/s, MFU) behind the progress bar."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
from tqdm import tqdm

from laplace_jax.errors import UserError


class MetricsWriter:
    """JSONL (always) and TensorBoard event files (when tensorboardX is installed), process 0 only."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(os.path.join(workdir, "tb"))
            except ImportError:
                self.tb = None

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_loss(workdir: str) -> str | None:
    """workdir/loss.png from metrics.jsonl (train and eval loss against step)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    import matplotlib  # imported when plotting: slow to load, and the backend must be chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = [json.loads(line) for line in f]
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = os.path.join(workdir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class StepLog:
    """Turns each step's device metrics into a record: fetched one step late by the caller so the
    host never stalls the device; written every ``log_every`` steps and at ``end``; shown on a
    tqdm bar (process 0). Stops the run after ``max_nonfinite`` skipped steps in a row."""

    def __init__(
        self,
        writer: MetricsWriter,
        *,
        train: Any,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float,
        start: int,
        end: int,
        show: bool,
    ):
        self.writer, self.train, self.end = writer, train, end
        self.tokens_per_step, self.flops_per_step, self.peak_flops = tokens_per_step, flops_per_step, peak_flops
        self.history: list[dict[str, Any]] = []
        self.bar = tqdm(total=end, initial=start, desc="train", unit="step", disable=not show, mininterval=1.0)
        self._started: dict[int, float] = {}  # step -> when its batch was requested
        self._done: dict[int, float] = {}  # step -> when its result was seen ready
        self._last_done = 0.0

    def start(self, step: int) -> None:
        """Step ``step``'s work (its batch, then the dispatch) begins now."""
        self._started[step] = time.perf_counter()

    def dispatched(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Step ``step`` was handed to the devices. A backend that ran it inside the call (CPU
        often does) has it done already: its time ends here, not when it is next looked at."""
        if all(v.is_ready() for v in metrics.values()):
            self._done[step] = time.perf_counter()
        self.bar.update(1)

    def record(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Log step ``step``'s metrics (waits for that step only). Its time runs from when it could
        start (its batch requested, and the step before it done) to when it was done, so time spent
        between steps (evaluation, checkpoint writes) is nobody's step time."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        done = self._done.pop(step, time.perf_counter())
        seconds = done - max(self._started.pop(step), self._last_done)
        self._last_done = done
        tps = self.tokens_per_step / seconds if seconds > 0 else 0.0
        rec = {
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "update_norm": m["update_norm"],
            "lr": m["lr"],
            "tokens_per_s": tps,
            "mfu": self.flops_per_step / seconds / self.peak_flops if self.peak_flops and seconds > 0 else 0.0,
            "step_s": seconds,
            "skipped": int(not m["finite"]),
        }
        self.history.append({"step": step, **rec})
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{100 * rec['mfu']:.1f}%")
        if step % self.train.log_every == 0 or step == self.end:
            self.writer.write(step, rec)
        if m["nonfinite"] >= self.train.max_nonfinite:
            raise UserError(
                f"{int(m['nonfinite'])} non-finite steps in a row at step {step} (loss {m['loss']}); the last good "
                f"state is checkpointed. Lower opt.lr or opt.clip_norm, or check the data; then resume"
            )

    def note(self, text: str) -> None:
        """A line on the console above the progress bar (process 0)."""
        if not self.bar.disable:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
