"""The scheduler's requests under a host grammar (``structured.HostGrammar``): a matcher each, a
pair of grammar-table rows of its own (in turn the current mask, whose allowed tokens lead to the
other row, and the waiting row), and the writes of their next masks.

Host logic only (no device, no compile): the scheduler feeds each request's sampled tokens here
after a decode call (``feed``), or from the first call of a two-call step (``early``), and puts
the writes ``due`` into its next plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection
from typing import Any

import numpy as np

from laplace_jax.serve.request import Request
from laplace_jax.serve.structured import HostGrammar, at_rows, mask_rows

Write = tuple[int, np.ndarray]  # (first table row, rows [N, V])


@dataclasses.dataclass(eq=False)
class HostRow:
    """A request under a host grammar: its matcher, its pair of table rows (``base``, ``base`` + 1;
    ``current``: the one holding the mask the device samples from next), the tokens fed so far,
    and whether its grammar allows no token next (``stuck``: the request is ended)."""

    grammar: HostGrammar
    matcher: Any
    base: int
    current: int = 0
    consumed: int = 0
    stuck: bool = False

    def feed(self, tokens: list[int], eos_id: int) -> list[Write]:
        """Feed ``tokens``: the write of the next mask (none when no token is allowed or the matcher
        failed: ``stuck``). An EOS in an accepting state is not fed (``ignore_eos`` samples it
        again: the mask stays)."""
        if not tokens:
            return []
        for t in tokens:
            if not (t == eos_id and self.matcher.is_accepting()):
                self.matcher.consume_token(t)
        allowed = None if self.matcher.is_error() else self.grammar.allowed(self.matcher)
        if allowed is None or not allowed.any():
            self.stuck = True
            return []
        self.current = 1 - self.current
        return [(self.base, at_rows(mask_rows(allowed, self.current), self.base))]


class HostRows:
    """The live requests under a host grammar, by request."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id
        self.rows: dict[Request, HostRow] = {}
        self._runs: dict[Request, HostGrammar] = {}  # each request's own pair of rows (a key of its own)
        self._ids = itertools.count()
        self._due: dict[Request, Write] = {}  # next masks, for the next plan

    def __contains__(self, r: Request) -> bool:
        return r in self.rows

    def __bool__(self) -> bool:
        return bool(self.rows)

    def calls(self, live: list[Request], steps_per_call: int) -> tuple[int, ...]:
        """A decode step's calls, each its steps: ``steps_per_call`` without live host rows; one
        step when every live row is one; else one step, then ``steps_per_call`` (the next masks
        computed from the first while the second runs: ``early``)."""
        hosts = sum(r in self.rows for r in live) if self.rows else 0
        return (steps_per_call,) if not hosts else (1,) if hosts == len(live) else (1, steps_per_call)

    def run(self, r: Request, lead: bool) -> HostGrammar:
        """``r``'s own pair of rows in the grammar table (its first mask after the lead when ``lead``)."""
        a = r.sampling.automaton
        assert isinstance(a, HostGrammar)
        if r not in self._runs:
            table = a.lead_table if lead else a.table
            self._runs[r] = dataclasses.replace(a, key=f"{a.key}:{next(self._ids)}", table=table)
        return self._runs[r]

    def add(self, r: Request, row: int, lead: int) -> None:
        """``r`` is admitted with its pair at ``row``, ``lead`` forced tokens already generated."""
        a = r.sampling.automaton
        self.rows[r] = HostRow(a, a.matcher(bool(lead)), row, consumed=lead)

    def early(self, slot_rows: list[list[Request]], toks: np.ndarray, valid: np.ndarray) -> list[Write]:
        """The next masks from a decode call's tokens and valid flags [K, D, W] (``slot_rows[d][i]``:
        the request in slot i of device d), before its tokens reach the requests; ``feed`` then
        finds them fed."""
        writes = []
        for d, rows in enumerate(slot_rows):
            for i, r in enumerate(rows):
                h = self.rows.get(r)
                if h is not None and not h.stuck:
                    new = toks[valid[:, d, i], d, i].tolist()
                    h.consumed += len(new)
                    writes += h.feed(new, self.eos_id)
        return writes

    def feed(self, live: Collection[Request]) -> list[Request]:
        """Forget the requests no longer ``live``; feed each live one the tokens it sampled since,
        keeping its next mask's write for ``due``. Returns the requests whose grammar allows no
        token next (to end)."""
        for r in [r for r in self.rows if r not in live]:
            del self.rows[r]
            self._runs.pop(r, None)
        stuck = []
        for r, h in self.rows.items():
            new, h.consumed = r.sampled[h.consumed :], len(r.sampled)
            for w in h.feed(new, self.eos_id):
                self._due[r] = w
            if h.stuck:
                stuck.append(r)
        return stuck

    def due(self, live: Collection[Request]) -> list[Write]:
        """The next masks of the ``live`` requests, to write before the next call (once)."""
        out = [w for r, w in self._due.items() if r in live]
        self._due = {}
        return out

    def clear(self) -> None:
        self.rows.clear()
        self._runs.clear()
        self._due = {}
