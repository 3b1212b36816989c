"""The serving engine's decisions, apart from executing them: ``Scheduler.schedule()`` returns a
``StepPlan`` (``plan.py``), a runner executes it on the device programs (``runner.py``) and
``Scheduler.update(plan, outputs)`` closes the step. Everything here is host logic: it runs, and
is unit-tested, without a model or a compile.

Each plan first runs the slot operations the previous update left (snapshots of finished slots
for the prefix cache, then compaction moves), then admits or decodes. Admission prefills up to
one waiting group per device in one call, the least-loaded devices first, while any fits; a group
shares one prompt: it is prefilled once and its state copied into one slot per member. Otherwise,
one decode call serves every live slot at the smallest bucket that fits. When a joint prefill
fails, each of its groups is retried alone and only a group that fails alone is ended with an
error. With a prefix-state cache (``prefix_cache.py``), a prompt resumes from its longest cached
prefix and prefills only the rest; the prefill leaves block entries and a request that finishes
("stop" or "length") leaves its final state. Prompts that ask for prompt logprobs are scored in
full (every position is needed).

Structured outputs: a constrained request's automaton is placed in the device's grammar table
before its prefill (``grammar_pool.py``); a group waits while the live requests' automata leave
no room. A host grammar (``structured.HostGrammar``) gets a matcher here and a pair of rows of its
own: each update feeds the matcher the tokens its request sampled (one per call: the row waits in
the other row of its pair after each token) and plans the next mask's write before the next call.
A step whose live rows all wait on the host runs a decode call of one step, not
``steps_per_call`` (the call's later steps skip the model); a step with other rows too runs two
calls, one step and then ``steps_per_call``: the host's next masks (``early_masks``) are computed
from the first call's tokens while the device runs the second, so the host rows still sample
once per step and the device does not wait for their masks. A host grammar that allows no token
ends its request with an error, never an unconstrained sample.
"""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from laplace_jax.serve.grammar_pool import GrammarPool
from laplace_jax.serve.host_rows import HostRows
from laplace_jax.serve.plan import Admission, Move, Snapshot, StepOutput, StepPlan, generating
from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES, PrefixCache
from laplace_jax.serve.queue import WaitQueue
from laplace_jax.serve.request import MAX_SEED, Request, row_params, stop_ids
from laplace_jax.serve.slots import Slots, accept, read_if
from laplace_jax.serve.structured import HostGrammar, TokenAutomaton

if TYPE_CHECKING:  # a type only: eval runs the engine without metrics
    from laplace_jax.serve.metrics import ServeMetrics


def make_buckets(spec: str | list[int], max_num_seqs: int) -> list[int] | None:
    """Powers of two up to max_num_seqs plus max_num_seqs itself; an explicit list; or None (exact)."""
    if spec == "exact":
        return None
    if spec == "pow2":
        widths = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    else:
        try:
            widths = {int(w) for w in spec}
        except ValueError:
            raise ValueError(
                f"decode buckets are 'pow2', 'exact' or widths like 1,4,8; got {','.join(spec)!r}"
            ) from None
        if not widths or min(widths) < 1 or max(widths) > max_num_seqs:
            raise ValueError(f"decode buckets must lie in 1..{max_num_seqs}; got {sorted(widths)}")
    return sorted(widths | {max_num_seqs})


def prefix_cache(budget: int, block: int | None, prefill_chunk: int, kernel_chunk: int, entry_bytes: int, devices: int):
    """The PrefixCache for ``budget`` bytes per device, or None when the budget holds no entry (no
    lookups, no hashing per request). ``block`` defaults to the lcm of the kernel's chunk
    (``model.chunk_size``) and ``prefill_chunk`` and must be a multiple of it, so a resumed prompt
    is cut into the same prefill calls and the same kernel chunks."""
    unit = math.lcm(kernel_chunk, prefill_chunk)
    block = block or unit
    if block % unit:
        raise ValueError(
            f"--prefix-block must be a multiple of {unit} (the model's {kernel_chunk}-token kernel chunk and the "
            f"{prefill_chunk}-token prefill chunk); got {block}"
        )
    entry_bytes += ENTRY_OVERHEAD_BYTES
    return PrefixCache(budget, entry_bytes, block, devices) if budget >= entry_bytes else None


