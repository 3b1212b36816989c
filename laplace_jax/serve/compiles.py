"""XLA compilations counted from JAX's own monitoring events, not from our own bookkeeping.

JAX records ``/jax/core/compile/backend_compile_duration`` (with ``fun_name``) every time a
computation goes to the backend compiler, eager ops included; a persistent-cache hit still
passes through there (it is counted, and also shows as ``/jax/compilation_cache/cache_hits``).
One process-wide listener fans each event out to the ``CompileCounter``s whose owner thread ran
the compile, so two engines (or a test computing references on its main thread) never mix.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_counters: weakref.WeakSet[CompileCounter] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    tid = threading.get_ident()
    for counter in list(_counters):
        counter._record(tid, str(kwargs.get("fun_name", "?")), duration)


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _installed = True


class CompileCounter:
    """Counts compiles that run on the owner's thread, keyed by (phase, JAX function name).

    ``claim_thread()`` makes the calling thread the owner; ``phase`` labels what follows
    (``warmup`` or ``serving``). ``on_compile(phase, fun_name, seconds)`` is called per event.
    """

    def __init__(self, on_compile: Callable[[str, str, float], None] | None = None):
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.phase = "warmup"
        self.on_compile = on_compile
        self._owner: int | None = None
        self._lock = threading.Lock()
        _install()
        _counters.add(self)

    def claim_thread(self) -> None:
        self._owner = threading.get_ident()

    def total(self, phase: str | None = None) -> int:
        with self._lock:
            return sum(n for (p, _), n in self.counts.items() if phase is None or p == phase)

    def _record(self, thread_id: int, fun_name: str, seconds: float) -> None:
        if thread_id != self._owner:
            return
        with self._lock:
            self.counts[(self.phase, fun_name)] += 1
        if self.on_compile is not None:
            self.on_compile(self.phase, fun_name, seconds)
