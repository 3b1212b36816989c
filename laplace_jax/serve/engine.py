"""The serving engine: S decode slots with a fixed per-sequence state, continuous batching.

Device side (all AOT-compiled at warmup, held as ``Compiled`` objects):
  prefill   [1, P] tokens + valid length -> state, last logits   (one executable for any prompt)
  insert    sample the first token and write a prefilled sequence into slot i (i traced, donated)
  decode[W] run ``steps_per_call`` tokens for the first W slots: model step, on-device sampling,
            EOS / stop-token / max_tokens checks (one executable per bucket width W)
  move      copy slot j into slot i (keeps live rows contiguous so the smallest bucket serves)
Host side: one thread runs ``loop()``; requests arrive through ``submit`` (thread-safe) and get
their tokens through a callback. Compiles are counted from JAX's own events (``compiles.py``)
and must stay at 0 in phase "serving" for bucketed widths; ``buckets="exact"`` compiles each new
width on demand (kept to measure the cost of unbucketed widths).

Fault isolation: a failure while preparing one request (prefill, its sampling row) ends that
request with an error and the loop goes on. A failure of the shared device loop (insert,
decode, move: they donate the slot buffers) ends the requests in the slots, rebuilds the slots,
re-warms (from the persistent compile cache when one is set) and serves the queue again; more
than ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` marks the engine dead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import decode_step, init_state, prefill
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.sampling import sample_rows

MAX_STOP_IDS = 16  # EOS + up to 15 stop_token_ids per request, checked on device
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


class InvalidParamError(ValueError):
    """A request field out of range; ``param`` names it (the HTTP layer answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def check(self, vocab_size: int) -> None:
        """Raise ``InvalidParamError`` for any field outside its documented range."""
        if self.max_tokens < 1:
            raise InvalidParamError("max_tokens", f"max_tokens must be >= 1; got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidParamError(
                "temperature", f"temperature must lie in [0, {MAX_TEMPERATURE}]; got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParamError("top_p", f"top_p must lie in (0, 1]; got {self.top_p}")
        if not 0 <= self.top_k <= vocab_size:
            raise InvalidParamError("top_k", f"top_k must lie in [0, {vocab_size}] (0 = off); got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidParamError("seed", f"seed must lie in [0, 2^63 - 1]; got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_IDS - 1:
            raise InvalidParamError("stop_token_ids", f"at most {MAX_STOP_IDS - 1} stop_token_ids")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidParamError("stop_token_ids", f"stop_token_ids must lie in [0, {vocab_size})")


def prng_key_data(seed: int) -> np.ndarray:
    """threefry2x32 key data of ``jax.random.key(seed)`` for 0 <= seed < 2^64, built on the host
    (no device op, so nothing compiles per request): the high and low 32-bit words."""
    return np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


@dataclasses.dataclass(eq=False)
class Request:
    """``emit(tokens, finish_reason)`` is called from the engine thread: new token ids, then a reason.

    Reasons: "stop", "length", "abort" (cancelled), "shutdown" (the drain deadline passed) and
    "error" (then ``error`` says why).
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    emit: Callable[[list[int], str | None], None]
    id: str = ""
    cancelled: bool = False
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    stops: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids, set at admission
    started_at: float | None = None
    first_token_at: float | None = None
    generated: int = 0
    error: str | None = None

    def send(self, tokens: list[int], reason: str | None) -> None:
        """``emit`` that cannot hurt the engine: a failing callback cancels this request only."""
        try:
            self.emit(tokens, reason)
        except Exception:
            self.cancelled = True

    def fail(self, message: str) -> None:
        self.error = message
        self.send([], "error")


class QueueFullError(Exception):
    """The admission queue is full; retry later."""


def make_buckets(spec: str | list[int], max_num_seqs: int) -> list[int] | None:
    """Powers of two up to max_num_seqs plus max_num_seqs itself; an explicit list; or None (exact)."""
    if spec == "exact":
        return None
    if spec == "pow2":
        widths = {1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs}
    else:
        widths = {int(w) for w in spec}
        if not widths or min(widths) < 1 or max(widths) > max_num_seqs:
            raise ValueError(f"decode buckets must lie in 1..{max_num_seqs}; got {sorted(widths)}")
    return sorted(widths | {max_num_seqs})


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        eos_id: int,
        max_num_seqs: int = 8,
        buckets: str | list[int] = "pow2",
        prefill_chunk: int = 64,
        steps_per_call: int = 4,
        max_model_len: int = 2048,
        max_queue: int = 64,
        metrics: Any = None,
    ):
        self.cfg, self.params, self.eos_id = cfg, params, eos_id
        self.S, self.P, self.K = max_num_seqs, prefill_chunk, steps_per_call
        self.max_model_len, self.max_queue = max_model_len, max_queue
        self.buckets = make_buckets(buckets, max_num_seqs)
        self.metrics = metrics
        self.compiles = CompileCounter(metrics.on_compile if metrics is not None else None)
        self.ready = False
        self.dead: str | None = None
        self.restarts = 0
        self.restarting: str | None = None  # the failure being recovered from
        self._restart_times: collections.deque[float] = collections.deque()
        self._exec: dict[tuple[str, int], Any] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Request] = []  # live requests, row i <-> slot i
        self._admitting: Request | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._deadline = math.inf  # drain deadline (perf_counter): then every request ends with "shutdown"
        self._seeds = np.random.default_rng()
        self.slots = self._init_slots()
        self._fresh = init_state(self.cfg, 1)  # prefill's starting state (never donated, reused)
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(self.slots["model"])) // self.S

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def status(self) -> tuple[str, str]:
        """("ready" | "warming" | "restarting" | "dead", a sentence saying why)."""
        if self.dead:
            return "dead", f"engine failed: {self.dead}"
        if self.restarting:
            return "restarting", f"engine restarting after: {self.restarting}"
        if not self.ready:
            return "warming", "warming up"
        return "ready", f"ready ({self.restarts} restarts)"

    # ----- device functions -------------------------------------------------------------
    def _init_slots(self) -> dict:
        S = self.S
        rows = {
            "token": jnp.zeros((S,), jnp.int32),
            "temperature": jnp.zeros((S,), jnp.float32),
            "top_k": jnp.zeros((S,), jnp.int32),
            "top_p": jnp.ones((S,), jnp.float32),
            "key": jnp.zeros((S, 2), jnp.uint32),
            "count": jnp.zeros((S,), jnp.int32),
            "remaining": jnp.zeros((S,), jnp.int32),
            "stop_ids": jnp.full((S, MAX_STOP_IDS), -1, jnp.int32),
            "done": jnp.ones((S,), bool),
        }
        return {"model": init_state(self.cfg, S), "rows": rows}

    def _prefill(self, params, tokens_1xP, state, length_1):
        logits, state = prefill(self.cfg, params, tokens_1xP, state, length_1)
        return logits[0, length_1[0] - 1][None], state

    def _insert(self, slots, state1, logits_1xV, row, slot):
        key = jax.random.wrap_key_data(row["key"], impl="threefry2x32")
        first = sample_rows(
            logits_1xV,
            row["temperature"][None],
            row["top_k"][None],
            row["top_p"][None],
            jax.random.fold_in(key, 0)[None],
        )[0]
        model = jax.tree.map(
            lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x.astype(s.dtype), slot, 1), slots["model"], state1
        )
        rows = dict(row, token=first, count=jnp.int32(1), done=jnp.bool_(False))
        rows = {k: slots["rows"][k].at[slot].set(v) for k, v in rows.items()}
        return {"model": model, "rows": rows}, first

    def _decode(self, params, slots, W: int):
        sub = {
            "model": jax.tree.map(lambda x: x[:, :W], slots["model"]),
            "rows": jax.tree.map(lambda x: x[:W], slots["rows"]),
        }

        def step(sub, _):
            r = sub["rows"]
            logits, model = decode_step(self.cfg, params, r["token"], sub["model"])
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"], impl="threefry2x32"), r["count"])
            tok = sample_rows(logits, r["temperature"], r["top_k"], r["top_p"], keys)
            valid = ~r["done"]
            tok = jnp.where(valid, tok, r["token"])
            remaining = r["remaining"] - valid
            stop = jnp.any(tok[:, None] == r["stop_ids"], axis=-1)
            done = r["done"] | (valid & (stop | (remaining <= 0)))
            rows = dict(r, token=tok, count=r["count"] + 1, remaining=remaining, done=done)
            return {"model": model, "rows": rows}, (tok, valid)

        sub, (toks, valid) = jax.lax.scan(step, sub, None, length=self.K)
        model = jax.tree.map(lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x, 0, 1), slots["model"], sub["model"])
        rows = jax.tree.map(lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x, 0, 0), slots["rows"], sub["rows"])
        return {"model": model, "rows": rows}, toks, valid

    def _move(self, slots, src, dst):
        take = lambda x, axis: jax.lax.dynamic_index_in_dim(x, src, axis, keepdims=True)  # noqa: E731
        model = jax.tree.map(lambda x: jax.lax.dynamic_update_slice_in_dim(x, take(x, 1), dst, 1), slots["model"])
        rows = jax.tree.map(lambda x: jax.lax.dynamic_update_slice_in_dim(x, take(x, 0), dst, 0), slots["rows"])
        return {"model": model, "rows": rows}

    # ----- compilation ------------------------------------------------------------------
    def _compile(self, name: str, width: int, fn, args: tuple, donate: tuple[int, ...]):
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self._exec[(name, width)] = compiled
        return compiled

    def _decode_program(self, width: int) -> tuple:
        return ("decode", width, functools.partial(self._decode, W=width), (self.params, self.slots), (1,))

    def _get(self, name: str, width: int):
        ex = self._exec.get((name, width))
        if ex is not None:
            return ex
        if name != "decode" or self.buckets is not None:
            raise RuntimeError(f"no compiled {name}[{width}] after warmup")  # never recompile silently
        return self._compile(*self._decode_program(width))

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every executable the serving phase can need (all buckets), on the calling thread."""
        self.compiles.claim_thread()
        self.compiles.phase = "warmup"
        one = jax.eval_shape(lambda: init_state(self.cfg, 1))
        row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._row_params(SamplingParams(seed=0)))
        V = self.cfg.vocab_size
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        tokens, length = jax.ShapeDtypeStruct((1, self.P), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
        programs = [
            ("prefill", 1, self._prefill, (self.params, tokens, one, length), ()),
            ("insert", 1, self._insert, (self.slots, one, jax.ShapeDtypeStruct((1, V), jnp.float32), row, i32), (0,)),
            ("move", 1, self._move, (self.slots, i32, i32), (0,)),
        ]
        programs += [self._decode_program(w) for w in self.buckets or []]
        for n, program in enumerate(programs):
            if progress:
                progress(f"compiling {program[0]}[{program[1]}] ({n + 1}/{len(programs)})")
            self._compile(*program)
        self.compiles.phase = "serving"
        self.ready = True

    # ----- host API ---------------------------------------------------------------------
    def check(self, prompt_ids: list[int], sp: SamplingParams) -> None:
        """Raise ``InvalidParamError`` if the request cannot be served as given."""
        sp.check(self.vocab_size)
        n = len(prompt_ids)
        if n == 0:
            raise InvalidParamError("prompt", "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidParamError("prompt", f"prompt token ids must lie in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise InvalidParamError(
                "prompt", f"the prompt has {n} tokens; max_model_len {self.max_model_len} leaves no room to generate"
            )
        if n + sp.max_tokens > self.max_model_len:
            raise InvalidParamError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds max_model_len {self.max_model_len}; "
                f"ask for at most {self.max_model_len - n} tokens",
            )

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe). Raises ``InvalidParamError`` or ``QueueFullError``."""
        self.check(req.prompt_ids, req.sampling)
        with self._cv:
            if self._draining:
                raise QueueFullError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests already waiting")
            self._waiting.append(req)
            self._cv.notify()

    def counts(self) -> tuple[int, int]:
        return len(self._rows), len(self._waiting)

    def bucket_for(self, n: int) -> int:
        return n if self.buckets is None else next(w for w in self.buckets if w >= n)

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting new requests; ``timeout`` s from now, end whatever still runs with "shutdown"."""
        with self._cv:
            self._draining = True
            self._deadline = min(self._deadline, time.perf_counter() + max(timeout, 0.0))
            self._cv.notify()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting; with ``drain`` let in-flight requests finish (at most ``timeout`` s), then end the loop."""
        self.begin_drain(timeout if drain else 0.0)
        while (self._rows or self._waiting) and self.dead is None and time.perf_counter() < self._deadline + 5.0:
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()

    def run_until_idle(self) -> None:
        """Serve every submitted request to completion on the calling thread (batch jobs, evals)."""
        self.compiles.claim_thread()
        while self._rows or self._waiting:
            self._step()

    def loop(self) -> None:
        """The engine thread: serve until ``stop``; recover from device-loop failures (see module doc)."""
        self.compiles.claim_thread()
        while True:
            with self._cv:
                while not self._stop and not self._rows and not self._waiting:
                    self._cv.wait(0.1)
                if self._stop:
                    return
            try:
                self._step()
            except Exception as e:  # the shared device loop failed: end the slots' requests, rebuild, re-warm
                if not self._recover(f"{type(e).__name__}: {e}"):
                    return

    # ----- host internals ---------------------------------------------------------------
    def _step(self) -> None:
        if time.perf_counter() >= self._deadline:
            self._end_all("shutdown")
            return
        self._admit()
        self._reap_cancelled()
        if self._rows:
            self._decode_once()

    def _end_all(self, reason: str, message: str | None = None) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for r in [*self._rows, *waiting]:
            if reason == "error":
                r.fail(message or "the engine failed")
            else:
                r.send([], reason)
        self._rows = []

    def _recover(self, reason: str) -> bool:
        """Rebuild the slots and re-warm after a device-loop failure; False if the engine gave up."""
        now = time.perf_counter()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        message = f"the engine's device loop failed ({reason}); the request was ended and the engine restarted"
        for r in [*self._rows, *([self._admitting] if self._admitting else [])]:
            r.fail(message)
        self._rows, self._admitting = [], None
        if len(self._restart_times) > MAX_RESTARTS:
            self.dead = f"{reason} ({len(self._restart_times)} device-loop failures within {RESTART_WINDOW_S:.0f} s)"
            self._end_all("error", f"engine failed: {self.dead}")
            return False
        self.ready, self.restarting = False, reason
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.restarts.inc()
        try:
            self._exec.clear()
            self.slots = self._init_slots()
            self.warmup()
        except Exception as e:
            self.dead = f"restart after {reason} failed: {type(e).__name__}: {e}"
            self._end_all("error", f"engine failed: {self.dead}")
            return False
        self.restarting = None
        return True

    def _stop_ids(self, sp: SamplingParams) -> list[int]:
        """The token ids that end a request (the same list the device checks)."""
        return ([] if sp.ignore_eos else [self.eos_id]) + list(sp.stop_token_ids)

    def _row_params(self, sp: SamplingParams) -> dict:
        stops = self._stop_ids(sp)
        seed = sp.seed if sp.seed is not None else int(self._seeds.integers(0, MAX_SEED, endpoint=True))
        return {
            "temperature": np.float32(sp.temperature),
            "top_k": np.int32(sp.top_k),
            "top_p": np.float32(sp.top_p),
            "key": prng_key_data(seed),
            "remaining": np.int32(sp.max_tokens - 1),
            "stop_ids": np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32),
        }

    def _prefill_prompt(self, ids: list[int]):
        """Run the prompt through the prefill executable chunk by chunk: (state [1 slot], last logits)."""
        state, logits = self._fresh, None
        for start in range(0, len(ids), self.P):
            piece = ids[start : start + self.P]
            chunk = np.zeros((1, self.P), np.int32)
            chunk[0, : len(piece)] = piece
            logits, state = self._get("prefill", 1)(self.params, chunk, state, np.asarray([len(piece)], np.int32))
        return state, logits

    def _admit(self) -> None:
        while len(self._rows) < self.S:
            with self._cv:
                if not self._waiting or self._stop:
                    return
                req = self._waiting.popleft()
            if req.cancelled:
                req.send([], "abort")
                continue
            self._admitting = req
            req.started_at = time.perf_counter()
            try:  # failures here belong to this request alone: nothing shared was donated yet
                state, logits = self._prefill_prompt(req.prompt_ids)
                row = self._row_params(req.sampling)
                req.stops = frozenset(self._stop_ids(req.sampling))
            except Exception as e:
                self._admitting = None
                req.fail(f"this request failed during prefill: {type(e).__name__}: {e}")
                continue
            slot = len(self._rows)
            self.slots, first = self._get("insert", 1)(self.slots, state, logits, row, np.int32(slot))
            first = int(first)
            self._admitting = None
            req.first_token_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.on_first_token(req)
            finished = self._accept(req, first)
            req.send([] if finished == "stop" else [first], finished)
            if finished is None:
                self._rows.append(req)

    def _accept(self, req: Request, token: int) -> str | None:
        """Count one generated token; return the finish reason it causes (stop tokens are not emitted)."""
        req.generated += 1
        if token in req.stops:
            return "stop"
        if req.generated >= req.sampling.max_tokens:
            return "length"
        return None

    def _free(self, idx: list[int]) -> None:
        for i in sorted(idx, reverse=True):
            last = len(self._rows) - 1
            if i != last:
                self.slots = self._get("move", 1)(self.slots, np.int32(last), np.int32(i))
                self._rows[i] = self._rows[last]
            self._rows.pop()

    def _reap_cancelled(self) -> None:
        gone = [i for i, r in enumerate(self._rows) if r.cancelled]
        for i in gone:
            self._rows[i].send([], "abort")
        if gone:
            self._free(gone)

    def _decode_once(self) -> None:
        n = len(self._rows)
        W = self.bucket_for(n)
        t0 = time.perf_counter()
        ex = self._get("decode", W)
        self.slots, toks, valid = ex(self.params, self.slots)
        toks, valid = np.asarray(toks), np.asarray(valid)
        done_rows = []
        for i, req in enumerate(self._rows):
            out, reason = [], None
            for k in range(self.K):
                if not valid[k, i]:
                    break
                t = int(toks[k, i])
                reason = self._accept(req, t)
                if reason != "stop":
                    out.append(t)
                if reason:
                    break
            if out or reason:
                req.send(out, reason)
            if reason:
                done_rows.append(i)
        if self.metrics is not None:
            self.metrics.on_decode(W, n, time.perf_counter() - t0, self.K)
        if done_rows:
            self._free(done_rows)
