"""The serving engine: the public face of serving (submit, cancel, generate, status) and the
engine thread that runs ``scheduler.Scheduler.step`` until stopped.

The pieces: ``queue.WaitQueue`` (arrival order, capacity, drain), ``slots.Slots`` (the live
requests per device, compaction), ``programs.DevicePrograms`` (slot buffers sharded over devices
and the compiled prefill / insert / decode / move programs), ``prefix_cache.PrefixCache`` and
``scheduler.Scheduler``, which decides what runs and when. The server talks to ``Engine``'s
public methods only.

Slots: ``max_num_seqs`` per device on each of D devices. A request goes to the least-loaded
device (fewest live slots; the lowest index on a tie). One thread runs ``loop()``; requests
arrive through ``submit`` (thread-safe) and get their tokens through a callback. Compiles are
counted from JAX's own events (``compiles.py``) and must stay at 0 in phase "serving" for
bucketed widths; ``buckets="exact"`` compiles each new width on demand (kept to measure the cost
of unbucketed widths).

Fault isolation: a request whose preparation fails alone is ended with an error (see
``scheduler``). A failure of the shared device loop (insert, decode, move: they donate the slot
buffers) ends the requests in the slots, rebuilds the slots, re-warms (from the persistent
compile cache when one is set) and serves the queue again; more than ``MAX_RESTARTS`` within
``RESTART_WINDOW_S`` marks the engine dead.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from laplace_jax.config import ModelConfig
from laplace_jax.errors import InvalidParamError
from laplace_jax.layers.attention import ring_size
from laplace_jax.platform import prng_impl
from laplace_jax.serve import settings
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.prefix_cache import PrefixCache
from laplace_jax.serve.programs import DevicePrograms
from laplace_jax.serve.request import Completion, Request, SamplingParams, check_prompt
from laplace_jax.serve.scheduler import Scheduler, make_buckets

if TYPE_CHECKING:  # a type only: eval runs the engine without metrics
    from laplace_jax.serve.metrics import ServeMetrics

MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


def check_model_len(cfg: ModelConfig, max_model_len: int) -> None:
    """A hybrid's full-attention layers keep max_seq_len positions per slot: refuse a longer
    max_model_len (a sequence past it would overwrite its oldest keys)."""
    full = sorted(i for spec in cfg.attn or () if spec.window_size is None for i in spec.layers)
    if full and max_model_len > ring_size(cfg, cfg.attn_spec(full[0])):
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_seq_len {cfg.max_seq_len}: its full-attention "
            f"layers {full} keep a KV buffer of max_seq_len positions per slot; serve with max_model_len <= "
            f"{cfg.max_seq_len}"
        )


class Engine:
    """Serves ``cfg`` with ``params`` from fixed per-sequence states in decode slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        eos_id: int,
        max_num_seqs: int = settings.MAX_NUM_SEQS,
        buckets: str | list[int] = "pow2",
        prefill_chunk: int = settings.PREFILL_CHUNK,
        steps_per_call: int = settings.STEPS_PER_CALL,
        max_model_len: int = 2048,
        max_queue: int = settings.MAX_QUEUE,
        metrics: ServeMetrics | None = None,
        devices: Sequence[jax.Device] | None = None,
        prng: str = "auto",
        prefix_cache_bytes: int = 0,
        prefix_block: int | None = None,
    ):
        """``max_num_seqs``: decode slots per device; ``devices``: where slots live (default: the
        first local device; ``serve.py`` passes all of them); ``prng``: the sampling keys'
        implementation (``platform.prng_impl``: "auto" is rbg on Neuron, threefry2x32 elsewhere).
        ``prefix_cache_bytes``: the prefix-state cache's budget per device (0: off); ``prefix_block``:
        its block in ids (default: the lcm of ``cfg.chunk_size`` and ``prefill_chunk``; a multiple
        of both, so a resumed prompt is cut into the same prefill calls and kernel chunks)."""
        check_model_len(cfg, max_model_len)
        self.cfg, self.max_model_len, self.metrics = cfg, max_model_len, metrics
        self.slots_per_device, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.compiles = CompileCounter(metrics.on_compile if metrics is not None else None)
        self.devices = list(devices) if devices else jax.local_devices()[:1]
        self.n_devices = len(self.devices)
        self.scheduler = Scheduler(
            cfg,
            params,
            self.devices,
            eos_id=eos_id,
            max_num_seqs=max_num_seqs,
            buckets=make_buckets(buckets, max_num_seqs),
            prefill_chunk=prefill_chunk,
            steps_per_call=steps_per_call,
            max_queue=max_queue,
            prng=prng_impl(prng),
            prefix_cache_bytes=prefix_cache_bytes,
            prefix_block=prefix_block,
            metrics=metrics,
        )
        self.ready = False
        self.dead: str | None = None
        self.restarts = 0
        self.restarting: str | None = None  # the failure being recovered from
        self._restart_times: collections.deque[float] = collections.deque()
        if metrics is not None:
            metrics.set_devices(self.n_devices, self.slots_per_device)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def programs(self) -> DevicePrograms:
        return self.scheduler.programs

    @property
    def prefix(self) -> PrefixCache | None:
        return self.scheduler.prefix

    @property
    def buckets(self) -> list[int] | None:
        return self.scheduler.buckets

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state (what a slot or a prefix-cache entry holds)."""
        return self.scheduler.programs.state_bytes

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
        return self.scheduler.slots.occupancy()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return sum(self.occupancy()), len(self.scheduler.queue)

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

    # ----- host API (thread-safe) -------------------------------------------------------
    def check(self, prompt_ids: list[int], *sps: SamplingParams) -> None:
        """Raise ``InvalidParamError`` if a request (or a group sharing ``prompt_ids``, one
        ``SamplingParams`` per member) cannot be served as given."""
        check_prompt(prompt_ids, sps, self.vocab_size, self.max_model_len)

    def submit(self, *group: Request) -> None:
        """Queue a request, or a group that shares one prompt (``n`` / ``best_of``: prefilled once,
        its state copied into one slot per member, all on one device). Raises
        ``InvalidParamError`` or ``QueueFullError``."""
        if not group or any(r.prompt_ids != group[0].prompt_ids for r in group):
            raise ValueError("a group's requests must share one prompt")
        if len(group) > self.slots_per_device:
            raise InvalidParamError(
                "n", f"n and best_of must be at most {self.slots_per_device} (the slots per device); got {len(group)}"
            )
        self.check(group[0].prompt_ids, *(r.sampling for r in group))
        self.scheduler.queue.put(list(group))

    def cancel(self, *requests: Request) -> None:
        """Cancel requests: a queued one leaves the queue at once, a running one frees its slot
        before the next decode call. Each gets "abort" if it had not finished."""
        self.scheduler.queue.cancel(requests)

    def begin_drain(self, timeout: float) -> None:
        """Stop admitting new requests; ``timeout`` s from now, end whatever still runs with "shutdown"."""
        self.scheduler.queue.drain(timeout)

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop admitting; with ``drain`` let in-flight requests finish (at most ``timeout`` s), then end the loop."""
        queue = self.scheduler.queue
        queue.drain(timeout if drain else 0.0)
        while self.counts() != (0, 0) and self.dead is None and time.perf_counter() < queue.deadline + 5.0:
            time.sleep(0.02)
        queue.stop()

    # ----- running ----------------------------------------------------------------------
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
            while self.counts()[1] >= self.scheduler.queue.max_queue:
                self.scheduler.step()
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

    def run_until_idle(self) -> None:
        """Serve every submitted request to completion on the calling thread (batch jobs, evals)."""
        self.compiles.claim_thread()
        while self.counts() != (0, 0):
            self.scheduler.step()

    def serve_forever(
        self, progress: Callable[[str], None] | None = None, on_ready: Callable[[str], None] | None = None
    ) -> None:
        """``warmup`` then ``loop`` (the engine thread's body). A failed warmup marks the engine
        dead with the reason, which ``status`` reports. ``on_ready`` gets one line once warm."""
        start = time.perf_counter()
        try:
            self.warmup(progress)
        except Exception as e:  # reported by status(); the server answers 503 with it
            self.dead = f"warmup failed: {type(e).__name__}: {e}"
            if on_ready:
                on_ready(f"not serving: {self.dead}")
            return
        if on_ready:
            n = len(self.programs.programs(self.buckets or []))
            on_ready(f"ready: {n} programs compiled in {time.perf_counter() - start:.1f} s")
        self.loop()

    def loop(self) -> None:
        """The engine thread: serve until ``stop``; recover from device-loop failures (see module doc)."""
        self.compiles.claim_thread()
        while self.scheduler.queue.wait_for_work(self.scheduler.idle):
            try:
                self.scheduler.step()
            except Exception as e:  # the shared device loop failed: end the slots' requests, rebuild, re-warm
                if not self._recover(f"{type(e).__name__}: {e}"):
                    return

    def _recover(self, reason: str) -> bool:
        """Rebuild the slots and re-warm after a device-loop failure; False if the engine gave up."""
        now = time.perf_counter()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        message = f"the engine's device loop failed ({reason}); the request was ended and the engine restarted"
        sched = self.scheduler
        for r in [*sched.slots.clear(), *sched.admitting]:
            r.fail(message)
        sched.admitting = []
        if len(self._restart_times) > MAX_RESTARTS:
            self.dead = f"{reason} ({len(self._restart_times)} device-loop failures within {RESTART_WINDOW_S:.0f} s)"
            sched.end_all("error", f"engine failed: {self.dead}")
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
            sched.end_all("error", f"engine failed: {self.dead}")
            return False
        self.restarting = None
        return True
