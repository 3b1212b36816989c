"""What one engine step does, as data: the scheduler's ``StepPlan``, the runner's ``StepOutput``.

A step runs its ``slot_ops`` (snapshots of finished slots for the prefix cache, then compaction
moves, in order), then either an ``Admission`` (one prefill of up to one group per device, then
one insert per member rank) or one decode call at ``decode_width``. Device states appear here only
as opaque handles (a prefix-cache entry's state, a snapshot): the scheduler never looks inside.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from laplace_jax.serve.request import Request


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Copy out local slot ``slots[d]``'s model state on each device d; ``ids[d]``: what that
    state is the state after (the prompt and the generated ids fed back), its prefix-cache key."""

    slots: dict[int, int]
    ids: dict[int, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Move:
    """Per device d, copy local slot ``moves[d][0]`` into ``moves[d][1]`` (compaction)."""

    moves: dict[int, tuple[int, int]]


def generating(groups: dict[int, list[Request]]) -> dict[int, list[Request]]:
    """Each device's group members that generate (``max_tokens`` 0 only scores the prompt and gets
    no slot); an ``Admission``'s ``inserts[k]`` holds member k of each."""
    return {d: [r for r in g if r.sampling.max_tokens > 0] for d, g in groups.items()}


@dataclasses.dataclass(frozen=True)
class Admission:
    """Prefill ``prompts[d]`` (``groups[d][0]``'s prompt, then ``leads[d]``: the tokens its
    constraint forces at the output's start, emitted as generated) on device d (all devices in one
    call), then copy the state into one slot per member: ``inserts[k][d] = (slot, sampling row)``
    for member rank k.

    ``starts[d] = (ids restored, state)``: row d resumes from a prefix-cache entry. ``keep[d]``:
    {ids done: block digest} of the block states to keep (the prefix cache's block entries).
    ``score``: score every prompt position (prompt logprobs; never resumed)."""

    groups: dict[int, list[Request]]
    prompts: dict[int, list[int]]
    leads: dict[int, tuple[int, ...]]
    score: bool
    starts: dict[int, tuple[int, Any]]
    keep: dict[int, dict[int, bytes]]
    inserts: list[dict[int, tuple[int, dict[str, np.ndarray]]]]

    def requests(self) -> list[Request]:
        return [r for g in self.groups.values() for r in g]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step: ``grammar_writes`` ((first row, rows) into the structured-output table: automata
    placed, host grammars' next masks) and ``slot_ops`` in order, then ``admission`` or a decode at
    ``decode_width`` (``live``: the live slots per device it serves) of one call per entry of
    ``decode_steps`` (its steps; with two, the host grammars' next masks are written between them)."""

    slot_ops: tuple[Snapshot | Move, ...] = ()
    admission: Admission | None = None
    decode_width: int | None = None
    live: tuple[int, ...] = ()
    grammar_writes: tuple[tuple[int, np.ndarray], ...] = ()
    decode_steps: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.slot_ops or self.admission or self.decode_width or self.grammar_writes)


@dataclasses.dataclass
class StepOutput:
    """What the runner read back for a plan.

    ``snapshots``: one {device: state} per ``Snapshot`` op, in order. ``prefill_error``: why the
    admission's prefill failed (nothing was inserted). ``blocks``: (device, ids done, state) of
    the kept block states. ``scores[d]``: device d's prompt logprobs (``score``). ``first[k]``:
    member rank k's first tokens [D] and their (logprob [D], top ids [D, k], top logprobs [D, k]).
    ``decoded``: the decode calls' tokens and valid flags [K, D, W] (the calls' positions in
    order) and each call's logprobs (on the device: ``slots.read_if`` reads them)."""

    snapshots: list[dict[int, Any]] = dataclasses.field(default_factory=list)
    prefill_error: str | None = None
    blocks: list[tuple[int, int, Any]] = dataclasses.field(default_factory=list)
    scores: dict[int, list] | None = None
    first: list[tuple[np.ndarray, tuple]] = dataclasses.field(default_factory=list)
    decoded: tuple[np.ndarray, np.ndarray, tuple] | None = None
