"""The serving engine: S decode slots with a fixed per-sequence state, continuous batching.

Device side (all AOT-compiled at warmup, held as ``Compiled`` objects):
  prefill   [1, P] tokens + valid length -> state, last logits   (one executable for any prompt)
  insert    sample the first token and write a prefilled sequence into slot i (i traced, donated)
  decode[W] run ``steps_per_call`` tokens for the first W slots: model step, on-device sampling,
            EOS / stop-token / max_tokens checks (one executable per bucket width W)
  move      copy slot j into slot i (keeps live rows contiguous so the smallest bucket serves)
Host side: one thread runs ``loop()``; requests arrive through ``submit`` (thread-safe) and get
their tokens through a callback. A compile counter by (function, bucket, phase) must stay at 0
in phase "serving" for bucketed widths; ``buckets="exact"`` compiles each new width on demand
(the Trainium problem, kept to measure it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import decode_step, init_state, prefill
from laplace_jax.serve.sampling import sample_rows

MAX_STOP_IDS = 8


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """``emit(tokens, finish_reason)`` is called from the engine thread: new token ids, then a reason."""

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
        self.compiles: collections.Counter = collections.Counter()
        self.compile_seconds = 0.0
        self.phase = "warmup"
        self.ready = False
        self.dead: str | None = None
        self._exec: dict[tuple[str, int], Any] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Request] = []  # live requests, row i <-> slot i
        self._admitting: Request | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self.slots = self._init_slots()
        self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(self.slots["model"])) // self.S

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
        key = jax.random.wrap_key_data(row["key"])
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
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(r["key"]), r["count"])
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
    def _compile(self, name: str, width: int, fn, *args, donate=()):
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        dt = time.perf_counter() - t0
        self.compile_seconds += dt
        self.compiles[(name, width, self.phase)] += 1
        if self.metrics is not None:
            self.metrics.on_compile(name, width, self.phase, dt)
        self._exec[(name, width)] = compiled
        return compiled

    def _get(self, name: str, width: int):
        ex = self._exec.get((name, width))
        if ex is not None:
            return ex
        if name != "decode" or self.buckets is not None:
            raise RuntimeError(f"no compiled {name}[{width}] after warmup")  # never recompile silently
        return self._compile(
            "decode", width, functools.partial(self._decode, W=width), self.params, self.slots, donate=(1,)
        )

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every executable the serving phase can need (all buckets)."""
        one = jax.eval_shape(lambda: init_state(self.cfg, 1))
        row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._row_params(SamplingParams(seed=0)))
        V = self.cfg.vocab_size
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        steps = [("prefill", 1), ("insert", 1), ("move", 1)] + [("decode", w) for w in (self.buckets or [])]
        for n, (name, width) in enumerate(steps):
            if progress:
                progress(f"compiling {name}[{width}] ({n + 1}/{len(steps)})")
            if name == "prefill":
                self._compile(
                    name,
                    1,
                    self._prefill,
                    self.params,
                    jax.ShapeDtypeStruct((1, self.P), jnp.int32),
                    one,
                    jax.ShapeDtypeStruct((1,), jnp.int32),
                )
            elif name == "insert":
                self._compile(
                    name,
                    1,
                    self._insert,
                    self.slots,
                    one,
                    jax.ShapeDtypeStruct((1, V), jnp.float32),
                    row,
                    i32,
                    donate=(0,),
                )
            elif name == "move":
                self._compile(name, 1, self._move, self.slots, i32, i32, donate=(0,))
            else:
                self._compile(
                    name, width, functools.partial(self._decode, W=width), self.params, self.slots, donate=(1,)
                )
        self.phase = "serving"
        self.ready = True

    # ----- host API ---------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if len(req.prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(req.prompt_ids) + req.sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
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

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting; with ``drain`` wait for in-flight requests (up to ``timeout`` s), then end the loop."""
        with self._cv:
            self._draining = True
            self._cv.notify()
        deadline = time.perf_counter() + timeout
        while drain and (self._rows or self._waiting) and time.perf_counter() < deadline and self.dead is None:
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()

    def run_until_idle(self) -> None:
        """Serve every submitted request to completion on the calling thread (batch jobs, evals)."""
        while self._rows or self._waiting:
            self._admit()
            self._reap_cancelled()
            if self._rows:
                self._decode_once()

    def loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._rows and not self._waiting:
                        self._cv.wait(0.1)
                    if self._stop:
                        return
                self._admit()
                self._reap_cancelled()
                if self._rows:
                    self._decode_once()
        except Exception as e:  # the engine is dead: /health reports it, requests fail
            self.dead = f"{type(e).__name__}: {e}"
            for r in [*self._rows, *self._waiting, *([self._admitting] if self._admitting else [])]:
                r.emit([], "error")
            raise

    # ----- host internals ---------------------------------------------------------------
    def _stop_ids(self, sp: SamplingParams) -> list[int]:
        """The token ids that end a request (the same list the device checks)."""
        return (([] if sp.ignore_eos else [self.eos_id]) + list(sp.stop_token_ids))[:MAX_STOP_IDS]

    def _row_params(self, sp: SamplingParams) -> dict:
        stops = self._stop_ids(sp)
        seed = sp.seed if sp.seed is not None else np.random.randint(0, 2**31 - 1)
        return {
            "temperature": np.float32(sp.temperature),
            "top_k": np.int32(sp.top_k),
            "top_p": np.float32(sp.top_p),
            "key": np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32),
            "remaining": np.int32(sp.max_tokens - 1),
            "stop_ids": np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32),
        }

    def _admit(self) -> None:
        while len(self._rows) < self.S:
            with self._cv:
                if not self._waiting or self._stop:
                    return
                req = self._waiting.popleft()
            self._admitting = req
            if req.cancelled:
                req.emit([], "abort")
                continue
            req.started_at = time.perf_counter()
            state = init_state(self.cfg, 1)
            ids = req.prompt_ids
            for start in range(0, len(ids), self.P):
                piece = ids[start : start + self.P]
                chunk = np.zeros((1, self.P), np.int32)
                chunk[0, : len(piece)] = piece
                logits, state = self._get("prefill", 1)(self.params, chunk, state, np.asarray([len(piece)], np.int32))
            row = self._row_params(req.sampling)
            req.stops = frozenset(self._stop_ids(req.sampling))
            slot = len(self._rows)
            self.slots, first = self._get("insert", 1)(self.slots, state, logits, row, np.int32(slot))
            first = int(first)
            req.first_token_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.on_first_token(req)
            finished = self._accept(req, first)
            req.emit([] if finished == "stop" else [first], finished)
            if finished is None:
                self._rows.append(req)
            self._admitting = None

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
            self._rows[i].emit([], "abort")
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
                req.emit(out, reason)
            if reason:
                done_rows.append(i)
        if self.metrics is not None:
            self.metrics.on_decode(W, n, time.perf_counter() - t0, self.K)
        if done_rows:
            self._free(done_rows)
