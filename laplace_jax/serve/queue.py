"""The admission queue: request groups waiting for slots in arrival order, with the engine thread's
condition variable, the drain deadline and the stop flag. Every method is thread-safe."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable

from laplace_jax.errors import QueueFullError
from laplace_jax.serve.request import Request


class WaitQueue:
    """Groups (requests sharing one prompt) in arrival order, at most ``max_queue`` requests."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.cv = threading.Condition()
        self._groups: collections.deque[list[Request]] = collections.deque()
        self.draining = False  # no new requests
        self.stopped = False  # the engine loop ends
        self.deadline = math.inf  # drain deadline (perf_counter): then every request ends with "shutdown"

    def __len__(self) -> int:
        """Requests waiting."""
        return sum(len(g) for g in self._groups)

    def put(self, group: list[Request]) -> None:
        """Queue a group; ``QueueFullError`` while draining or when it does not fit."""
        with self.cv:
            if self.draining:
                raise QueueFullError("the server is shutting down")
            waiting = len(self)
            if waiting + len(group) > self.max_queue:
                raise QueueFullError(f"{waiting} requests already waiting")
            self._groups.append(group)
            self.cv.notify()

    def cancel(self, requests: Iterable[Request]) -> None:
        """Mark ``requests`` cancelled; a group whose members all are leaves the queue with "abort"."""
        with self.cv:
            for r in requests:
                r.cancelled = True
            gone = [g for g in self._groups if all(r.cancelled for r in g)]
            for g in gone:
                self._groups.remove(g)
        for g in gone:
            for r in g:
                r.send([], "abort")

    def take(
        self, free: list[tuple[int, int]], per_device: int, admit: Callable[[list[Request]], bool] = bool
    ) -> dict[int, list[Request]]:
        """Up to one group per device of ``free`` ((live slots, device), least loaded first) that
        has room for it and that ``admit`` lets in (it reserves what else the group needs), in
        arrival order: a group that fits nowhere yet waits, and so does everything behind it.
        Fully cancelled groups met on the way end with "abort"."""
        placed: dict[int, list[Request]] = {}
        with self.cv:
            for used, d in free:
                while self._groups and not self.stopped:
                    group = self._groups[0]
                    if all(r.cancelled for r in group):
                        self._groups.popleft()
                        for r in group:
                            r.send([], "abort")
                        continue
                    if len(group) <= per_device - used and admit(group):
                        placed[d] = self._groups.popleft()
                    break
        return placed

    def pop_all(self) -> list[Request]:
        """Empty the queue; its requests, in order."""
        with self.cv:
            waiting, self._groups = [r for g in self._groups for r in g], collections.deque()
        return waiting

    def drain(self, timeout: float) -> None:
        """Refuse new requests; ``timeout`` s from now, the engine ends whatever still runs."""
        with self.cv:
            self.draining = True
            self.deadline = min(self.deadline, time.perf_counter() + max(timeout, 0.0))
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify()

    def wait_for_work(self, idle: Callable[[], bool]) -> bool:
        """Block while ``idle()`` and not stopped; False once stopped."""
        with self.cv:
            while not self.stopped and idle():
                self.cv.wait(0.1)
            return not self.stopped
