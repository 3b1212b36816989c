"""The live requests in each device's decode slots, and what each generated token does to them.

``rows[d][i]`` is the request in slot i of device d. Live slots are always the first
``len(rows[d])`` of a device: when one finishes, the device's last live slot moves into the hole
(compaction), so decode[W] serves every live slot with W the smallest bucket >= max_d len(rows[d]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from laplace_jax.serve.request import Request


def read_if(requests: Iterable[Request], *calls: tuple) -> tuple:
    """The device's logprob outputs (one tuple per call, joined along the positions) on the host
    if any of ``requests`` uses them, else Nones (a device-to-host copy saved on every call that
    nobody reads)."""
    if any(r.wants_logprobs for r in requests):
        return tuple(np.concatenate([np.asarray(c[i]) for c in calls]) for i in range(len(calls[0])))
    return None, None, None


def accept(req: Request, token: int, scored: Any) -> str | None:
    """Count one generated token and its (logprob, top ids, top logprobs) (False when no live
    request asked for them); return the finish reason it causes (stop tokens are not emitted,
    nor their logprobs)."""
    req.generated += 1
    req.sampled.append(token)
    if token in req.stops:
        return "stop"
    if scored:
        lp, top_ids, top_lp = scored
        req.cumulative_logprob += lp
        k = req.sampling.logprobs
        if k is not None:
            req.logprobs.append((lp, top_ids[:k].tolist(), top_lp[:k].tolist()))
    if req.generated >= req.sampling.max_tokens:
        return "length"
    return None


class Slots:
    """``per_device`` decode slots on each of ``n_devices`` devices: which request is in which
    slot (host bookkeeping; the runner moves the slot states as ``free`` plans)."""

    def __init__(self, n_devices: int, per_device: int):
        self.per_device = per_device
        self.rows: list[list[Request]] = [[] for _ in range(n_devices)]

    def occupancy(self) -> list[int]:
        """Live slots per device."""
        return [len(r) for r in self.rows]

    def live(self) -> list[Request]:
        return [r for rows in self.rows for r in rows]

    def free_devices(self) -> list[tuple[int, int]]:
        """(live slots, device) of every device with a free slot, least loaded (then lowest index) first."""
        return sorted((len(rows), d) for d, rows in enumerate(self.rows) if len(rows) < self.per_device)

    def clear(self) -> list[Request]:
        """Forget every slot (the buffers are rebuilt or reused); the requests that were live."""
        live, self.rows = self.live(), [[] for _ in self.rows]
        return live

    def collect(self, toks: np.ndarray, valid: np.ndarray, lps: tuple[tuple, ...]) -> tuple[dict, dict]:
        """Hand one step's decode tokens ([positions, devices, width]; a row's real ones, marked by
        ``valid``, in order, possibly with gaps: a speculative step emits 1 .. K + 1; ``lps``: each
        call's logprobs) to their requests. Returns ({d: finished slots}, {d: [(slot, request)]
        that finished with "stop" or "length"})."""
        lp, top_ids, top_lp = read_if(self.live(), *lps)
        done: dict[int, list[int]] = {}
        ended: dict[int, list[tuple[int, Request]]] = {}
        for d, rows in enumerate(self.rows):
            for i, req in enumerate(rows):
                out, reason = [], None
                for k in np.flatnonzero(valid[:, d, i]):
                    t = int(toks[k, d, i])
                    scored = lp is not None and (float(lp[k, d, i]), top_ids[k, d, i], top_lp[k, d, i])
                    reason = accept(req, t, scored)
                    if reason != "stop":
                        out.append(t)
                    if reason:
                        break
                if out or reason:
                    req.send(out, reason)
                if reason:
                    done.setdefault(d, []).append(i)
                if reason in ("stop", "length") and not req.cancelled:
                    ended.setdefault(d, []).append((i, req))
        return done, ended

    def free(self, idx: dict[int, list[int]]) -> list[dict[int, tuple[int, int]]]:
        """Drop the given slots per device, moving each device's last live slot into a hole.
        Returns the moves to run in order, one (src, dst) per device per call."""
        per_device: dict[int, list[tuple[int, int]]] = {}
        for d, slots in idx.items():
            rows = self.rows[d]
            for i in sorted(slots, reverse=True):
                last = len(rows) - 1
                if i != last:
                    per_device.setdefault(d, []).append((last, i))
                    rows[i] = rows[last]
                rows.pop()
        rounds = max((len(m) for m in per_device.values()), default=0)
        return [{d: m[k] for d, m in per_device.items() if k < len(m)} for k in range(rounds)]

    def cancelled(self) -> dict[int, list[int]]:
        """End cancelled requests with "abort"; their slots per device (to ``free``)."""
        gone: dict[int, list[int]] = {}
        for d, rows in enumerate(self.rows):
            for i, r in enumerate(rows):
                if r.cancelled:
                    r.send([], "abort")
                    gone.setdefault(d, []).append(i)
        return gone
