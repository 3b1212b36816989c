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

Prefix-state cache (``prefix_cache_bytes`` > 0, ``prefix_cache.py``): admission restores the
longest cached prefix of a group's prompt and prefills only the rest; the prefill leaves an entry
at every multiple of ``prefix_block`` ids, and a request that finishes ("stop" or "length")
leaves its final state, keyed by its prompt and the generated ids fed back (the next turn of a
chat). Prompts that ask for prompt logprobs are scored in full (every position is needed).

Fault isolation: when preparing requests (prefill, sampling rows) fails, each is retried alone,
and only a request that fails alone is ended with an error. A failure of the shared device loop
(insert, decode, move: they donate the slot buffers) ends the requests in the slots, rebuilds
the slots, re-warms (from the persistent compile cache when one is set) and serves the queue
again; more than ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` marks the engine dead.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.errors import InvalidParamError, QueueFullError
from laplace_jax.platform import prng_impl
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES, PrefixCache, block_digests
from laplace_jax.serve.programs import DevicePrograms
from laplace_jax.serve.request import MAX_SEED, Completion, Request, SamplingParams, prng_key_data

if TYPE_CHECKING:  # a type only: eval runs the engine without metrics
    from laplace_jax.serve.metrics import ServeMetrics

MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


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
        prefix_cache_bytes: int = 0,
        prefix_block: int | None = None,
    ):
        """``max_num_seqs``: decode slots per device; ``devices``: where slots live (default: the
        first local device; ``serve.py`` passes all of them); ``prng``: the sampling keys'
        implementation (``platform.prng_impl``: "auto" is rbg on Neuron, threefry2x32 elsewhere).
        ``prefix_cache_bytes``: the prefix-state cache's budget per device (0: off);
        ``prefix_block``: its block in ids (default: the lcm of 128 and ``prefill_chunk``; must be
        a multiple of both, so a resumed prompt is cut into the same prefill calls)."""
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
        self._waiting: collections.deque[list[Request]] = collections.deque()  # groups sharing a prompt
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
        unit = math.lcm(128, prefill_chunk)
        block = prefix_block or unit
        if block % unit:
            raise ValueError(f"--prefix-block must be a multiple of {unit} (128 and the prefill chunk); got {block}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"--prefix-cache-bytes must be >= 0; got {prefix_cache_bytes}")
        entry_bytes = self.state_bytes + ENTRY_OVERHEAD_BYTES
        # off (None) when the budget holds no entry: no lookups, no hashing per request
        self.prefix = (
            PrefixCache(prefix_cache_bytes, entry_bytes, block, self.n_devices)
            if prefix_cache_bytes >= entry_bytes
            else None
        )
        if metrics is not None:
            metrics.set_devices(self.n_devices, self.slots_per_device)

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
    def check(self, prompt_ids: list[int], *sps: SamplingParams) -> None:
        """Raise ``InvalidParamError`` if a request (or a group sharing ``prompt_ids``, one
        ``SamplingParams`` per member) cannot be served as given. The prompt is checked once."""
        for sp in sps:
            sp.check(self.vocab_size)
        n = len(prompt_ids)
        if n == 0:
            raise InvalidParamError("prompt", "the prompt is empty")
        try:
            ids = np.asarray(prompt_ids, np.int64)
        except OverflowError:
            ids = np.asarray([-1])
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidParamError("prompt", f"prompt token ids must lie in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise InvalidParamError(
                "prompt", f"the prompt has {n} tokens; max_model_len {self.max_model_len} leaves no room to generate"
            )
        longest = max(sp.max_tokens for sp in sps)
        if n + longest > self.max_model_len:
            raise InvalidParamError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({longest}) exceeds max_model_len {self.max_model_len}; "
                f"ask for at most {self.max_model_len - n} tokens",
            )

    def submit(self, *group: Request) -> None:
        """Queue a request, or a group that shares one prompt (``n`` / ``best_of``: prefilled once,
        its state copied into one slot per member, all on one device). Thread-safe. Raises
        ``InvalidParamError`` or ``QueueFullError``."""
        if not group or any(r.prompt_ids != group[0].prompt_ids for r in group):
            raise ValueError("a group's requests must share one prompt")
        if len(group) > self.slots_per_device:
            raise InvalidParamError(
                "n", f"n and best_of must be at most {self.slots_per_device} (the slots per device); got {len(group)}"
            )
        self.check(group[0].prompt_ids, *(r.sampling for r in group))
        with self._cv:
            if self._draining:
                raise QueueFullError("the server is shutting down")
            waiting = self._waiting_count()
            if waiting + len(group) > self.max_queue:
                raise QueueFullError(f"{waiting} requests already waiting")
            self._waiting.append(list(group))
            self._cv.notify()

    def cancel(self, *requests: Request) -> None:
        """Cancel requests (thread-safe): a queued one leaves the queue at once, a running one
        frees its slot before the next decode call. Each gets "abort" if it had not finished."""
        with self._cv:
            for r in requests:
                r.cancelled = True
            gone = [g for g in self._waiting if all(r.cancelled for r in g)]
            for g in gone:
                self._waiting.remove(g)
        for g in gone:
            for r in g:
                r.send([], "abort")

    def _waiting_count(self) -> int:
        return sum(len(g) for g in self._waiting)

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return sum(len(r) for r in self._rows), self._waiting_count()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        on_done: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Serve ``prompts`` to completion on the calling thread (batch jobs, evals; not while
        ``serve_forever`` runs): one ``Completion`` per prompt, in order. Warms up first if needed.
        ``on_done(i)`` is called as prompt i finishes (a progress bar). A request that fails
        raises ``RuntimeError`` with its reason."""
        if not self.ready:
            self.warmup()
        sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        outs = [Completion([], "", [], None, 0.0) for _ in prompts]
        reqs = []
        for i, (ids, sp, out) in enumerate(zip(prompts, sps, outs, strict=True)):

            def emit(tokens, reason, out=out, i=i):
                out.tokens.extend(tokens)
                if reason is not None:
                    out.finish_reason = reason
                    if on_done is not None:
                        on_done(i)

            reqs.append(Request(list(ids), sp, emit))
        self.compiles.claim_thread()
        for r in reqs:
            while self.counts()[1] >= self.max_queue:
                self._step()
            self.submit(r)
        self.run_until_idle()
        for r, out in zip(reqs, outs, strict=True):
            out.logprobs, out.prompt_logprobs, out.cumulative_logprob = (
                r.logprobs,
                r.prompt_logprobs,
                r.cumulative_logprob,
            )
            if out.finish_reason == "error":
                raise RuntimeError(r.error)
        return outs

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
        if self.metrics is not None:
            self.metrics.on_engine(self.programs.prefilled_tokens, self.prefix)

    def _end_all(self, reason: str, message: str | None = None) -> None:
        with self._cv:
            waiting, self._waiting = [r for g in self._waiting for r in g], collections.deque()
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
        if self.prefix is not None:
            self.prefix.clear()
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

    def _row_params(self, req: Request) -> dict:
        sp, V = req.sampling, self.vocab_size
        stops = self._stop_ids(sp)
        seed = sp.seed if sp.seed is not None else int(self._seeds.integers(0, MAX_SEED, endpoint=True))
        bias = np.zeros((V,), np.float32)
        if sp.logit_bias:
            bias[list(sp.logit_bias)] = list(sp.logit_bias.values())
        seen = np.zeros((V,), bool)
        if sp.repetition_penalty != 1.0:
            seen[req.prompt_ids] = True
        stop_mask = np.zeros((V,), bool)
        stop_mask[stops] = True
        return {
            "temperature": np.float32(sp.temperature),
            "top_k": np.int32(sp.top_k),
            "top_p": np.float32(sp.top_p),
            "min_p": np.float32(sp.min_p),
            "key": prng_key_data(seed, self.prng_impl),
            "remaining": np.int32(sp.max_tokens - 1),
            "min_tokens": np.int32(sp.min_tokens),
            "presence": np.float32(sp.presence_penalty),
            "frequency": np.float32(sp.frequency_penalty),
            "repetition": np.float32(sp.repetition_penalty),
            "bias": bias,
            "seen": seen,
            "stop_mask": stop_mask,
        }

    def _place(self) -> dict[int, list[Request]]:
        """Take up to one waiting group per device with room for it, least-loaded devices first,
        in arrival order (a group that fits nowhere yet waits, and so does everything behind it)."""
        free = sorted((len(rows), d) for d, rows in enumerate(self._rows) if len(rows) < self.slots_per_device)
        placed: dict[int, list[Request]] = {}
        with self._cv:
            for used, d in free:
                while self._waiting and not self._stop:
                    group = self._waiting[0]
                    if all(r.cancelled for r in group):
                        self._waiting.popleft()
                        for r in group:
                            r.send([], "abort")
                        continue
                    if len(group) <= self.slots_per_device - used:
                        placed[d] = self._waiting.popleft()
                    break
        return placed

    def _prepare(self, placed: dict[int, list[Request]]):
        """Prefill each placed group's prompt once (all devices together); on failure retry each
        alone and end only those that fail alone. Returns (states, logits) or None if none is left."""
        try:
            score = any(r.sampling.prompt_logprobs is not None for g in placed.values() for r in g)
            prompts = {d: g[0].prompt_ids for d, g in placed.items()}
            starts, on_block = self._resume(prompts) if self.prefix is not None and not score else ({}, None)
            block = self.prefix.block if self.prefix is not None else 0
            state, logits, scores = self.programs.prefill_rows(prompts, score, starts, on_block, block)
            for d, group in placed.items():
                for r in group:
                    r.stops = frozenset(self._stop_ids(r.sampling))
                    k = r.sampling.prompt_logprobs
                    if k is not None:
                        r.prompt_logprobs = [e and (e[0], e[1][:k], e[2][:k]) for e in scores[d]]
        except Exception as e:
            if len(placed) == 1:
                for req in next(iter(placed.values())):
                    req.fail(f"this request failed during prefill: {type(e).__name__}: {e}")
                return None
            for d, group in list(placed.items()):  # isolate the failing group(s)
                if self._prepare({d: group}) is None:
                    del placed[d]
            return self._prepare(placed) if placed else None
        return state, logits

    def _resume(self, prompts: dict[int, list[int]]) -> tuple[dict, Callable]:
        """Each prompt's longest cached prefix ({d: (ids restored, state)}) and the prefill's
        callback that caches the block states ``PrefixCache.blocks_to_keep`` picks (only for rows
        whose numbers are those of a full prefill: no resume, or a resume from a block entry)."""
        cache = self.prefix
        starts, digests, keep = {}, {}, {}
        for d, ids in prompts.items():
            arr = np.asarray(ids, np.int32)
            digests[d] = block_digests(arr, cache.block, len(arr) // cache.block)
            hit = cache.lookup(arr, digests[d], d)
            keep[d] = cache.blocks_to_keep(digests[d]) if hit is None or hit.exact else set()
            if hit is not None:
                starts[d] = (hit.length, hit.state)

        def on_block(d: int, n: int, state: Any) -> None:
            if n // cache.block in keep[d]:
                cache.put_block(digests[d][n // cache.block - 1], n, d, state)

        return starts, on_block

    def _keep_ends(self, ended: dict[int, list[tuple[int, Request]]]) -> None:
        """Cache the final states of requests that finished in local slots ``ended[d]`` (before
        compaction moves them), keyed by the prompt and the generated ids fed back."""
        while ended:
            now = {d: items.pop() for d, items in ended.items()}
            ended = {d: items for d, items in ended.items() if items}
            states = self.programs.snapshot({d: i for d, (i, _) in now.items()})
            for d, (_, req) in now.items():
                self.prefix.put_end(np.asarray(req.prompt_ids + req.sampled[:-1], np.int32), d, states[d])

    def _admit(self) -> None:
        while True:
            placed = self._place()
            if not placed:
                return
            now = time.perf_counter()
            for group in placed.values():
                for req in group:
                    req.started_at = now
            self._admitting = [r for g in placed.values() for r in g]
            prepared = self._prepare(dict(placed))
            if prepared is None:
                self._admitting = []
                continue
            state, logits = prepared
            for group in placed.values():  # max_tokens 0: the prompt's scores are all it asked for
                for r in [r for r in group if r.sampling.max_tokens == 0]:
                    group.remove(r)
                    r.send([], "length")
            for k in range(max(len(g) for g in placed.values())):  # member k of every group, one insert
                members = {d: g[k] for d, g in placed.items() if k < len(g)}
                if members:
                    self._insert(state, logits, members)
            self._admitting = []

    def _insert(self, state, logits, members: dict[int, Request]) -> None:
        """Copy the prefilled state into a new slot per device for ``members``; emit first tokens."""
        where = {d: (len(self._rows[d]), self._row_params(r)) for d, r in members.items()}
        first, lps = self.programs.insert(state, logits, where)  # failures go to _recover
        lp, top_ids, top_lp = _read_if(lps, members.values())
        now = time.perf_counter()
        for d, req in members.items():
            tok = int(first[d])
            req.first_token_at = now
            if self.metrics is not None:
                self.metrics.on_first_token(req)
            finished = self._accept(req, tok, lp is not None and (float(lp[d]), top_ids[d], top_lp[d]))
            req.send([] if finished == "stop" else [tok], finished)
            if finished is None:  # else its slot stays past the live ones, to be overwritten
                self._rows[d].append(req)

    def _accept(self, req: Request, token: int, scored) -> str | None:
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
        toks, valid, lps = self.programs.decode(W)
        lp, top_ids, top_lp = _read_if(lps, self._live())
        done: dict[int, list[int]] = {}
        ended: dict[int, list[tuple[int, Request]]] = {}  # finished as asked: their states are cached
        for d, rows in enumerate(self._rows):
            for i, req in enumerate(rows):
                out, reason = [], None
                for k in range(self.steps_per_call):
                    if not valid[k, d, i]:
                        break
                    t = int(toks[k, d, i])
                    scored = lp is not None and (float(lp[k, d, i]), top_ids[k, d, i], top_lp[k, d, i])
                    reason = self._accept(req, t, scored)
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
        if self.metrics is not None:
            self.metrics.on_decode(W, live, time.perf_counter() - t0, self.steps_per_call)
        if ended and self.prefix is not None:
            self._keep_ends(ended)
        if done:
            self._free(done)


def _read_if(lps: tuple, requests) -> tuple:
    """The device's logprob outputs on the host if any of ``requests`` uses them, else Nones (a
    device-to-host copy saved on every call that nobody reads)."""
    if any(r.wants_logprobs for r in requests):
        return tuple(np.asarray(x) for x in lps)
    return None, None, None
