"""Prometheus metrics in vLLM's naming style (prefix ``laplace:``), one registry per server, and
the same values under vLLM's own names (``vllm:*``), which routers, autoscalers and the
Kubernetes Gateway API Inference Extension read (``VllmNames``)."""

from __future__ import annotations

import time

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from laplace_jax.serve.structured import TokenAutomaton

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "laplace:"
        self.running = Gauge(p + "num_requests_running", "Requests in decode slots", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests in the admission queue", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens", registry=r)
        self.finished = Counter(p + "request_success_total", "Finished requests", ["finished_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LAT, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Decode seconds per token", buckets=_LAT, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", buckets=_LAT, registry=r)
        self.queue = Histogram(p + "request_queue_time_seconds", "Arrival to prefill start", buckets=_LAT, registry=r)
        self.decode_steps = Counter(p + "decode_steps_total", "Decode steps by bucket width", ["bucket"], registry=r)
        self.padding = Counter(p + "decode_padding_rows_total", "Idle rows computed by bucket", ["bucket"], registry=r)
        self.step_seconds = Histogram(
            p + "decode_step_seconds", "Seconds per decode call by bucket", ["bucket"], buckets=_LAT, registry=r
        )
        self.compiles = Counter(
            p + "compiles_total",
            "XLA compilations on the engine thread (JAX's events)",
            ["phase", "function"],
            registry=r,
        )
        self.compile_seconds = Counter(p + "compile_seconds_total", "Seconds spent compiling", ["phase"], registry=r)
        self.restarts = Counter(p + "engine_restarts_total", "Device-loop failures recovered by a restart", registry=r)
        self.errors = Counter(p + "request_errors_total", "Requests ended by an error, by kind", ["kind"], registry=r)
        self.device_slots_used = Gauge(p + "device_slots_used", "Live decode slots per device", ["device"], registry=r)
        self.device_slots_total = Gauge(p + "device_slots_total", "Decode slots per device", registry=r)
        self.cache_hits = Counter(p + "compile_cache_hits_total", "Persistent compile cache hits", registry=r)
        self.cache_misses = Counter(p + "compile_cache_misses_total", "Persistent compile cache misses", registry=r)
        self.prefill_tokens = Counter(
            p + "prefill_tokens_total", "Prompt ids run through prefill (restored ones excluded)", registry=r
        )
        self.prefix_hits = Counter(p + "prefix_cache_hits_total", "Prompts resumed from a cached state", registry=r)
        self.prefix_misses = Counter(p + "prefix_cache_misses_total", "Prompts with no cached prefix", registry=r)
        self.prefix_tokens = Counter(
            p + "prefix_cache_tokens_total", "Prompt ids restored from the prefix cache, not prefilled", registry=r
        )
        self.prefix_evictions = Counter(p + "prefix_cache_evictions_total", "Entries evicted (LRU)", registry=r)
        self.prefix_cross = Counter(
            p + "prefix_cache_cross_device_total", "Hits on another device's entry (one copy each)", registry=r
        )
        self.prefix_bytes = Gauge(p + "prefix_cache_bytes", "Bytes the prefix cache holds", ["device"], registry=r)
        self.prefix_entries = Gauge(p + "prefix_cache_entries", "Entries the prefix cache holds", registry=r)
        self.grammar_compiles = Histogram(
            p + "structured_compile_seconds",
            "Time to compile a new structured-output automaton",
            buckets=_LAT,
            registry=r,
        )
        self.grammar_states = Histogram(
            p + "structured_automaton_states",
            "States of each new structured-output automaton (x vocab x 2 bytes on device)",
            buckets=(8, 32, 128, 512, 2048, 8192),
            registry=r,
        )
        self.spec_drafts = Counter(
            p + "spec_decode_num_drafts", "Speculative verify steps of rows that had a draft", registry=r
        )
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted = Counter(
            p + "spec_decode_num_accepted_tokens", "Draft tokens accepted (emitted as the model's own)", registry=r
        )
        self._synced: dict[str, int] = {}
        self._vllm: VllmNames | None = None
        jax.monitoring.register_event_listener(self._on_event)

    def export_vllm_names(self, model_name: str) -> None:
        """Also export the vLLM-named metrics (``VllmNames``) with ``model_name`` as their label."""
        if self._vllm is None:
            self._vllm = VllmNames(self, model_name)
            self.registry.register(self._vllm)

    @staticmethod
    def total(counter: Counter) -> int:
        """A counter's value summed over its labels (what it exported, read back)."""
        return int(sum(x.value for m in counter.collect() for x in m.samples if x.name.endswith("_total")))

    def _on_event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits.inc()
        elif event == "/jax/compilation_cache/cache_misses":
            self.cache_misses.inc()

    # Engine callbacks (engine thread).
    def on_compile(self, phase: str, function: str, seconds: float) -> None:
        self.compiles.labels(phase, function).inc()
        self.compile_seconds.labels(phase).inc(seconds)

    def on_first_token(self, req) -> None:
        self.ttft.observe(req.first_token_at - req.arrival)
        self.queue.observe(req.started_at - req.arrival)
        self.prompt_tokens.inc(len(req.prompt_ids))

    def set_devices(self, devices: int, slots_per_device: int) -> None:
        self.device_slots_total.set(slots_per_device)
        for d in range(devices):
            self.device_slots_used.labels(str(d)).set(0)

    def on_decode(self, width: int, live: list[int], seconds: float, steps: int, tokens: int) -> None:
        """``live``: live slots per device; each device computes ``width`` rows; ``tokens``: what
        the live rows received (a speculative step gives a row 1 .. K + 1)."""
        self.decode_steps.labels(str(width)).inc(steps)
        self.padding.labels(str(width)).inc(sum(width - n for n in live) * steps)
        self.step_seconds.labels(str(width)).observe(seconds)
        if tokens:
            self.itl.observe(seconds * max(sum(live), 1) / tokens)

    def on_engine(self, prefilled_tokens: int, prefix, speculation=(0, 0, 0)) -> None:
        """Bring the engine's own counters (prefill ids run; ``prefix``: its ``PrefixCache`` or
        None; ``speculation``: the decode calls' (drafts, draft tokens, accepted tokens), counted
        on the device) into the exported ones."""
        now = {"prefill": prefilled_tokens}
        now |= dict(zip(("drafts", "draft_tokens", "accepted"), (int(x) for x in speculation), strict=True))
        if prefix is not None:
            st = prefix.stats
            now |= {"hits": st.hits, "misses": st.misses, "tokens": st.cached_tokens}
            now |= {"evictions": st.evictions, "cross": st.cross_device}
            for d, held in enumerate(prefix.held):
                self.prefix_bytes.labels(str(d)).set(held)
            self.prefix_entries.set(len(prefix))
        counters = {"prefill": self.prefill_tokens, "hits": self.prefix_hits, "misses": self.prefix_misses}
        counters |= {"tokens": self.prefix_tokens, "evictions": self.prefix_evictions, "cross": self.prefix_cross}
        counters |= {"drafts": self.spec_drafts, "draft_tokens": self.spec_draft_tokens, "accepted": self.spec_accepted}
        for name, value in now.items():
            delta = value - self._synced.get(name, 0)
            if delta > 0:
                counters[name].inc(delta)
            self._synced[name] = value

    def on_grammar(self, automaton) -> None:
        """A structured-output automaton (or host grammar: no states) was compiled (its compile time and size)."""
        self.grammar_compiles.observe(automaton.compile_s)
        if isinstance(automaton, TokenAutomaton):
            self.grammar_states.observe(automaton.states)

    def on_finish(self, req, reason: str, generated: int) -> None:
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(generated)
        self.e2e.observe(time.perf_counter() - req.arrival)


class VllmNames:
    """A collector that exports some of ``ServeMetrics`` again under vLLM's names, read from the same
    objects at each scrape (the same values; nothing is counted twice), each with vLLM's
    ``model_name`` label, plus the gauges vLLM derives:

    - ``vllm:gpu_cache_usage_perc`` and ``vllm:kv_cache_usage_perc``: the share of decode slots in
      use (a sequence's state is fixed-size, so slots are what a KV cache's blocks are to vLLM);
    - ``vllm:gpu_prefix_cache_hit_rate``: prompt tokens restored from the prefix cache over prompt
      tokens, with ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens) behind it."""

    def __init__(self, metrics: ServeMetrics, model_name: str):
        self.m, self.labels = metrics, {"model_name": model_name}

    def _renamed(self, metric) -> list[Metric]:
        out = []
        for family in metric.collect():
            renamed = Metric(family.name.replace("laplace:", "vllm:", 1), family.documentation, family.type)
            renamed.samples = [
                Sample(s.name.replace("laplace:", "vllm:", 1), {**s.labels, **self.labels}, s.value, s.timestamp)
                for s in family.samples
            ]
            out.append(renamed)
        return out

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = Metric(name, doc, "gauge")
        g.add_sample(name, self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = Metric(name, doc, "counter")
        c.add_sample(name + "_total", self.labels, value)
        return c

    def collect(self):
        m = self.m
        mirrored = (m.running, m.waiting, m.prompt_tokens, m.generation_tokens, m.finished)
        mirrored += (m.spec_drafts, m.spec_draft_tokens, m.spec_accepted)
        for metric in (*mirrored, m.ttft, m.itl, m.e2e, m.queue):
            yield from self._renamed(metric)
        per_device_used = [s.value for f in m.device_slots_used.collect() for s in f.samples]
        per_device = next(s.value for f in m.device_slots_total.collect() for s in f.samples)
        used, devices = sum(per_device_used), len(per_device_used)
        usage = used / (per_device * devices) if per_device and devices else 0.0
        yield self._gauge("vllm:gpu_cache_usage_perc", "Share of decode slots in use (1 = all)", usage)
        yield self._gauge("vllm:kv_cache_usage_perc", "Share of decode slots in use (1 = all)", usage)
        queries, hits = m.total(m.prompt_tokens), m.total(m.prefix_tokens)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens restored from the prefix cache", hits)
        rate = hits / queries if queries else 0.0
        yield self._gauge("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens restored over prompt tokens", rate)


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` (e.g. ``laplace:compiles_total``) whose labels include
    ``labels``, in a Prometheus text exposition (what GET /metrics returns)."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
