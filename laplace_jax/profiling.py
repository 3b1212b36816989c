"""Device traces with ``jax.profiler`` for train.py (chosen steps) and serve.py (a window the
client opens and closes), viewable in TensorBoard's profile tab or XProf:

    python train.py --config configs/tiny.py --profile_steps 10:12   # into <workdir>/tb
    tensorboard --logdir runs/tiny/tb                                # the "profile" tab

A trace is ``<directory>/plugins/profile/<run>/<host>.xplane.pb`` (the layout both tools read).
"""

from __future__ import annotations

import glob
import os
import re
import threading
from typing import Any

import jax

from laplace_jax.errors import UserError


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): trace the steps numbered A to B in the log, both included (A >= 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UserError(f"--profile_steps is FIRST:LAST, steps as the log numbers them (e.g. 10:12); got {text!r}")
    return int(m.group(1)), int(m.group(2))


def trace_files(directory: str) -> list[str]:
    """Every trace file under ``directory``, oldest first."""
    return sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.xplane.pb")), key=os.path.getmtime)


class Trace:
    """One ``jax.profiler`` trace at a time into ``directory`` (thread-safe: serving's HTTP handlers)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.active = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.active:
                raise UserError("a profile trace is already running; stop it first")
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True

    def stop(self) -> str:
        """End the trace; the path of the file it wrote."""
        with self._lock:
            if not self.active:
                raise UserError("no profile trace is running; start one first")
            jax.profiler.stop_trace()
            self.active = False
            return trace_files(self.directory)[-1]


class StepTrace:
    """Trace steps ``first`` to ``last`` of a loop: call ``before(step)`` ahead of dispatching a
    step and ``after(step, outputs)`` once it is dispatched; the trace ends when the last traced
    step's outputs are ready, so it holds that step's device work."""

    def __init__(self, directory: str, first: int, last: int, log: Any = print):
        self.trace, self.first, self.last, self.log = Trace(directory), first, last, log

    def before(self, step: int) -> None:
        if step == self.first:
            self.trace.start()

    def after(self, step: int, outputs: Any) -> None:
        if step == self.last and self.trace.active:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """End a trace still running (the loop stopped early); nothing otherwise."""
        if self.trace.active:
            path = self.trace.stop()
            self.log(f"profile of steps {self.first}-{self.last}: {path} (tensorboard --logdir {self.trace.directory})")
