"""One step of the serving engine: admit waiting groups into free slots (prefill, insert), then
one decode call over every live slot.

Admission prefills up to one new group per device in one call, the least-loaded devices first.
A group shares one prompt: it is prefilled once and its state copied into one slot per member.
When preparing requests (prefill, sampling rows) fails, each group is retried alone and only a
group that fails alone is ended with an error. With a prefix-state cache (``prefix_cache.py``),
a prompt resumes from its longest cached prefix and prefills only the rest; the prefill leaves
block entries and a request that finishes ("stop" or "length") leaves its final state. Prompts
that ask for prompt logprobs are scored in full (every position is needed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from laplace_jax.config import ModelConfig
from laplace_jax.serve.prefix_cache import ENTRY_OVERHEAD_BYTES, PrefixCache
from laplace_jax.serve.programs import DevicePrograms
from laplace_jax.serve.queue import WaitQueue
from laplace_jax.serve.request import MAX_SEED, Request, row_params, stop_ids
from laplace_jax.serve.slots import Slots, accept, read_if

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
    if budget < 0:
        raise ValueError(f"--prefix-cache-bytes must be >= 0; got {budget}")
    entry_bytes += ENTRY_OVERHEAD_BYTES
    return PrefixCache(budget, entry_bytes, block, devices) if budget >= entry_bytes else None


class Scheduler:
    """The host side of serving ``cfg`` on ``devices``: the queue, the slots, the compiled
    programs and the prefix cache, and ``step()``, which the engine thread calls."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        devices: Sequence[jax.Device],
        *,
        eos_id: int,
        max_num_seqs: int,
        buckets: list[int] | None,
        prefill_chunk: int,
        steps_per_call: int,
        max_queue: int,
        prng: str,
        prefix_cache_bytes: int,
        prefix_block: int | None,
        metrics: ServeMetrics | None,
    ):
        self.cfg, self.eos_id, self.prng_impl, self.metrics = cfg, eos_id, prng, metrics
        self.buckets, self.steps_per_call = buckets, steps_per_call
        self.programs = DevicePrograms(cfg, params, devices, max_num_seqs, prefill_chunk, steps_per_call, prng)
        self.prefix = prefix_cache(
            prefix_cache_bytes, prefix_block, prefill_chunk, cfg.chunk_size, self.programs.state_bytes, len(devices)
        )
        self.queue = WaitQueue(max_queue)
        self.slots = Slots(len(devices), max_num_seqs, self.programs)
        self.admitting: list[Request] = []  # being prefilled: a device-loop failure ends them too
        self._seeds = np.random.default_rng()

    def bucket_for(self, n: int) -> int:
        return n if self.buckets is None else next(w for w in self.buckets if w >= n)

    def idle(self) -> bool:
        return not any(self.slots.rows) and not len(self.queue)

    def step(self) -> None:
        """Admit, end cancelled requests, decode once; at the drain deadline end everything."""
        if time.perf_counter() >= self.queue.deadline:
            self.end_all("shutdown")
            return
        self.admit()
        self.slots.reap_cancelled()
        if any(self.slots.rows):
            self.decode_once()
        if self.metrics is not None:
            self.metrics.on_engine(self.programs.prefilled_tokens, self.prefix)

    def end_all(self, reason: str, message: str | None = None) -> None:
        """End every waiting and live request with ``reason`` ("error": fail with ``message``)."""
        waiting = self.queue.pop_all()
        for r in [*self.slots.clear(), *waiting]:
            if reason == "error":
                r.fail(message or "the engine failed")
            else:
                r.send([], reason)

    def admit(self) -> None:
        """Move waiting groups into free slots until none fits: prefill, then one insert per member rank."""
        while placed := self.queue.take(self.slots.free_devices(), self.slots.per_device):
            now = time.perf_counter()
            for group in placed.values():
                for req in group:
                    req.started_at = now
            self.admitting = [r for g in placed.values() for r in g]
            prepared = self._prepare(dict(placed))
            if prepared is None:
                self.admitting = []
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
            self.admitting = []

    def _prepare(self, placed: dict[int, list[Request]]) -> tuple[Any, Any] | None:
        """Prefill each placed group's prompt once (all devices together); on failure retry each
        alone and end only those that fail alone. Returns (states, logits) or None if none is left."""
        try:
            score = any(r.sampling.prompt_logprobs is not None for g in placed.values() for r in g)
            prompts = {d: g[0].prompt_ids for d, g in placed.items()}
            starts, on_block = self.prefix.plan(prompts) if self.prefix is not None and not score else ({}, None)
            block = self.prefix.block if self.prefix is not None else 0
            state, logits, scores = self.programs.prefill_rows(prompts, score, starts, on_block, block)
            for d, group in placed.items():
                for r in group:
                    r.stops = frozenset(stop_ids(r.sampling, self.eos_id))
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

    def _insert(self, state: Any, logits: Any, members: dict[int, Request]) -> None:
        """Copy the prefilled state into a new slot per device for ``members``; emit first tokens."""
        where = {}
        for d, r in members.items():
            seed = r.sampling.seed
            if seed is None:
                seed = int(self._seeds.integers(0, MAX_SEED, endpoint=True))
            where[d] = (len(self.slots.rows[d]), row_params(r, self.cfg.vocab_size, self.eos_id, seed, self.prng_impl))
        first, lps = self.programs.insert(state, logits, where)  # failures go to the engine's recovery
        lp, top_ids, top_lp = read_if(lps, members.values())
        now = time.perf_counter()
        for d, req in members.items():
            tok = int(first[d])
            req.first_token_at = now
            if self.metrics is not None:
                self.metrics.on_first_token(req)
            finished = accept(req, tok, lp is not None and (float(lp[d]), top_ids[d], top_lp[d]))
            req.send([] if finished == "stop" else [tok], finished)
            if finished is None:  # else its slot stays past the live ones, to be overwritten
                self.slots.rows[d].append(req)

    def ensure_decode(self, width: int) -> None:
        """decode[width] must exist after warmup; only ``buckets="exact"`` compiles new widths here."""
        if self.programs.get("decode", width) is not None:
            return
        if self.buckets is not None:
            raise RuntimeError(f"no compiled decode[{width}] after warmup")  # never recompile silently
        self.programs.compile(*self.programs.decode_program(width))

    def decode_once(self) -> None:
        """One decode call (``steps_per_call`` tokens per live slot) at the smallest bucket that fits."""
        live = self.slots.occupancy()
        W = self.bucket_for(max(live))
        t0 = time.perf_counter()
        self.ensure_decode(W)
        toks, valid, lps = self.programs.decode(W)
        done, ended = self.slots.collect(toks, valid, lps, self.steps_per_call)
        if self.metrics is not None:
            self.metrics.on_decode(W, live, time.perf_counter() - t0, self.steps_per_call)
        if ended and self.prefix is not None:
            self._keep_ends(ended)
        if done:
            self.slots.free(done)

    def _keep_ends(self, ended: dict[int, list[tuple[int, Request]]]) -> None:
        """Cache the final states of requests that finished in slots ``ended[d]`` (before
        compaction moves them), keyed by the prompt and the generated ids fed back."""
        while ended:
            now = {d: items.pop() for d, items in ended.items()}
            ended = {d: items for d, items in ended.items() if items}
            states = self.programs.snapshot({d: i for d, (i, _) in now.items()})
            for d, (_, req) in now.items():
                self.prefix.put_end(np.asarray(req.prompt_ids + req.sampled[:-1], np.int32), d, states[d])
