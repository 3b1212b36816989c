"""Speculative decoding without a draft model, on one device: n-gram prompt lookup proposes up to
K tokens, one verify call scores them all, ``sampling.speculative_accept`` keeps a prefix.

out, stats = speculative_sample(cfg, params, prompt_ids, 200, num_speculative_tokens=4, temperature=0)

The whole loop is one compiled ``lax.while_loop`` (no host round trip per token): each iteration
looks the last n-gram up in the sequence so far (``ngram_proposal``, on device), feeds [last
token, draft] (K + 1 tokens) through the model from the state before them (``gla_lm.verify``),
accepts a prefix, and commits the state over the kept tokens from the verify's trace (each GLA
layer's k, v and gates replayed; ``gla_lm.commit``: no second read of the weights). An iteration
with no proposal takes one plain decode step instead, and after a draft is rejected outright the
lookup pauses (1, 2, 4 .. 64 tokens; after a look-up that found nothing, up to 8), so failed
speculation costs little. The serving engine runs
the same proposals, acceptance and commit for every slot inside its multi-step decode call
(``serve/slot_programs.py``), configured by ``NgramSpec`` (``serve.py --speculative-config``).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

from laplace_jax.config import ModelConfig
from laplace_jax.models.gla_lm import commit, decode_step, init_state, prefill, verify
from laplace_jax.sampling import sample_rows, speculative_accept

Array = jax.Array
MAX_PAUSE = 64  # steps without look-ups after repeated outright rejections
MAX_MISS_PAUSE = 8  # ... after repeated look-ups that found no n-gram
MAX_SPECULATIVE_TOKENS = 7  # K + 1 <= 8 tokens per verify call
DEFAULT_LOOKUP = 5  # vLLM's n-gram bounds when neither is given


@dataclasses.dataclass(frozen=True)
class NgramSpec:
    """Speculative decoding by n-gram prompt lookup, in vLLM's ``--speculative-config`` spelling:
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``.
    ``num_speculative_tokens`` (K) draft tokens are verified per step; the longest n-gram of the
    sequence's end, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, is looked up. As
    vLLM: either bound alone sets both, and neither means 5 and 5."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP

    @classmethod
    def parse(cls, text: str) -> NgramSpec:
        """The spec of a JSON object; raises ``ValueError`` saying which field is wrong and why."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg}): expected like {SPEC_EXAMPLE}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object like {SPEC_EXAMPLE}; got {text!r}")
        known = {"method", *(f.name for f in dataclasses.fields(cls))}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if raw.get("method", "ngram") != "ngram":
            raise ValueError(f"method {raw['method']!r} is not served: only 'ngram' (prompt lookup, no draft model)")
        if "num_speculative_tokens" not in raw:
            raise ValueError(f"num_speculative_tokens is required, e.g. {SPEC_EXAMPLE}")
        values = {k: v for k, v in raw.items() if k != "method"}
        for k, v in values.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{k} must be an integer; got {v!r}")
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")  # vLLM's defaults
        values["prompt_lookup_min"] = lo if lo is not None else hi if hi is not None else DEFAULT_LOOKUP
        values["prompt_lookup_max"] = hi if hi is not None else values["prompt_lookup_min"]
        spec = cls(**values)
        if not 1 <= spec.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}; got {spec.num_speculative_tokens}"
            )
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                f"{spec.prompt_lookup_min}, {spec.prompt_lookup_max}"
            )
        return spec

    @staticmethod
    def describe(spec: NgramSpec | None) -> str:
        """What the serve banner says of speculation."""
        if spec is None:
            return "speculative decoding: off"
        return f"speculative decoding: ngram, {spec.num_speculative_tokens} draft tokens per verify"


SPEC_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def ngram_proposal(tokens_L: Array, length: Array, k: int, n_min: int = 1, n_max: int = 4) -> Array:
    """Prompt lookup (vLLM's ``ngram`` method) over ``tokens[:length]``: for n from ``n_max`` down to
    ``n_min``, the last n tokens are searched for earlier in the sequence; at the latest earlier
    occurrence, the ``k`` tokens that followed it are the proposal, the stretch between it and the
    suffix repeated where fewer than k follow (a loop of period d proposes k tokens, not d).
    Returns [k] ids, all -1 where no n-gram recurs."""
    L = tokens_L.shape[0]
    idx = jnp.arange(L)
    padded = jnp.concatenate([tokens_L, jnp.full((n_max,), -1, tokens_L.dtype)])  # room for the shifted views
    best = jnp.full((k,), -1, tokens_L.dtype)
    found = jnp.zeros((), bool)
    for n in range(n_max, n_min - 1, -1):  # longest first: a shorter n-gram only where no longer one recurs
        suffix = jax.lax.dynamic_slice(padded, (jnp.maximum(length - n, 0),), (n,))
        match = idx < length - n  # an occurrence that starts before the suffix does
        for j in range(n):
            match &= padded[j : j + L] == suffix[j]
        start = jnp.max(jnp.where(match, idx, -1)) + n
        period = jnp.maximum(length - start, 1)  # from the occurrence to the suffix: repeated
        after = padded[jnp.maximum(start, 0) + jnp.arange(k) % period]
        hit = match.any() & ~found
        best, found = jnp.where(hit, after, best), found | hit
    return best


def backoff(skip: Array, pause: Array, looked: Array, proposed: Array, accepted: Array) -> tuple[Array, Array]:
    """Speculation that fails turns itself off: after a look-up (``looked``) that found nothing,
    or a draft rejected outright, the next ``pause`` look-ups are skipped and the pause doubles, up
    to ``MAX_MISS_PAUSE`` after a miss (text that starts repeating is found again within a few
    tokens) and ``MAX_PAUSE`` after a rejection; an accepted token resets it to 1. Any shapes (one
    sequence or a row per slot). Returns (skip, pause)."""
    failed = looked & (accepted == 0)
    cap = jnp.where(proposed, MAX_PAUSE, MAX_MISS_PAUSE)
    skip = jnp.where(failed, pause, jnp.maximum(skip - 1, 0))
    pause = jnp.where(failed, jnp.minimum(2 * pause, cap), jnp.where(accepted > 0, 1, pause))
    return skip, pause


@dataclasses.dataclass
class SpeculationStats:
    """What a ``speculative_sample`` call did: verify calls, plain decode steps, draft tokens
    proposed and accepted."""

    verify_calls: int
    plain_steps: int
    proposed: int
    accepted: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@functools.partial(jax.jit, static_argnums=(0, 1, 6, 7, 8, 9))
def _generate(
    cfg: ModelConfig, verify_cfg: ModelConfig, params, state, tokens_L, length, n_new: int, K: int, n_min: int,
    n_max: int, key, limits,
):  # fmt: skip
    """The speculative loop: (tokens_L with ``n_new`` tokens written after ``length``, counters);
    the K + 1 tokens of a verify call run through ``verify_cfg``'s GLA kernel."""
    end = length + n_new

    def check(c, last, draft):
        fed = jnp.concatenate([last[None], jnp.maximum(draft, 0)])[None]
        logits, trace = verify(verify_cfg, params, fed, c["state"], jnp.ones((1,), bool))
        toks, n = speculative_accept(logits, draft[None], *limits, c["key"][None])
        keep = jnp.minimum(n[0] + 1, end - c["length"])
        return toks[0], keep, n[0], commit(verify_cfg, c["state"], trace, keep[None])

    def plain(c, last, _):
        logits, state = decode_step(cfg, params, last[None], c["state"])
        tok = sample_rows(logits, *limits, c["key"][None])
        return jnp.zeros((K + 1,), jnp.int32).at[0].set(tok[0]), jnp.int32(1), jnp.int32(0), state

    def body(c):
        c["key"], sub = jax.random.split(c["key"])
        room = jnp.minimum(K, end - c["length"] - 1)
        draft = ngram_proposal(c["tokens"], c["length"], K, n_min, n_max)
        draft = jnp.where((jnp.arange(K) < room) & (c["skip"] == 0), draft, -1)
        proposed = jnp.sum(draft >= 0)
        last = c["tokens"][c["length"] - 1]
        toks, keep, n, c["state"] = jax.lax.cond(proposed > 0, check, plain, dict(c, key=sub), last, draft)
        c["tokens"] = jax.lax.dynamic_update_slice(c["tokens"], toks, (c["length"],))
        c["length"] = c["length"] + keep
        looked = (c["skip"] == 0) & (room > 0)
        c["skip"], c["pause"] = backoff(c["skip"], c["pause"], looked, proposed > 0, n)
        counts = jnp.stack([proposed > 0, proposed == 0, proposed, n]).astype(jnp.int32)
        c["stats"] = c["stats"] + counts
        return c

    carry = dict(
        state=state, tokens=tokens_L, length=length, key=key, skip=jnp.int32(0), pause=jnp.int32(1),
        stats=jnp.zeros((4,), jnp.int32),
    )  # fmt: skip
    out = jax.lax.while_loop(lambda c: c["length"] < end, body, carry)
    return out["tokens"], out["stats"]


def speculative_sample(
    cfg: ModelConfig,
    params,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    num_speculative_tokens: int = 4,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 4,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    verify_impl: str = "recurrent",
) -> tuple[list[int], SpeculationStats]:
    """``max_new_tokens`` tokens after ``prompt_ids`` with n-gram speculation: greedy output equals
    plain greedy decoding's token for token, and sampled output has plain sampling's distribution
    (not its draws). ``verify_impl``: the GLA kernel of a verify call's K + 1 tokens (a
    ``model.attn_impl`` name; the token scan by default: on CPU it beat the chunk kernel, which
    pads K + 1 tokens to a whole chunk, in benchmarks/results/speculative_cpu.json)."""
    if not prompt_ids or max_new_tokens < 1:
        raise ValueError("need a prompt of at least one token and max_new_tokens >= 1")
    if num_speculative_tokens < 1 or not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError("need num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max")
    K, P = num_speculative_tokens, len(prompt_ids)
    state = init_state(cfg, 1)
    if P > 1:
        _, state = jax.jit(prefill, static_argnums=0)(cfg, params, jnp.asarray(prompt_ids[:-1], jnp.int32)[None], state)
    tokens = jnp.zeros((P + max_new_tokens + K + 1,), jnp.int32).at[:P].set(jnp.asarray(prompt_ids, jnp.int32))
    limits = (jnp.full((1,), temperature, jnp.float32), jnp.full((1,), top_k, jnp.int32), jnp.full((1,), top_p))
    args = (K, prompt_lookup_min, prompt_lookup_max, jax.random.key(seed), limits)
    verify_cfg = dataclasses.replace(cfg, attn_impl=verify_impl)
    tokens, stats = _generate(cfg, verify_cfg, params, state, tokens, jnp.int32(P), max_new_tokens, *args)
    return [int(t) for t in tokens[P : P + max_new_tokens]], SpeculationStats(*(int(x) for x in stats))
