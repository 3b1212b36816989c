"""The scheduler against a fake runner: no model, no device program, no JAX compile.

The fake device keeps, per slot, the ids a sequence has consumed and its next token, and
generates by a fixed rule of the whole sequence (``rule``), so a slot state that a compaction
move, a prefix-cache restore or an insert got wrong shows up as a wrong token. Every test checks
each request's tokens against ``reference``, the rule run on its prompt alone.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from laplace_jax.errors import QueueFullError
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.plan import Move, Snapshot, StepOutput, StepPlan
from laplace_jax.serve.prefix_cache import PrefixCache
from laplace_jax.serve.request import Request, SamplingParams
from laplace_jax.serve.scheduler import Scheduler, make_buckets

V, EOS, K_TOP = 64, 0, 4


def rule(seq: list[int]) -> int:
    """The fake model's next token after ``seq`` (never EOS)."""
    return 1 + (7 * sum(seq) + 3 * len(seq)) % (V - 1)


def reference(prompt: list[int], n: int, stops: set[int] = frozenset()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        t = rule(seq)
        if t in stops:
            break
        out.append(t)
        seq.append(t)
    return out


class FakeRunner:
    """Executes plans on per-slot Python state, as ``runner.Runner`` does on the device programs."""

    def __init__(self, devices: int, per_device: int, steps: int):
        self.slots = [[None] * per_device for _ in range(devices)]
        self.D, self.steps = devices, steps
        self.bad_prompts: set[tuple[int, ...]] = set()  # their prefill raises
        self.fail_decode = False
        self.log: list[str] = []

    def execute(self, plan: StepPlan) -> StepOutput:
        out = StepOutput()
        for op in plan.slot_ops:
            if isinstance(op, Snapshot):
                self.log.append("snapshot")
                out.snapshots.append({d: tuple(self.slots[d][i]["seq"]) for d, i in op.slots.items()})
            else:
                self.log.append("move")
                for d, (s, t) in op.moves.items():
                    self.slots[d][t] = copy.deepcopy(self.slots[d][s])
        if plan.admission is not None:
            self._admit(plan.admission, out)
        if plan.decode_width is not None:
            if self.fail_decode:
                raise RuntimeError("the device is gone")
            out.decoded = self._decode(plan.decode_width)
        return out

    def _admit(self, adm, out: StepOutput) -> None:
        self.log.append(f"prefill{sorted(adm.groups)}")
        prompts = adm.prompts
        if any(tuple(p) in self.bad_prompts for p in prompts.values()):
            out.prefill_error = "ValueError: a bad prompt"
            return
        for d, (n, state) in adm.starts.items():
            assert state == tuple(prompts[d][:n]), "a prefix-cache restore must be the state after its ids"
        for d, keep in adm.keep.items():
            start = adm.starts.get(d, (0, None))[0]
            out.blocks += [(d, n, tuple(prompts[d][:n])) for n in keep if start < n <= len(prompts[d])]
        if adm.score:
            out.scores = {d: [None] + [(-1.0, [i] * K_TOP, [-1.0] * K_TOP) for i in p[1:]] for d, p in prompts.items()}
        for where in adm.inserts:
            self.log.append("insert")
            first = np.zeros((self.D,), np.int32)
            for d, (slot, row) in where.items():
                seq = list(prompts[d])
                first[d] = rule(seq)
                stops = set(np.flatnonzero(row["stop_mask"]))
                self.slots[d][slot] = {
                    "seq": seq,
                    "token": int(first[d]),
                    "left": int(row["remaining"]),
                    "stops": stops,
                }
            out.first.append((first, self._lps((self.D,))))

    def _decode(self, W: int):
        self.log.append(f"decode[{W}]")
        toks = np.zeros((self.steps, self.D, W), np.int32)
        valid = np.zeros((self.steps, self.D, W), bool)
        for d in range(self.D):
            for i in range(W):
                s = self.slots[d][i]
                for k in range(self.steps):
                    if s is None or s.get("done"):
                        break
                    s["seq"].append(s["token"])
                    s["token"] = rule(s["seq"])
                    s["left"] -= 1
                    toks[k, d, i], valid[k, d, i] = s["token"], True
                    s["done"] = s["token"] in s["stops"] or s["left"] <= 0
        return toks, valid, (self._lps((self.steps, self.D, W)),)

    @staticmethod
    def _lps(shape):
        return np.full(shape, -0.5, np.float32), np.zeros((*shape, K_TOP), np.int32), np.zeros((*shape, K_TOP))


class Served:
    """A request's emitted tokens and finish reason."""

    def __init__(self, prompt: list[int], **sampling):
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.req = Request(list(prompt), SamplingParams(temperature=0, **sampling), self.emit)

    def emit(self, tokens, reason):
        assert self.reason is None, "nothing is emitted after the finish reason"
        self.tokens += tokens
        self.reason = reason


def scheduler(devices=1, per_device=4, buckets="pow2", steps=2, max_queue=64, prefix=None, one_step=True) -> Scheduler:
    return Scheduler(
        devices=devices,
        per_device=per_device,
        vocab_size=V,
        eos_id=EOS,
        buckets=make_buckets(buckets, per_device),
        steps_per_call=steps,
        max_queue=max_queue,
        prng="threefry2x32",
        prefix=prefix,
        grammar_rows=64,
        one_step=one_step,
    )


def step(sched: Scheduler, runner: FakeRunner) -> StepPlan:
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    return plan


def run(sched: Scheduler, runner: FakeRunner, limit: int = 1000) -> None:
    for _ in range(limit):
        if sched.idle():
            return
        step(sched, runner)
    raise AssertionError("the scheduler did not become idle")


@pytest.fixture(autouse=True)
def no_compiles():
    counter = CompileCounter()
    counter.claim_thread()
    yield
    assert counter.total() == 0, "the scheduler compiled something"


def prompt(i: int, n: int = 5) -> list[int]:
    return [1 + (i * 13 + j) % (V - 1) for j in range(n)]


def test_every_request_gets_its_reference_tokens_through_compaction():
    sched, dev = scheduler(devices=2, per_device=3, steps=3), FakeRunner(2, 3, 3)
    served = [Served(prompt(i), max_tokens=2 + (5 * i) % 11) for i in range(14)]
    for s in served:
        sched.queue.put([s.req])
    run(sched, dev)
    for i, s in enumerate(served):
        assert s.tokens == reference(prompt(i), s.req.sampling.max_tokens) and s.reason == "length", i
    assert "move" in dev.log  # finishing out of order compacted the slots


def test_arrival_order_and_least_loaded_devices_first():
    sched, dev = scheduler(devices=3, per_device=2), FakeRunner(3, 2, 2)
    served = [Served(prompt(i), max_tokens=50) for i in range(7)]
    for s in served:
        sched.queue.put([s.req])
    plans = []
    while (plan := step(sched, dev)).admission is not None:
        plans.append(plan)
    placed = [{d: g[0] for d, g in p.admission.groups.items()} for p in plans]
    reqs = [s.req for s in served]
    assert placed == [{0: reqs[0], 1: reqs[1], 2: reqs[2]}, {0: reqs[3], 1: reqs[4], 2: reqs[5]}]
    assert sched.slots.occupancy() == [2, 2, 2] and sched.counts() == (6, 1)  # the seventh waits
    assert plan.decode_width == 2


def test_a_group_that_does_not_fit_holds_back_the_queue():
    sched, dev = scheduler(devices=1, per_device=3), FakeRunner(1, 3, 2)
    first = Served(prompt(0), max_tokens=3)
    sched.queue.put([first.req])
    step(sched, dev)
    group = [Served(prompt(1), max_tokens=4) for _ in range(3)]
    behind = Served(prompt(2), max_tokens=2)
    sched.queue.put([g.req for g in group])
    sched.queue.put([behind.req])
    plan = step(sched, dev)
    assert plan.admission is None and plan.decode_width is not None  # 3 members, 2 free slots: all wait
    run(sched, dev)
    assert [g.tokens for g in group] == [reference(prompt(1), 4)] * 3
    assert behind.tokens == reference(prompt(2), 2) and first.tokens == reference(prompt(0), 3)


def test_queue_capacity_refuses_with_queue_full():
    sched = scheduler(max_queue=3)
    for i in range(3):
        sched.queue.put([Served(prompt(i)).req])
    with pytest.raises(QueueFullError, match="3 requests already waiting"):
        sched.queue.put([Served(prompt(9)).req])
    with pytest.raises(QueueFullError):  # a group counts each member
        scheduler(max_queue=2).queue.put([Served(prompt(0)).req for _ in range(3)])


@pytest.mark.parametrize(
    ("buckets", "live", "width"), [("pow2", 3, 4), ("pow2", 5, 8), ("exact", 3, 3), ([2, 6], 3, 6)]
)
def test_decode_runs_at_the_smallest_bucket_that_fits(buckets, live, width):
    sched, dev = scheduler(per_device=8, buckets=buckets), FakeRunner(1, 8, 2)
    for i in range(live):
        sched.queue.put([Served(prompt(i), max_tokens=20).req])
    while (plan := step(sched, dev)).admission is not None:
        pass
    assert plan.decode_width == width and plan.live == (live,)


def test_cancelled_requests_end_with_abort_queued_or_running():
    sched, dev = scheduler(devices=1, per_device=2), FakeRunner(1, 2, 2)
    served = [Served(prompt(i), max_tokens=30) for i in range(4)]
    for s in served:
        sched.queue.put([s.req])
    step(sched, dev), step(sched, dev), step(sched, dev)  # two admitted, one decode
    sched.queue.cancel([served[0].req, served[3].req])  # running (slot 0) and queued
    assert served[3].reason == "abort" and served[3].tokens == []  # left the queue at once
    plan = step(sched, dev)
    assert served[0].reason == "abort" and Move({0: (1, 0)}) in plan.slot_ops  # slot 1 filled the hole
    run(sched, dev)
    assert served[1].tokens == reference(prompt(1), 30) and served[2].tokens == reference(prompt(2), 30)


def test_drain_refuses_new_requests_and_ends_the_rest_at_the_deadline():
    sched, dev = scheduler(), FakeRunner(1, 4, 2)
    running, waiting = Served(prompt(0), max_tokens=500), Served(prompt(1), max_tokens=500)
    sched.queue.put([running.req])
    step(sched, dev)
    sched.queue.drain(0.05)
    with pytest.raises(QueueFullError, match="shutting down"):
        sched.queue.put([waiting.req])
    step(sched, dev)
    assert running.reason is None  # still within the deadline
    time.sleep(0.06)
    assert not sched.schedule()  # nothing to run: everything ended
    assert running.reason == "shutdown" and sched.idle()


def test_a_group_is_prefilled_once_and_shares_one_device():
    sched, dev = scheduler(devices=2, per_device=4), FakeRunner(2, 4, 2)
    other = Served(prompt(5), max_tokens=3)
    sched.queue.put([other.req])
    step(sched, dev)
    group = [Served(prompt(1), max_tokens=3 + k, logprobs=1) for k in range(3)]
    scorer = Served(prompt(1), max_tokens=0, prompt_logprobs=2)
    sched.queue.put([*(g.req for g in group), scorer.req])
    plan = step(sched, dev)
    assert list(plan.admission.groups) == [1]  # the less loaded device takes the whole group
    assert dev.log.count("prefill[1]") == 1 and plan.admission.score
    assert [sorted(w.values(), key=lambda x: x[0])[0][0] for w in plan.admission.inserts] == [0, 1, 2]
    assert scorer.reason == "length" and scorer.tokens == []  # scored only: no slot
    assert scorer.req.prompt_logprobs[0] is None and len(scorer.req.prompt_logprobs) == len(prompt(1))
    run(sched, dev)
    for k, g in enumerate(group):
        assert g.tokens == reference(prompt(1), 3 + k) and len(g.req.logprobs) == 3 + k


def test_a_request_that_finishes_at_its_first_token_frees_its_slot():
    sched, dev = scheduler(per_device=4), FakeRunner(1, 4, 2)
    stop_first = rule(prompt(3))
    group = [Served(prompt(3), max_tokens=6, stop_token_ids=(stop_first,) if k == 0 else ()) for k in range(2)]
    sched.queue.put([g.req for g in group])
    plan = step(sched, dev)
    assert plan.admission is not None and group[0].reason == "stop" and group[0].tokens == []
    assert sched.slots.occupancy() == [1]
    assert step(sched, dev).slot_ops == (Move({0: (1, 0)}),)  # member 1 moves into the hole first
    run(sched, dev)
    assert group[1].tokens == reference(prompt(3), 6)


def test_prefix_cache_plans_resume_from_block_and_end_states():
    cache = PrefixCache(budget=1 << 20, entry_bytes=1000, block=8, devices=1)
    sched, dev = scheduler(per_device=2, prefix=cache), FakeRunner(1, 2, 2)
    base = prompt(7, 20)
    first = Served(base, max_tokens=5)
    sched.queue.put([first.req])
    plan = step(sched, dev)
    assert plan.admission.starts == {} and plan.admission.keep == {0: {16: plan.admission.keep[0][16]}}
    run(sched, dev)  # finishing leaves the end state: a snapshot before any move
    assert "snapshot" in dev.log
    shared = Served([*base[:17], 3, 4], max_tokens=4)  # shares the first two blocks
    sched.queue.put([shared.req])
    plan = step(sched, dev)
    assert plan.admission.starts[0][0] == 16  # the fake runner checked the state is base[:16]'s
    run(sched, dev)
    turn = base + first.tokens + [9, 9]  # the conversation's next turn resumes from the end state
    nxt = Served(turn, max_tokens=3)
    sched.queue.put([nxt.req])
    plan = step(sched, dev)
    assert plan.admission.starts[0][0] == len(base) + len(first.tokens) - 1  # the last token was never fed
    run(sched, dev)
    assert shared.tokens == reference([*base[:17], 3, 4], 4) and nxt.tokens == reference(turn, 3)
    scored = Served(base, max_tokens=1, prompt_logprobs=0)  # scoring needs every position: no resume
    sched.queue.put([scored.req])
    assert step(sched, dev).admission.starts == {}


def test_a_failed_joint_prefill_fails_only_the_group_that_fails_alone():
    sched, dev = scheduler(devices=2, per_device=2), FakeRunner(2, 2, 2)
    good, bad = Served(prompt(1), max_tokens=4), Served(prompt(2), max_tokens=4)
    dev.bad_prompts.add(tuple(prompt(2)))
    sched.queue.put([good.req])
    sched.queue.put([bad.req])
    run(sched, dev)
    assert dev.log[:3] == ["prefill[0, 1]", "prefill[0]", "insert"]  # joint, then each alone
    assert bad.reason == "error" and "failed during prefill: ValueError: a bad prompt" in bad.req.error
    assert good.tokens == reference(prompt(1), 4) and good.reason == "length"


def test_reset_after_a_device_failure_ends_the_slots_and_serves_the_queue():
    cache = PrefixCache(budget=1 << 20, entry_bytes=1000, block=8, devices=1)
    sched, dev = scheduler(per_device=1, prefix=cache), FakeRunner(1, 1, 2)
    running, waiting = Served(prompt(1, 12), max_tokens=30), Served(prompt(2), max_tokens=3)
    sched.queue.put([running.req])
    sched.queue.put([waiting.req])
    step(sched, dev)
    assert len(cache) == 1  # the prompt's block state
    dev.fail_decode = True
    plan = sched.schedule()
    with pytest.raises(RuntimeError):
        dev.execute(plan)
    sched.reset("the device loop failed", plan)  # what the engine does, then rebuilds the runner
    assert running.reason == "error" and "device loop failed" in running.req.error
    assert len(cache) == 0 and sched.counts() == (0, 1)
    dev = FakeRunner(1, 1, 2)
    run(sched, dev)
    assert waiting.tokens == reference(prompt(2), 3)


def test_reset_fails_the_requests_being_admitted():
    sched = scheduler(devices=1, per_device=2)
    group = [Served(prompt(1)) for _ in range(2)]
    sched.queue.put([g.req for g in group])
    plan = sched.schedule()  # the insert fails on the device
    sched.reset("insert failed", plan)
    assert [g.reason for g in group] == ["error", "error"] and sched.idle()


class _Backend:
    """A host grammar's backend and matcher stand-in: after the first token it allows every token
    (``allow``) or none, and it records what it was fed."""

    def __init__(self, allow: bool):
        self.allow, self.fed = allow, []

    def deep_copy(self):
        return self

    def consume_token(self, token):
        self.fed.append(token)

    def is_accepting(self):
        return False

    def is_error(self):
        return False

    def allowed(self, matcher):
        return np.full((V,), self.allow)


def test_a_host_grammar_with_no_next_token_ends_its_request_with_an_error_only():
    """The request fails (never an unconstrained sample), its slot is freed, its pair of table rows
    was written before its insert, and its neighbour decodes to its reference."""
    from laplace_jax.serve.structured import HELD, HostGrammar, mask_rows

    dead = _Backend(allow=False)
    grammar = HostGrammar("g", mask_rows(np.ones((V,), bool), 0), "k", 0.0, dead, dead)
    sched, dev = scheduler(per_device=2, steps=3), FakeRunner(1, 2, 3)
    stuck, plain = Served(prompt(1), max_tokens=8, automaton=grammar), Served(prompt(2), max_tokens=8)
    sched.queue.put([stuck.req])
    sched.queue.put([plain.req])
    plan = step(sched, dev)
    [(base, rows)] = plan.grammar_writes
    assert rows.shape == (2, V) and (rows[0] == base + 1).all() and (rows[1] == HELD).all()
    assert stuck.reason == "error" and "allows no token" in stuck.req.error and stuck.tokens == reference(prompt(1), 1)
    run(sched, dev)
    assert plain.tokens == reference(prompt(2), 8) and plain.reason == "length"
    assert not sched.hosts and sched.slots.occupancy() == [0]


def test_host_grammar_rows_get_one_step_calls_and_their_next_masks_early():
    """A step whose live rows are all under a host grammar is one call of one step; with other
    rows too, a call of one step then one of ``steps_per_call``: the host rows' next masks come
    from the first call's tokens (``early_masks``, for the runner to write while the second runs)
    and the update does not feed those tokens again."""
    from laplace_jax.serve.structured import HELD, HostGrammar, mask_rows

    backend = _Backend(allow=True)
    grammar = HostGrammar("g", mask_rows(np.ones((V,), bool), 0), "k", 0.0, backend, backend)
    sched = scheduler(per_device=2, steps=3)
    host, plain = Served(prompt(1), max_tokens=8, automaton=grammar), Served(prompt(2), max_tokens=5)
    sched.queue.put([host.req])
    sched.queue.put([plain.req])
    dev = FakeRunner(1, 2, 3)
    while sched.slots.occupancy() != [2]:
        step(sched, dev)
    assert backend.fed == host.tokens == [host.tokens[0]]  # the insert's first token
    plan = sched.schedule()
    assert plan.decode_steps == (1, 3) and plan.decode_width == 2
    toks, valid = np.array([[[7, 9]]], np.int32), np.ones((1, 1, 2), bool)
    [(base, rows)] = sched.early_masks(toks, valid)
    assert backend.fed[-1] == 7 and (rows[0] == base + 1).all() and (rows[1] == HELD).all()  # the next mask
    rest = np.array([[[0, 10]], [[0, 11]], [[0, 12]]], np.int32), np.array([[[0, 1]]] * 3, bool)  # the host row waits
    out = StepOutput(decoded=(np.concatenate([toks, rest[0]]), np.concatenate([valid, rest[1]]), (None, None)))
    sched.update(plan, out)
    assert host.tokens[1:] == [7] and backend.fed == host.tokens  # fed once
    assert plain.tokens[1:] == [9, 10, 11, 12] and plain.reason == "length"
    plan = sched.schedule()
    assert plan.decode_steps == (1,) and plan.live == (1,)


def test_jump_forward_emits_the_forced_start_and_counts_it_toward_max_tokens():
    """An automaton's lead is prefilled with the prompt and emitted first; a member that asked for
    logprobs (or anything a lead would change) decodes it instead."""
    from laplace_jax.serve.structured import TokenAutomaton

    table = np.full((3, V), -1, np.int32)
    table[0, 5], table[1, 6], table[2, :] = 1, 2, 2  # forces 5, 6, then anything
    a = TokenAutomaton(table, "k", 0.0, lead=(5, 6), lead_state=2)
    sched, dev = scheduler(per_device=2, steps=3), FakeRunner(1, 2, 3)
    jumped, plain = (
        Served(prompt(1), max_tokens=8, automaton=a),
        Served(prompt(1), max_tokens=8, automaton=a, logprobs=1),
    )
    sched.queue.put([jumped.req])
    sched.queue.put([plain.req])
    plan = step(sched, dev)
    assert plan.admission.prompts == {0: [*prompt(1), 5, 6]} and jumped.tokens[:3] == [5, 6, rule([*prompt(1), 5, 6])]
    [row] = [r for _, r in plan.admission.inserts[0].values()]
    assert row["remaining"] == 8 - 1 - 2 and row["gstate"] == 0 + 2  # the run's base + the lead's state
    run(sched, dev)
    assert jumped.tokens == [5, 6, *reference([*prompt(1), 5, 6], 6)] and jumped.reason == "length"
    assert plain.tokens == reference(prompt(1), 8)  # the fake device does not mask: decoded from the prompt
