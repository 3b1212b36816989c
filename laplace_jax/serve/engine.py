"""The serving engine's scheduler: queue, slots per device, compaction, the engine thread.

The device side (slot buffers sharded over devices, the compiled prefill / insert / decode / move
programs) is ``programs.DevicePrograms``; this module decides what runs and when. The server
talks to ``Engine``'s public methods only.

Slots: ``max_num_seqs`` per device on each of D devices. A request goes to the least-loaded
device (fewest live slots; the lowest index on a tie) and lives in that device's slot
``len(rows[d])``; when one finishes, that device's last live slot moves into the hole
(compaction), so live slots are always the first n_d of each device and decode[W] serves them
with W the smallest bucket >= max_d n_d. Admission prefills up to one new request per device in
one call. One thread runs ``loop()``; requests arrive through ``submit`` (thread-safe) and get
their tokens through a callback. Compiles are counted from JAX's own events (``compiles.py``)
and must stay at 0 in phase "serving" for bucketed widths; ``buckets="exact"`` compiles each new
width on demand (kept to measure the cost of unbucketed widths).

Fault isolation: when preparing requests (prefill, sampling rows) fails, each is retried alone,
and only a request that fails alone is ended with an error. A failure of the shared device loop
(insert, decode, move: they donate the slot buffers) ends the requests in the slots, rebuilds
the slots, re-warms (from the persistent compile cache when one is set) and serves the queue
again; more than ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` marks the engine dead.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.errors import InvalidParamError, QueueFullError
from laplace_jax.platform import key_words, prng_impl
from laplace_jax.sampling import CANDIDATES
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.programs import MAX_STOP_IDS, DevicePrograms

if TYPE_CHECKING:  # a type only: eval runs the engine without metrics
    from laplace_jax.serve.metrics import ServeMetrics

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


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
        top_k_max = min(vocab_size, CANDIDATES)
        if not 0 <= self.top_k <= top_k_max:
            raise InvalidParamError("top_k", f"top_k must lie in [0, {top_k_max}] (0 = off); got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidParamError("seed", f"seed must lie in [0, 2^63 - 1]; got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_IDS - 1:
            raise InvalidParamError("stop_token_ids", f"at most {MAX_STOP_IDS - 1} stop_token_ids")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidParamError("stop_token_ids", f"stop_token_ids must lie in [0, {vocab_size})")


def prng_key_data(seed: int, impl: str = "threefry2x32") -> np.ndarray:
    """Key data of ``jax.random.key(seed, impl=impl)`` for 0 <= seed < 2^64, built on the host (no
    device op, so nothing compiles per request): the high and low 32-bit words (threefry2x32),
    twice over for rbg and unsafe_rbg (JAX seeds those from the threefry words)."""
    words = [seed >> 32, seed & 0xFFFFFFFF]
    return np.asarray(words * (key_words(impl) // 2), np.uint32)


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
        metrics: ServeMetrics | None = None,
        devices: Sequence[jax.Device] | None = None,
        prng: str = "auto",
    ):
        """``max_num_seqs``: decode slots per device; ``devices``: where slots live (default: the
        first local device; ``serve.py`` passes all of them); ``prng``: the sampling keys'
        implementation (``platform.prng_impl``: "auto" is rbg on Neuron, threefry2x32 elsewhere)."""
        self.prng_impl = prng_impl(prng)
        self.cfg, self.eos_id = cfg, eos_id
        self.slots_per_device, self.prefill_chunk, self.steps_per_call = max_num_seqs, prefill_chunk, steps_per_call
        self.max_model_len, self.max_queue = max_model_len, max_queue
        self.buckets = make_buckets(buckets, max_num_seqs)
        self.metrics = metrics
        self.compiles = CompileCounter(metrics.on_compile if metrics is not None else None)
        self.devices = list(devices) if devices else jax.local_devices()[:1]
        self.n_devices = len(self.devices)
        self.ready = False
        self.dead: str | None = None
        self.restarts = 0
        self.restarting: str | None = None  # the failure being recovered from
        self._restart_times: collections.deque[float] = collections.deque()
        self._waiting: collections.deque[Request] = collections.deque()
        # live requests: rows[d][i] is in slot i of device d
        self._rows: list[list[Request]] = [[] for _ in range(self.n_devices)]
        self._admitting: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._deadline = math.inf  # drain deadline (perf_counter): then every request ends with "shutdown"
        self._seeds = np.random.default_rng()
        self.programs = DevicePrograms(
            cfg, params, self.devices, max_num_seqs, prefill_chunk, steps_per_call, self.prng_impl
        )
        self.state_bytes = self.programs.state_bytes
        if metrics is not None:
            metrics.set_devices(self.n_devices, self.slots_per_device)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def num_slots(self) -> int:
        """Decode slots over all devices."""
        return self.n_devices * self.slots_per_device

    def status(self) -> tuple[str, str]:
        """("ready" | "warming" | "restarting" | "dead", a sentence saying why)."""
        if self.dead:
            return "dead", f"engine failed: {self.dead}"
        if self.restarting:
            return "restarting", f"engine restarting after: {self.restarting}"
        if not self.ready:
            return "warming", "warming up"
        return "ready", f"ready ({self.restarts} restarts)"

    def occupancy(self) -> list[int]:
        """Live slots per device."""
        return [len(r) for r in self._rows]

    # ----- compilation ------------------------------------------------------------------
    def _ensure_decode(self, width: int) -> None:
        """decode[width] must exist after warmup; only ``buckets="exact"`` compiles new widths here."""
        if self.programs.get("decode", width) is not None:
            return
        if self.buckets is not None:
            raise RuntimeError(f"no compiled decode[{width}] after warmup")  # never recompile silently
        self.programs.compile(*self.programs.decode_program(width))

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile every executable the serving phase can need (all buckets), on the calling thread."""
        self.compiles.claim_thread()
        self.compiles.phase = "warmup"
        programs = self.programs.programs(self.buckets or [])
        for n, program in enumerate(programs):
            if progress:
                progress(f"compiling {program[0]}[{program[1]}] ({n + 1}/{len(programs)})")
            self.programs.compile(*program)
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
        """(running, waiting) requests."""
        return sum(len(r) for r in self._rows), len(self._waiting)

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
        while self.counts() != (0, 0) and self.dead is None and time.perf_counter() < self._deadline + 5.0:
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()

    def run_until_idle(self) -> None:
        """Serve every submitted request to completion on the calling thread (batch jobs, evals)."""
        self.compiles.claim_thread()
        while self.counts() != (0, 0):
            self._step()

    def serve_forever(self, progress: Callable[[str], None] | None = None) -> None:
        """``warmup`` then ``loop`` (the engine thread's body). A failed warmup marks the engine
        dead with the reason, which ``status`` reports."""
        try:
            self.warmup(progress)
        except Exception as e:  # reported by status(); the server answers 503 with it
            self.dead = f"warmup failed: {type(e).__name__}: {e}"
            return
        self.loop()

    def loop(self) -> None:
        """The engine thread: serve until ``stop``; recover from device-loop failures (see module doc)."""
        self.compiles.claim_thread()
        while True:
            with self._cv:
                while not self._stop and self.counts() == (0, 0):
                    self._cv.wait(0.1)
                if self._stop:
                    return
            try:
                self._step()
            except Exception as e:  # the shared device loop failed: end the slots' requests, rebuild, re-warm
                if not self._recover(f"{type(e).__name__}: {e}"):
                    return

    # ----- host internals ---------------------------------------------------------------
    def _live(self) -> list[Request]:
        return [r for rows in self._rows for r in rows]

    def _step(self) -> None:
        if time.perf_counter() >= self._deadline:
            self._end_all("shutdown")
            return
        self._admit()
        self._reap_cancelled()
        if any(self._rows):
            self._decode_once()

    def _end_all(self, reason: str, message: str | None = None) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for r in [*self._live(), *waiting]:
            if reason == "error":
                r.fail(message or "the engine failed")
            else:
                r.send([], reason)
        self._rows = [[] for _ in range(self.n_devices)]

    def _recover(self, reason: str) -> bool:
        """Rebuild the slots and re-warm after a device-loop failure; False if the engine gave up."""
        now = time.perf_counter()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        message = f"the engine's device loop failed ({reason}); the request was ended and the engine restarted"
        for r in [*self._live(), *self._admitting]:
            r.fail(message)
        self._rows, self._admitting = [[] for _ in range(self.n_devices)], []
        if len(self._restart_times) > MAX_RESTARTS:
            self.dead = f"{reason} ({len(self._restart_times)} device-loop failures within {RESTART_WINDOW_S:.0f} s)"
            self._end_all("error", f"engine failed: {self.dead}")
            return False
        self.ready, self.restarting = False, reason
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.restarts.inc()
        try:
            self.programs.executables.clear()
            self.programs.slots = self.programs.new_slots()
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
            "key": prng_key_data(seed, self.prng_impl),
            "remaining": np.int32(sp.max_tokens - 1),
            "stop_ids": np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32),
        }

    def _place(self) -> dict[int, Request]:
        """Take up to one waiting request per device with a free slot, least-loaded devices first."""
        free = sorted((len(rows), d) for d, rows in enumerate(self._rows) if len(rows) < self.slots_per_device)
        placed: dict[int, Request] = {}
        with self._cv:
            for _, d in free:
                while self._waiting and not self._stop:
                    req = self._waiting.popleft()
                    if req.cancelled:
                        req.send([], "abort")
                        continue
                    placed[d] = req
                    break
        return placed

    def _prepare(self, placed: dict[int, Request]):
        """Prefill the placed prompts together; on failure retry each alone and end only those that
        fail alone. Returns (states, logits, {device: (slot, sampling row)}) or None if none is left."""
        try:
            state, logits = self.programs.prefill_rows({d: r.prompt_ids for d, r in placed.items()})
            rows = {d: self._row_params(r.sampling) for d, r in placed.items()}
        except Exception as e:
            if len(placed) == 1:
                (req,) = placed.values()
                req.fail(f"this request failed during prefill: {type(e).__name__}: {e}")
                return None
            for d, req in list(placed.items()):  # isolate the failing request(s)
                if self._prepare({d: req}) is None:
                    del placed[d]
            if not placed:
                return None
            return self._prepare(placed)
        for req in placed.values():
            req.stops = frozenset(self._stop_ids(req.sampling))
        return state, logits, {d: (len(self._rows[d]), rows[d]) for d in placed}

    def _admit(self) -> None:
        while True:
            placed = self._place()
            if not placed:
                return
            now = time.perf_counter()
            for req in placed.values():
                req.started_at = now
            self._admitting = list(placed.values())
            prepared = self._prepare(dict(placed))
            if prepared is None:
                self._admitting = []
                continue
            state, logits, where = prepared
            first = self.programs.insert(state, logits, where)  # shared buffers: failures go to _recover
            self._admitting = []
            now = time.perf_counter()
            for d in where:
                req, tok = placed[d], int(first[d])
                req.first_token_at = now
                if self.metrics is not None:
                    self.metrics.on_first_token(req)
                finished = self._accept(req, tok)
                req.send([] if finished == "stop" else [tok], finished)
                if finished is None:  # else its slot stays past the live ones, to be overwritten
                    self._rows[d].append(req)

    def _accept(self, req: Request, token: int) -> str | None:
        """Count one generated token; return the finish reason it causes (stop tokens are not emitted)."""
        req.generated += 1
        if token in req.stops:
            return "stop"
        if req.generated >= req.sampling.max_tokens:
            return "length"
        return None

    def _free(self, idx: dict[int, list[int]]) -> None:
        """Drop the given local slots per device, moving each device's last live slot into a hole."""
        for d, slots in idx.items():
            rows = self._rows[d]
            for i in sorted(slots, reverse=True):
                last = len(rows) - 1
                if i != last:
                    self.programs.move({d: (last, i)})
                    rows[i] = rows[last]
                rows.pop()

    def _reap_cancelled(self) -> None:
        gone: dict[int, list[int]] = {}
        for d, rows in enumerate(self._rows):
            for i, r in enumerate(rows):
                if r.cancelled:
                    r.send([], "abort")
                    gone.setdefault(d, []).append(i)
        if gone:
            self._free(gone)

    def _decode_once(self) -> None:
        live = self.occupancy()
        W = self.bucket_for(max(live))
        t0 = time.perf_counter()
        self._ensure_decode(W)
        toks, valid = self.programs.decode(W)
        done: dict[int, list[int]] = {}
        for d, rows in enumerate(self._rows):
            for i, req in enumerate(rows):
                out, reason = [], None
                for k in range(self.steps_per_call):
                    if not valid[k, d, i]:
                        break
                    t = int(toks[k, d, i])
                    reason = self._accept(req, t)
                    if reason != "stop":
                        out.append(t)
                    if reason:
                        break
                if out or reason:
                    req.send(out, reason)
                if reason:
                    done.setdefault(d, []).append(i)
        if self.metrics is not None:
            self.metrics.on_decode(W, live, time.perf_counter() - t0, self.steps_per_call)
        if done:
            self._free(done)
