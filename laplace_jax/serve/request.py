"""What a client asks the engine for: sampling parameters (range-checked in one place) and the
request object the engine fills in from its thread.

A request is one sequence. ``n`` / ``best_of`` fan-out submits a group of requests that share
a prompt: the engine prefills it once and copies the state into each member's slot.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from laplace_jax.errors import InvalidParamError
from laplace_jax.platform import key_words
from laplace_jax.sampling import CANDIDATES, TOP_LOGPROBS

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MAX_STOP_IDS = 16  # EOS + up to 15 stop_token_ids per request
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # |bias| per token (OpenAI's range); any number of tokens

if TYPE_CHECKING:  # a type only: the automaton is compiled by the server, outside this module
    from laplace_jax.serve.structured import HostGrammar, TokenAutomaton

# (logprob of the token, the top ids, their logprobs): one entry per scored token
TokenLogprob = tuple[float, list[int], list[float]]


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding controls (vLLM's semantics).

    Penalties act on the model's logits before temperature, top-k, top-p and min-p:
    ``repetition_penalty`` divides positive (multiplies negative) logits of every token seen in
    the prompt or the output; ``frequency_penalty`` subtracts penalty x count and
    ``presence_penalty`` subtracts penalty once, for tokens of the output; ``logit_bias`` adds.
    ``min_tokens``: stop tokens are masked until that many tokens exist. ``logprobs``: the
    sampled token's logprob and the ``logprobs`` most likely tokens' (0..20), from the model's
    own distribution (log-softmax of the raw logits); ``prompt_logprobs`` the same for the
    prompt's tokens. ``max_tokens`` 0 scores the prompt only (needs ``prompt_logprobs``).
    ``return_tokens_as_token_ids``: logprobs name each token "token_id:<id>" instead of its text
    (so a client can rebuild the exact ids, e.g. for a chat's next turn). ``automaton``: the
    output is masked to it on device (structured outputs; EOS only where it accepts).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    # structured outputs: the output follows it (``serve/structured.py``; a host grammar's masks per token)
    automaton: TokenAutomaton | HostGrammar | None = None

    def check(self, vocab_size: int) -> None:
        """Raise ``InvalidParamError`` for any field outside its documented range."""
        if self.automaton is not None and self.automaton.table.shape[1] != vocab_size:
            raise InvalidParamError("structured_outputs", "the automaton was compiled for another vocabulary")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InvalidParamError(
                "max_tokens", f"max_tokens must be >= 1 (0 only to score the prompt); got {self.max_tokens}"
            )
        _in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParamError("top_p", f"top_p must lie in (0, 1]; got {self.top_p}")
        top_k_max = min(vocab_size, CANDIDATES)
        if not 0 <= self.top_k <= top_k_max:
            raise InvalidParamError("top_k", f"top_k must lie in [0, {top_k_max}] (0 = off); got {self.top_k}")
        _in("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidParamError("seed", f"seed must lie in [0, 2^63 - 1]; got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_IDS - 1:
            raise InvalidParamError("stop_token_ids", f"at most {MAX_STOP_IDS - 1} stop_token_ids")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidParamError("stop_token_ids", f"stop_token_ids must lie in [0, {vocab_size})")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParamError("min_tokens", f"min_tokens must lie in [0, max_tokens]; got {self.min_tokens}")
        _in("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _in("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidParamError(
                "repetition_penalty",
                f"repetition_penalty must lie in (0, {MAX_REPETITION_PENALTY}] (1 = off); "
                f"got {self.repetition_penalty}",
            )
        for t, b in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                raise InvalidParamError("logit_bias", f"logit_bias token ids must lie in [0, {vocab_size}); got {t}")
            _in("logit_bias", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= TOP_LOGPROBS:
                raise InvalidParamError(name, f"{name} must lie in [0, {TOP_LOGPROBS}]; got {k}")


def _in(name: str, value: float, lo: float, hi: float) -> None:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InvalidParamError(name, f"{name} must lie in [{lo:g}, {hi:g}]; got {value}")


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
    "error" (then ``error`` says why). With ``sampling.logprobs`` set, ``logprobs`` gets one
    ``TokenLogprob`` per emitted token before ``emit`` is called; with ``sampling.prompt_logprobs``,
    ``prompt_logprobs`` holds None (the first token) then one per prompt token before the first emit.
    ``cumulative_logprob`` sums the logprobs of every generated token when ``sampling.logprobs``
    or ``rank`` is set (``best_of`` ranks by it).
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
    sampled: list[int] = dataclasses.field(default_factory=list)  # every sampled id, stop ids included
    error: str | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0
    rank: bool = False  # keep ``cumulative_logprob`` even without ``sampling.logprobs`` (best_of)

    @property
    def wants_logprobs(self) -> bool:
        return self.rank or self.sampling.logprobs is not None

    def send(self, tokens: list[int], reason: str | None) -> None:
        """``emit`` that cannot hurt the engine: a failing callback cancels this request only."""
        try:
            self.emit(tokens, reason)
        except Exception:
            self.cancelled = True

    def fail(self, message: str) -> None:
        self.error = message
        self.send([], "error")


@dataclasses.dataclass
class Completion:
    """One finished sequence of ``Engine.generate``."""

    tokens: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    cumulative_logprob: float


def check_prompt(prompt_ids: list[int], sps: tuple[SamplingParams, ...], vocab_size: int, max_model_len: int) -> None:
    """Raise ``InvalidParamError`` if a request (or a group sharing ``prompt_ids``, one
    ``SamplingParams`` per member) cannot be served as given. The prompt is checked once."""
    for sp in sps:
        sp.check(vocab_size)
    n = len(prompt_ids)
    if n == 0:
        raise InvalidParamError("prompt", "the prompt is empty")
    try:
        ids = np.asarray(prompt_ids, np.int64)
    except OverflowError:
        ids = np.asarray([-1])
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InvalidParamError("prompt", f"prompt token ids must lie in [0, {vocab_size})")
    if n >= max_model_len:
        raise InvalidParamError(
            "prompt", f"the prompt has {n} tokens; max_model_len {max_model_len} leaves no room to generate"
        )
    longest = max(sp.max_tokens for sp in sps)
    if n + longest > max_model_len:
        raise InvalidParamError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({longest}) exceeds max_model_len {max_model_len}; "
            f"ask for at most {max_model_len - n} tokens",
        )


def stop_ids(sp: SamplingParams, eos_id: int) -> list[int]:
    """The token ids that end a request (the same list the device checks)."""
    return ([] if sp.ignore_eos else [eos_id]) + list(sp.stop_token_ids)


def row_params(
    req: Request, vocab_size: int, eos_id: int, seed: int, impl: str, generated: int = 0
) -> dict[str, np.ndarray]:
    """The device's per-slot sampling inputs for ``req`` (its key from ``seed`` for PRNG ``impl``):
    scalars, and [vocab_size] bias, seen-token and stop masks. ``generated``: tokens the request
    has already been given (jump-forward), which count toward ``max_tokens`` and ``min_tokens``."""
    sp, V = req.sampling, vocab_size
    bias = np.zeros((V,), np.float32)
    if sp.logit_bias:
        bias[list(sp.logit_bias)] = list(sp.logit_bias.values())
    seen = np.zeros((V,), bool)
    if sp.repetition_penalty != 1.0:
        seen[req.prompt_ids] = True
    stop_mask = np.zeros((V,), bool)
    stop_mask[stop_ids(sp, eos_id)] = True
    return {
        "temperature": np.float32(sp.temperature),
        "top_k": np.int32(sp.top_k),
        "top_p": np.float32(sp.top_p),
        "min_p": np.float32(sp.min_p),
        "key": prng_key_data(seed, impl),
        "remaining": np.int32(sp.max_tokens - 1 - generated),
        "min_tokens": np.int32(max(sp.min_tokens - generated, 0)),
        "presence": np.float32(sp.presence_penalty),
        "frequency": np.float32(sp.frequency_penalty),
        "repetition": np.float32(sp.repetition_penalty),
        "bias": bias,
        "biased": np.bool_(np.any(bias != 0)),
        "seen": seen,
        "stop_mask": stop_mask,
        "gstate": np.int32(-1),  # the scheduler sets the automaton's first table row
        "logprobs": np.bool_(req.wants_logprobs),
    }
