"""The serving engine: the public face of serving (submit, cancel, generate, status) and the
engine thread, whose every step is ``plan = scheduler.schedule()``, ``out = runner.execute(plan)``,
``scheduler.update(plan, out)``.

The pieces: ``scheduler.Scheduler`` decides (``queue.WaitQueue``: arrival order, capacity, drain;
``slots.Slots``: the live requests per device, compaction; ``prefix_cache.PrefixCache``'s
bookkeeping), ``runner.Runner`` executes a plan on ``programs.DevicePrograms`` (slot buffers
sharded over devices and the compiled prefill / insert / decode / move programs). The server
talks to ``Engine``'s public methods only.

Slots: ``max_num_seqs`` per device on each of D devices. A request goes to the least-loaded
device (fewest live slots; the lowest index on a tie). One thread runs ``loop()``; requests
arrive through ``submit`` (thread-safe) and get their tokens through a callback. Compiles are
counted from JAX's own events (``compiles.py``) and must stay at 0 in phase "serving" for
bucketed widths; ``buckets="exact"`` compiles each new width on demand (kept to measure the cost
of unbucketed widths).

Fault isolation: a request whose preparation fails alone is ended with an error (see
``scheduler``). A failure of the shared device loop (insert, decode, move: they donate the slot
buffers) ends the requests in the slots and those being admitted; each part resets what it
owns (the scheduler its slots and cache entries, the runner its buffers and executables), the
engine re-warms (from the persistent compile cache when one is set) and serves the queue again;
more than ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` marks the engine dead.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from laplace_jax.config import ModelConfig
from laplace_jax.errors import InvalidParamError, UserError
from laplace_jax.layers.attention import ring_size
from laplace_jax.platform import prng_impl
from laplace_jax.serve.compiles import CompileCounter
from laplace_jax.serve.config import ServeConfig
from laplace_jax.serve.plan import StepPlan
from laplace_jax.serve.prefix_cache import PrefixCache
from laplace_jax.serve.programs import DevicePrograms
from laplace_jax.serve.request import Completion, Request, SamplingParams, check_prompt
from laplace_jax.serve.runner import Runner
from laplace_jax.serve.scheduler import Scheduler, make_buckets, prefix_cache
from laplace_jax.speculative import NgramSpec

if TYPE_CHECKING:  # a type only: eval runs the engine without metrics
    from laplace_jax.serve.metrics import ServeMetrics

MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0
DEFAULT = ServeConfig()


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


def build(
    cfg: ModelConfig,
    params: Any,
    serve: ServeConfig,
    devices: list[jax.Device],
    eos_id: int,
    metrics: ServeMetrics | None,
    max_model_len: int,
) -> tuple[Runner, Scheduler]:
    """The runner (the device programs on ``devices``) and the scheduler for ``serve``."""
    programs = DevicePrograms(
        cfg,
        params,
        devices,
        serve.max_num_seqs,
        serve.prefill_chunk,
        serve.steps_per_call,
        prng_impl(serve.prng_impl),
        serve.structured_states,
        serve.speculation(),
        max_model_len,
        serve.jump_forward,
    )
    buckets = make_buckets(serve.buckets(), serve.max_num_seqs)
    prefix = prefix_cache(
        serve.prefix_cache_bytes,
        serve.prefix_block,
        serve.prefill_chunk,
        cfg.chunk_size,
        programs.state_bytes,
        len(devices),
    )
    scheduler = Scheduler(
        devices=len(devices),
        per_device=serve.max_num_seqs,
        vocab_size=cfg.vocab_size,
        eos_id=eos_id,
        buckets=buckets,
        steps_per_call=serve.steps_per_call,
        max_queue=serve.max_queue,
        prng=programs.prng,
        prefix=prefix,
        metrics=metrics,
        grammar_rows=serve.structured_states,
    )
    return Runner(programs, compile_on_demand=buckets is None), scheduler


def ready_line(programs: DevicePrograms, n: int, took: float) -> str:
    """The serve banner's line once ``n`` programs compiled in ``took`` s: the GLA kernels in them,
    speculation and jump-forward."""
    kernels = ", ".join(programs.gla_kernels()) or "none found"
    lay = programs.layout
    jump = f"up to {lay.draft_tokens} forced tokens per step" if lay.draft_tokens else "off"
    ready = f"ready: {n} programs compiled in {took:.1f} s; GLA kernels in them: {kernels}"
    return f"{ready}; {NgramSpec.describe(lay.speculation)}; structured jump-forward: {jump}"


class Engine:
    """Serves ``cfg`` with ``params`` from fixed per-sequence states in decode slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        serve: ServeConfig = DEFAULT,
        *,
        eos_id: int,
        metrics: ServeMetrics | None = None,
        devices: Sequence[jax.Device] | None = None,
    ):
        """``serve``: the engine's settings (``max_num_seqs`` slots per device, buckets, prefill
        chunk, steps per call, max_model_len, queue, prefix cache, PRNG); ``devices``: where the
        slots live (default: the first ``serve.devices`` local devices, all when None)."""
        max_model_len = serve.max_model_len or cfg.max_seq_len
        check_model_len(cfg, max_model_len)
        self.cfg, self.serve, self.max_model_len, self.metrics = cfg, serve, max_model_len, metrics
        self.slots_per_device, self.prefill_chunk = serve.max_num_seqs, serve.prefill_chunk
        self.compiles = CompileCounter(metrics.on_compile if metrics is not None else None)
        local = jax.local_devices()
        if devices is None and serve.devices is not None and serve.devices > len(local):
            raise UserError(f"--devices must lie in 1..{len(local)} (the local {local[0].platform} devices)")
        self.devices = list(devices) if devices else local[: serve.devices or len(local)]
        self.n_devices = len(self.devices)
        self.runner, self.scheduler = build(cfg, params, serve, self.devices, eos_id, metrics, max_model_len)
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
        return self.runner.programs

    @property
    def prefix(self) -> PrefixCache | None:
        return self.scheduler.prefix

    @property
    def buckets(self) -> list[int] | None:
        return self.scheduler.buckets

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state (what a slot or a prefix-cache entry holds)."""
        return self.runner.programs.state_bytes

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
        return self.scheduler.counts()

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

    def check_group(self, size: int) -> None:
        """Raise ``InvalidParamError`` unless a group of ``size`` members fits one device's slots."""
        if not 1 <= size <= self.slots_per_device:
            raise InvalidParamError(
                "n", f"n and best_of must lie in 1..{self.slots_per_device} (the slots per device); got {size}"
            )

    def submit(self, *group: Request) -> None:
        """Queue a request, or a group that shares one prompt (``n`` / ``best_of``: prefilled once,
        its state copied into one slot per member, all on one device). Raises
        ``InvalidParamError`` or ``QueueFullError``."""
        if not group or any(r.prompt_ids != group[0].prompt_ids for r in group):
            raise ValueError("a group's requests must share one prompt")
        self.check_group(len(group))
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
                self.step()
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
        while not self.scheduler.idle():
            self.step()

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
            on_ready(
                ready_line(self.programs, len(self.programs.programs(self.buckets or [])), time.perf_counter() - start)
            )
        self.loop()

    def step(self) -> StepPlan:
        """One engine step: plan, execute, update; returns the plan. A device-loop failure
        raises ``DeviceLoopError``."""
        sched = self.scheduler
        plan = sched.schedule()
        if not plan:
            return plan
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(plan, sched.early_masks)
        except Exception as e:
            raise DeviceLoopError(plan, f"{type(e).__name__}: {e}") from e
        sched.update(plan, out)
        if self.metrics is not None:
            if plan.decode_width is not None:
                tokens, took = int(out.decoded[1].sum()), time.perf_counter() - t0  # a speculative row gets 1 .. K+1
                self.metrics.on_decode(plan.decode_width, list(plan.live), took, sum(plan.decode_steps), tokens)
            self.metrics.on_engine(self.programs.prefilled_tokens, self.prefix, self.programs.speculation_counts)
        return plan

    def loop(self) -> None:
        """The engine thread: serve until ``stop``; recover from device-loop failures (see module doc)."""
        self.compiles.claim_thread()
        while self.scheduler.queue.wait_for_work(self.scheduler.idle):
            try:
                self.step()
            except DeviceLoopError as e:  # the shared device loop failed: end the slots' requests, rebuild, re-warm
                if not self._recover(e.reason, e.plan):
                    return

    def _recover(self, reason: str, plan: StepPlan) -> bool:
        """Reset the scheduler and the runner and re-warm after a device-loop failure; False if
        the engine gave up."""
        now = time.perf_counter()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        sched = self.scheduler
        sched.reset(f"the engine's device loop failed ({reason}); the request was ended and the engine restarted", plan)
        if len(self._restart_times) > MAX_RESTARTS:
            self.dead = f"{reason} ({len(self._restart_times)} device-loop failures within {RESTART_WINDOW_S:.0f} s)"
            sched.end_all("error", f"engine failed: {self.dead}")
            return False
        self.ready, self.restarting = False, reason
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.restarts.inc()
        try:
            self.runner.reset()
            self.warmup()
        except Exception as e:
            self.dead = f"restart after {reason} failed: {type(e).__name__}: {e}"
            sched.end_all("error", f"engine failed: {self.dead}")
            return False
        self.restarting = None
        return True


class DeviceLoopError(Exception):
    """The device loop failed while running ``plan`` (``reason``: the error)."""

    def __init__(self, plan: StepPlan, reason: str):
        super().__init__(reason)
        self.plan, self.reason = plan, reason
