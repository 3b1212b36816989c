"""``ServeConfig``: every serving setting, its help text, its range and its default, in one place.

``serve.py``'s flags are generated from the fields (``add_flags`` / ``from_flags``: a field
``max_num_seqs`` is the flag ``--max-num-seqs``), ``Engine`` and ``Server`` read theirs from it,
and a value out of range is refused when the config is built, with the setting's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from laplace_jax.errors import UserError
from laplace_jax.ops.gla.limits import IMPLS
from laplace_jax.platform import PRNG_IMPLS
from laplace_jax.speculative import NgramSpec

GROUPS = ("model", "engine", "sampling defaults", "HTTP")


def byte_size(text: str) -> int:
    """ "1073741824", "512M", "1G" -> bytes (K, M, G: powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        value = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes like 1073741824, 512M or 1G; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text!r}")
    return value


MAX_STRUCTURED_STATES = 2**15 - 1  # the grammar table's entries are int16 row indices (``slot_programs``)


def _setting(default: Any, group: str, help: str, *, lo: float | None = None, positive: bool = False, **flag: Any):
    """A field with its help text, its flag's group and its range (``lo`` <= value; ``positive``:
    > 0); ``flag``: extra ``argparse`` arguments (``choices``, ``type``; ``shown``: the flag's
    default as --help shows it, parsed by its ``type``; ``aliases``: other spellings, vLLM's)."""
    meta = {"group": group, "help": help, "lo": lo, "positive": positive, "flag": flag}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How to serve a model: what to load, the engine's sizes, the default sampling, the HTTP limits."""

    # model
    checkpoint: str | None = _setting(None, "model", "train.py workdir or model directory (default: newest in runs/)")
    step: int | None = _setting(None, "model", "checkpoint step of a workdir (default: the newest)", lo=0)
    tokenizer: str | None = _setting(None, "model", "tokenizer spec for model directories ('byte' or tokenizer.json)")
    model_name: str | None = _setting(
        None, "model", "model id clients send (default: directory name)", aliases=("--served-model-name",)
    )
    exact: bool = _setting(
        False, "model", "reproducibility over speed: float32 compute, no excess precision, deterministic XLA ops"
    )
    weights_dtype: str | None = _setting(
        None,
        "model",
        "dtype the weights are cast to once at load (default: the model's compute dtype; --exact: float32)",
        choices=("float32", "bfloat16", "float16"),
    )
    attn_impl: str | None = _setting(
        None,
        "model",
        "GLA kernels to serve with (default: the checkpoint's model.attn_impl); 'mosaic' on a TPU takes the "
        "Pallas TPU decode steps where they apply (docs/tpu.md)",
        choices=IMPLS,
    )
    # engine
    max_num_seqs: int = _setting(8, "engine", "decode slots per device (sequences decoded together)", lo=1)
    devices: int | None = _setting(
        None,
        "engine",
        "local devices to spread the slots over, along a 'data' mesh axis with the weights replicated on each "
        "(default: all local devices)",
        lo=1,
    )
    decode_buckets: str = _setting(
        "pow2", "engine", "'pow2' (1, 2, 4, ... and max-num-seqs), 'exact' (compile each width on demand), or '1,4,8'"
    )
    prefill_chunk: int = _setting(64, "engine", "tokens per prefill call (one executable)", lo=1)
    steps_per_call: int = _setting(4, "engine", "decode tokens per device dispatch", lo=1)
    max_model_len: int | None = _setting(
        None, "engine", "prompt + output limit in tokens (default: the model's max_seq_len)", lo=2
    )
    max_queue: int = _setting(64, "engine", "waiting requests before 429", lo=1)
    speculative_config: str | None = _setting(
        None,
        "engine",
        'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (n-gram prompt lookup: draft tokens from earlier in the sequence, verified '
        "K + 1 at a time; greedy output unchanged, sampled output keeps its distribution)",
    )
    jump_forward: int = _setting(
        0,
        "engine",
        "structured outputs: forced tokens (a JSON key, a closing brace) a decode step feeds at once in the "
        "middle of an output, as a verify of K + 1 tokens (0: one per step; forced tokens at an output's start are "
        "always fed with the prompt). With --speculative-config its num_speculative_tokens is K and this must be 0 "
        "or equal to it",
        lo=0,
    )
    prefix_cache_bytes: int = _setting(
        1 << 30,
        "engine",
        "prefix-state cache budget per device (bytes; K/M/G suffixes are powers of 1024; 0 turns it off): states "
        "after shared prompt blocks and after finished requests, so a shared prefix or a chat's next turn "
        "prefills only what is new. One entry is one sequence's state (29.5 MB for the 3B model)",
        lo=0,
        type=byte_size,
        shown="1G",
    )
    prefix_block: int | None = _setting(
        None,
        "engine",
        "prefix-cache block in tokens (default and unit: lcm of the model's chunk_size and --prefill-chunk)",
        lo=1,
    )
    structured_states: int = _setting(
        4096,
        "engine",
        "structured outputs: automaton states held on every device at once (a [states, vocab] int16 table: "
        "419 MB for the 3B model's vocabulary, 17 MB for the tiny one's, whose 256 ids pad to one 16 x 128 "
        "tile; at most 32767); also the most one request's schema, regex or choice list may compile to",
        lo=1,
    )
    structured_timeout_s: float = _setting(
        10.0, "engine", "seconds a request's schema, regex or choice list may take to compile (then 400)", lo=0.1
    )
    prng_impl: str = _setting(
        "auto",
        "engine",
        "sampling keys: auto = rbg on Neuron (its threefry support is incomplete), threefry2x32 elsewhere",
        choices=PRNG_IMPLS,
    )
    compile_cache_dir: str | None = _setting(None, "engine", "persistent compile cache (JAX; Neuron's on Neuron)")
    # sampling defaults (a request's own fields override them)
    temperature: float = _setting(1.0, "sampling defaults", "default sampling temperature", lo=0.0)
    top_p: float = _setting(1.0, "sampling defaults", "default top-p", positive=True)
    max_tokens: int = _setting(16, "sampling defaults", "default max_tokens", lo=1)
    # HTTP
    host: str = _setting("127.0.0.1", "HTTP", "address to listen on (0.0.0.0: every interface)")
    port: int = _setting(8000, "HTTP", "port to listen on", lo=0)
    api_key: str | None = _setting(
        None,
        "HTTP",
        "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(default: $LAPLACE_API_KEY; unset = no auth)",
    )
    access_log: bool = _setting(False, "HTTP", "log every HTTP request (uvicorn's access log)")
    protect_metrics: bool = _setting(False, "HTTP", "require the API key on /metrics too")
    profile_dir: str | None = _setting(
        None,
        "HTTP",
        "enable POST /start_profile and /stop_profile: a jax.profiler trace written here "
        "(view: tensorboard --logdir DIR, profile tab)",
    )
    drain_timeout: float = _setting(
        30.0,
        "HTTP",
        "SIGTERM bound in seconds: new requests are refused at once, running ones finish or end with "
        "finish_reason 'length' before this, then the process exits",
        positive=True,
    )
    max_body_bytes: int = _setting(1 << 20, "HTTP", "request body cap (413 above it)", positive=True)
    body_timeout: float = _setting(30.0, "HTTP", "seconds for a request body to arrive (408)", positive=True)
    header_timeout: float = _setting(10.0, "HTTP", "seconds for a connection to send a request head", positive=True)
    keep_alive: float = _setting(5.0, "HTTP", "seconds an idle kept-alive connection stays open", positive=True)
    max_connections: int = _setting(1024, "HTTP", "open connections; more are closed as they arrive", positive=True)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, lo, positive = getattr(self, f.name), f.metadata["lo"], f.metadata["positive"]
            choices = f.metadata["flag"].get("choices")
            if value is None or isinstance(value, bool):
                continue
            if choices is not None and value not in choices:
                raise SettingError(f.name, f"must be one of {', '.join(choices)}; got {value!r}")
            if lo is not None and value < lo:
                raise SettingError(f.name, f"must be >= {lo}; got {value}")
            if positive and not value > 0:
                raise SettingError(f.name, f"must be positive; got {value}")
        if self.structured_states > MAX_STRUCTURED_STATES:  # the table's int16 entries index its rows
            raise SettingError("structured_states", f"must be <= {MAX_STRUCTURED_STATES}; got {self.structured_states}")
        if self.speculative_config is not None:
            try:
                k = NgramSpec.parse(self.speculative_config).num_speculative_tokens
            except ValueError as e:
                raise SettingError("speculative_config", str(e)) from None
            if self.jump_forward not in (0, k):
                raise SettingError(
                    "jump_forward",
                    f"is {self.jump_forward} but --speculative-config verifies {k} draft tokens per step (one verify "
                    f"serves both): pass 0 or {k}",
                )
        if self.decode_buckets not in ("pow2", "exact"):
            widths = self.decode_buckets.split(",")
            if not all(w.strip().isdigit() and 1 <= int(w) <= self.max_num_seqs for w in widths):
                raise SettingError(
                    "decode_buckets",
                    f"must be 'pow2', 'exact' or widths in 1..max_num_seqs ({self.max_num_seqs}) like 1,4,8; "
                    f"got {self.decode_buckets!r}",
                )

    def speculation(self) -> NgramSpec | None:
        """``speculative_config`` parsed (None: no speculation)."""
        return None if self.speculative_config is None else NgramSpec.parse(self.speculative_config)

    def buckets(self) -> str | list[int]:
        """``decode_buckets`` as ``scheduler.make_buckets`` takes it."""
        if self.decode_buckets in ("pow2", "exact"):
            return self.decode_buckets
        return [int(w) for w in self.decode_buckets.split(",")]


class SettingError(UserError):
    """A ``ServeConfig`` value out of its range; ``name``: the setting."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name} {message}")
        self.name = name


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServeConfig`` field, grouped, with its help and default."""
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    for f in dataclasses.fields(ServeConfig):
        meta = f.metadata
        extra = dict(meta["flag"])
        aliases = extra.pop("aliases", ())
        kw: dict[str, Any] = {"default": extra.pop("shown", f.default), "help": meta["help"], **extra}
        if f.type in ("bool", bool):
            kw["action"] = "store_true"
        elif "type" not in kw:
            kw["type"] = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        groups[meta["group"]].add_argument(flag(f.name), *aliases, dest=f.name, **kw)


def from_flags(ns: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` of parsed flags (``api_key`` falls back to $LAPLACE_API_KEY); raises
    ``SettingError``."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServeConfig)}
    values["api_key"] = values["api_key"] or os.environ.get("LAPLACE_API_KEY") or None
    return ServeConfig(**values)
