"""Which token automata occupy which rows of the device's grammar table (host bookkeeping).

The table ([rows, V], ``slot_programs``) holds the automata of the live constrained requests,
each in a contiguous run of rows; requests with the same automaton share one run (a host
grammar's request has its own pair of rows: its key is the request's). A run stays
after its requests end (the next request with that constraint needs no write) until its rows are
needed: then the least recently used runs that no live request uses are dropped.
"""

from __future__ import annotations

import collections
from collections.abc import Collection

import numpy as np

from laplace_jax.serve.request import Request
from laplace_jax.serve.structured import HostGrammar, TokenAutomaton, at_rows


class GrammarPool:
    def __init__(self, rows: int):
        self.rows = rows
        self.runs: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()  # key -> (base, n)
        self.users: dict[str, set[Request]] = {}
        self.unwritten: dict[
            str, TokenAutomaton | HostGrammar
        ] = {}  # runs placed whose rows the device does not hold yet

    def used_rows(self) -> int:
        return sum(n for _, n in self.runs.values())

    def acquire(self, a: TokenAutomaton | HostGrammar, user: Request, live: Collection[Request]) -> int | None:
        """The first row of ``a``'s run (placed if new: see ``writes``), or None when no room can
        be made (runs used by ``live`` requests are kept)."""
        if a.key in self.runs:
            self.runs.move_to_end(a.key)
            self.users[a.key] = {u for u in self.users[a.key] if u in live} | {user}
            return self.runs[a.key][0]
        base = self._room(a.states)
        while base is None:
            idle = [k for k in self.runs if not any(u in live for u in self.users[k])]
            if not idle:
                return None
            del self.runs[idle[0]], self.users[idle[0]]
            self.unwritten.pop(idle[0], None)
            base = self._room(a.states)
        self.runs[a.key] = (base, a.states)
        self.users[a.key] = {user}
        self.unwritten[a.key] = a
        return base

    def writes(self) -> list[tuple[int, np.ndarray]]:
        """(first row, rows) of every run placed since the last call, its states renumbered to
        table rows (negative entries kept): the device must write them."""
        out = []
        for k, a in self.unwritten.items():
            base = self.runs[k][0]
            out.append((base, at_rows(a.table, base)))
        self.unwritten.clear()
        return out

    def release(self, user: Request) -> None:
        """``user`` no longer holds its run (it was not admitted after all)."""
        for users in self.users.values():
            users.discard(user)

    def _room(self, n: int) -> int | None:
        """The first row of a free run of ``n`` rows (first fit), or None."""
        at = 0
        for base, size in sorted(self.runs.values()):
            if base - at >= n:
                return at
            at = base + size
        return at if self.rows - at >= n else None

    def clear(self) -> None:
        """Forget every run (the table was rebuilt)."""
        self.runs.clear()
        self.users.clear()
        self.unwritten.clear()