class Scheduler:
    """The host side of serving on ``devices`` devices with ``per_device`` slots each: the wait
    queue, the slots and the prefix cache's bookkeeping, and the plan of every step."""

    def __init__(
        self,
        *,
        devices: int,
        per_device: int,
        vocab_size: int,
        eos_id: int,
        buckets: list[int] | None,
        steps_per_call: int,
        max_queue: int,
        prng: str,
        prefix: PrefixCache | None,
        grammar_rows: int,
        metrics: ServeMetrics | None = None,
        one_step: bool = True,
    ):
        """``one_step``: steps with rows under a host grammar run calls of one step (see the module
        doc; off: one call of ``steps_per_call`` per step, the masks computed between calls)."""
        self.vocab_size, self.eos_id, self.prng, self.metrics = vocab_size, eos_id, prng, metrics
        self.buckets, self.steps_per_call, self.prefix = buckets, steps_per_call, prefix
        self.one_step = one_step and steps_per_call > 1
        self.queue = WaitQueue(max_queue)
        self.slots = Slots(devices, per_device)
        self._slot_ops: list[Snapshot | Move] = []  # left by the last update, run first by the next plan
        self._retry: collections.deque[dict[int, list[Request]]] = collections.deque()  # groups to prefill alone
        self._seeds = np.random.default_rng()
        self._reserved: set[Request] = set()
        self.grammar = GrammarPool(grammar_rows)  # the device's structured-output table rows
        self.hosts = HostRows(eos_id)  # live requests under a host grammar

    def bucket_for(self, n: int) -> int:
        return n if self.buckets is None else next(w for w in self.buckets if w >= n)

    def idle(self) -> bool:
        return not any(self.slots.rows) and not len(self.queue) and not self._retry and not self._slot_ops

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return sum(self.slots.occupancy()), len(self.queue) + sum(len(g) for p in self._retry for g in p.values())

    # ----- deciding -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step: the pending slot operations, then an admission if a waiting group fits,
        else a decode of every live slot. At the drain deadline everything ends ("shutdown")."""
        if time.perf_counter() >= self.queue.deadline:
            self.end_all("shutdown")
            return StepPlan()
        self._slot_ops += [Move(m) for m in self.slots.free(self.slots.cancelled())]
        ops, self._slot_ops = tuple(self._slot_ops), []
        if self._retry:
            placed = self._retry.popleft()
        else:
            self._reserved = set()  # members let in by this take (their rows are in use)
            placed = self.queue.take(self.slots.free_devices(), self.slots.per_device, self._grammar_room)
        if placed:
            adm = self._admission(placed)
            return StepPlan(ops, admission=adm, grammar_writes=self._writes())
        live = self.slots.occupancy()
        if any(live):
            width = self.bucket_for(max(live))
            S = self.steps_per_call
            steps = self.hosts.calls(self.slots.live(), S) if self.one_step else (S,)
            return StepPlan(
                ops, decode_width=width, live=tuple(live), grammar_writes=self._writes(), decode_steps=steps
            )
        return StepPlan(ops, grammar_writes=self._writes())

    def _writes(self) -> tuple[tuple[int, np.ndarray], ...]:
        """The grammar-table writes due before the next device call: the live host grammars' next
        masks, then the runs placed (a row a just-ended request held may be placed again)."""
        live = set(self.slots.live())
        return (*self.hosts.due(live), *self.grammar.writes())

    def _run(self, r: Request, lead: bool) -> TokenAutomaton | HostGrammar | None:
        """What ``r`` holds in the grammar table: its automaton, or its host grammar's own pair of
        rows (its first mask after the lead when ``lead``)."""
        a = r.sampling.automaton
        return self.hosts.run(r, lead) if isinstance(a, HostGrammar) else a

    def _grammar_room(self, group: list[Request]) -> bool:
        """Reserve grammar-table rows for a group's constrained members; False (nothing reserved)
        while the live requests' automata leave no room: the group waits."""
        live, lead = set(self.slots.live()) | self._reserved, bool(jump_lead(group, self.eos_id))
        for r in group:
            if r.sampling.automaton is not None and self.grammar.acquire(self._run(r, lead), r, live) is None:
                for m in group:
                    self.grammar.release(m)
                return False
            live.add(r)
        self._reserved.update(group)
        return True

    def _grammar_rows(self, placed: dict[int, list[Request]]) -> dict[Request, int]:
        """Each constrained member's first grammar state (a table row; placed again if the table was
        rebuilt since ``_grammar_room``: a retried group after a device-loop failure)."""
        rows, live = {}, set(self.slots.live()) | {r for g in placed.values() for r in g}
        for group in placed.values():
            lead = jump_lead(group, self.eos_id)
            for r in (r for r in group if r.sampling.automaton is not None):
                a = r.sampling.automaton
                row = self.grammar.acquire(self._run(r, bool(lead)), r, live)
                if row is None:
                    raise RuntimeError("no room in the structured-output table")
                if isinstance(a, HostGrammar):
                    self.hosts.add(r, row, len(lead))
                rows[r] = row + (a.lead_state if lead and isinstance(a, TokenAutomaton) else 0)
        return rows

    def _admission(self, placed: dict[int, list[Request]]) -> Admission:
        """Prefill the placed groups' prompts (from their longest cached prefixes) and give each
        member that generates a slot after the device's live ones, with its sampling row."""
        now = time.perf_counter()
        for r in (r for g in placed.values() for r in g):
            r.started_at = now
            r.stops = frozenset(stop_ids(r.sampling, self.eos_id))
        score = any(r.sampling.prompt_logprobs is not None for g in placed.values() for r in g)
        leads = {d: jump_lead(g, self.eos_id) for d, g in placed.items()}
        prompts = {d: [*g[0].prompt_ids, *leads[d]] for d, g in placed.items()}
        starts, keep = self.prefix.plan(prompts) if self.prefix is not None and not score else ({}, {})
        members = generating(placed)
        grammar_rows = self._grammar_rows(placed)
        inserts = []
        for k in range(max(len(m) for m in members.values())):  # member k of every group, one insert
            where = {}
            for d, m in members.items():
                if k < len(m):
                    seed = m[k].sampling.seed
                    if seed is None:
                        seed = int(self._seeds.integers(0, MAX_SEED, endpoint=True))
                    row = row_params(m[k], self.vocab_size, self.eos_id, seed, self.prng, generated=len(leads[d]))
                    row["gstate"] = np.int32(grammar_rows.get(m[k], -1))
                    row["history"] = np.asarray(prompts[d], np.int32)  # speculation's look-up text
                    where[d] = (len(self.slots.rows[d]) + k, row)
            inserts.append(where)
        return Admission(placed, prompts, leads, score, starts, keep, inserts)

    # ----- closing a step -----------------------------------------------------------------
    def update(self, plan: StepPlan, out: StepOutput) -> None:
        """Hand a step's outputs to their requests and plan the slot operations they need."""
        snapshots = [op for op in plan.slot_ops if isinstance(op, Snapshot)]
        for op, states in zip(snapshots, out.snapshots, strict=True):
            for d, state in states.items():
                self.prefix.put_end(op.ids[d], d, state)
        if plan.admission is not None:
            self._admitted(plan.admission, out)
        if out.decoded is not None:
            self._decoded(*out.decoded)
        if self.hosts:
            self._host_masks()

    def early_masks(self, toks: np.ndarray, valid: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """The live host-grammar rows' next masks from the first call of a two-call step (its
        tokens and valid flags [K, D, W] on the host), for the runner to write while the second
        call runs (in which these rows wait). ``update`` then finds their tokens fed, and ends a
        row whose grammar allows no token after delivering its token."""
        return self.hosts.early(self.slots.rows, toks, valid)

    def _host_masks(self) -> None:
        """Feed each live host-grammar request's new tokens to its matcher and plan its next mask;
        end a request whose grammar allows no token next."""
        stuck: dict[int, list[int]] = {}
        for r in self.hosts.feed(set(self.slots.live())):
            d = next(d for d, rows in enumerate(self.slots.rows) if r in rows)
            stuck.setdefault(d, []).append(self.slots.rows[d].index(r))
            r.fail(f"structured_outputs: the grammar allows no token after {len(r.sampled)} generated")
        if stuck:
            self._slot_ops += [Move(m) for m in self.slots.free(stuck)]

    def _admitted(self, adm: Admission, out: StepOutput) -> None:
        if out.prefill_error is not None:
            if len(adm.groups) == 1:
                for r in adm.requests():
                    r.fail(f"this request failed during prefill: {out.prefill_error}")
            else:  # isolate the failing group(s): each is prefilled alone, ahead of the queue
                self._retry.extend({d: g} for d, g in adm.groups.items())
            return
        for d, n, state in out.blocks:
            self.prefix.put_block(adm.keep[d][n], n, d, state)
        for d, group in adm.groups.items():
            for r in group:
                k = r.sampling.prompt_logprobs
                if k is not None:
                    r.prompt_logprobs = [e and (e[0], e[1][:k], e[2][:k]) for e in out.scores[d]]
            for r in group:
                if r.sampling.max_tokens == 0:  # the prompt's scores are all it asked for
                    r.send([], "length")
        members = generating(adm.groups)
        finished: dict[int, list[int]] = {}
        for k, (first, lps) in enumerate(out.first):
            ranked = {d: m[k] for d, m in members.items() if k < len(m)}
            lp, top_ids, top_lp = read_if(ranked.values(), lps)
            now = time.perf_counter()
            for d, req in ranked.items():
                tok = int(first[d])
                req.first_token_at = now
                if self.metrics is not None:
                    self.metrics.on_first_token(req)
                lead = adm.leads[d]  # jump-forward: generated with the prompt (no logprobs were asked for)
                for t in lead:
                    accept(req, t, False)
                reason = accept(req, tok, lp is not None and (float(lp[d]), top_ids[d], top_lp[d]))
                req.send([*lead, *([] if reason == "stop" else [tok])], reason)
                self.slots.rows[d].append(req)  # the slot the plan gave it
                if reason is not None:
                    finished.setdefault(d, []).append(len(self.slots.rows[d]) - 1)
        self._slot_ops += [Move(m) for m in self.slots.free(finished)]

    def _decoded(self, toks: np.ndarray, valid: np.ndarray, lps: tuple) -> None:
        done, ended = self.slots.collect(toks, valid, lps)
        if ended and self.prefix is not None:  # their final states, before compaction moves them
            while ended:
                now = {d: items.pop() for d, items in ended.items()}
                ended = {d: items for d, items in ended.items() if items}
                ids = {d: np.asarray(r.prompt_ids + r.sampled[:-1], np.int32) for d, (_, r) in now.items()}
                self._slot_ops.append(Snapshot({d: i for d, (i, _) in now.items()}, ids))
        if done:
            self._slot_ops += [Move(m) for m in self.slots.free(done)]

    # ----- ending ---------------------------------------------------------------------------
    def end_all(self, reason: str, message: str | None = None) -> None:
        """End every waiting and live request with ``reason`` ("error": fail with ``message``)."""
        waiting = [r for p in self._retry for g in p.values() for r in g] + self.queue.pop_all()
        self._retry.clear()
        self._slot_ops = []
        for r in [*self.slots.clear(), *waiting]:
            if reason == "error":
                r.fail(message or "the engine failed")
            else:
                r.send([], reason)

    def reset(self, message: str, plan: StepPlan | None) -> None:
        """After a device-loop failure (the slot buffers are rebuilt): fail the live requests and
        those ``plan`` was admitting; forget pending slot operations and the prefix cache's
        entries. Waiting requests stay queued."""
        admitting = plan.admission.requests() if plan is not None and plan.admission is not None else []
        for r in [*self.slots.clear(), *admitting]:
            r.fail(message)
        self._slot_ops = []
        self.grammar.clear()
        self.hosts.clear()
        if self.prefix is not None:
            self.prefix.clear()


def jump_lead(group: list[Request], eos_id: int) -> tuple[int, ...]:
    """Jump-forward: the tokens the group's constraint forces at the output's start, fed with its
    prompt's prefill instead of one decode step each; none where they would change what a member
    sees (logprobs, best_of's ranking, penalties, a stop token among them, max_tokens)."""
    a = group[0].sampling.automaton
    if a is None or not a.lead:
        return ()
    for r in group:
        sp = r.sampling
        if (
            sp.automaton is not a
            or r.wants_logprobs
            or sp.prompt_logprobs is not None
            or len(a.lead) >= sp.max_tokens
            or (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) != (0.0, 0.0, 1.0)
            or set(a.lead) & set(stop_ids(sp, eos_id))
        ):
            return ()
    return a.lead
