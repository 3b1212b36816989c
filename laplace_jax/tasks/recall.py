"""Recall tasks generated on the fly from a seed (no downloads), as text for any tokenizer.

MQAR: N key-value pairs ("QZX:482. ") spread through filler text, then a query "\nQZX:" whose
answer is the value. Passkey: filler with "The pass key is 48213." at a chosen depth, then "What
is the pass key? The pass key is " -> "48213". Keys are upper-case, values digits, filler
lower-case words without digits, so every answer occurs in its context exactly once.
``mqar_training_segments`` writes the same format as training text with several queries, the
answers marked for the loss. Below both data and eval: ``data.synthetic`` turns the training
segments into train.py windows, and ``eval.recall`` scores a model on the suites.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable

import numpy as np

from laplace_jax.errors import DoesNotFitError

FILLER = (
    "the grass is green and the sky is blue. ",
    "a river runs past the old mill and into the sea. ",
    "the morning was quiet and the streets were empty. ",
    "people walked slowly along the shore in the evening. ",
)
KEY_LEN, VALUE_LEN = 2, 3  # the MQAR format used by the suite and by recall training


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    length: int  # target context length (tokens)
    level: float  # N pairs (MQAR) or depth fraction (passkey)


def max_pairs(key_len: int = KEY_LEN) -> int:
    """How many distinct keys of ``key_len`` upper-case letters exist."""
    return len(string.ascii_uppercase) ** key_len


def _pairs(rng: np.random.Generator, n: int, key_len: int, value_len: int) -> list[tuple[str, str]]:
    if n > max_pairs(key_len):
        raise ValueError(
            f"{n} pairs need {n} distinct keys but {key_len}-letter keys allow only {max_pairs(key_len)}; "
            "ask for fewer pairs"
        )
    letters = np.array(list(string.ascii_uppercase))
    codes = rng.choice(max_pairs(key_len), n, replace=False)
    keys = ["".join(letters[(c // 26 ** np.arange(key_len)) % 26]) for c in codes]
    lo = 10 ** (value_len - 1)
    return [(k, str(int(v))) for k, v in zip(keys, rng.integers(lo, 10 * lo, n), strict=True)]


def _fill(rng: np.random.Generator, measure: Callable[[str], int], budget: int) -> list[str]:
    """Filler sentences totalling at most ``budget`` tokens (within one sentence of it)."""
    out: list[str] = []
    while True:
        s = FILLER[int(rng.integers(len(FILLER)))]
        budget -= measure(s)
        if budget < 0:
            return out
        out.append(s)


def _scatter(rng: np.random.Generator, items: list[str], filler: list[str]) -> list[str]:
    """``items`` in order, each inserted at a random gap of ``filler``."""
    slots = sorted(rng.integers(0, len(filler) + 1, len(items)).tolist())
    parts, j = [], 0
    for i, f in enumerate([*filler, None]):
        while j < len(items) and slots[j] == i:
            parts.append(items[j])
            j += 1
        if f is not None:
            parts.append(f)
    return parts


def mqar(
    seed: int,
    length: int,
    n_pairs: int,
    measure: Callable[[str], int] = len,
    key_len: int = KEY_LEN,
    value_len: int = VALUE_LEN,
) -> Sample:
    """One MQAR sample of about ``length`` tokens with ``n_pairs`` pairs; queries one random key."""
    rng = np.random.default_rng([seed, length, n_pairs])
    pairs = _pairs(rng, n_pairs, key_len, value_len)
    items = [f"{k}:{v}. " for k, v in pairs]
    need = sum(measure(x) for x in items) + measure("\n" + "K" * key_len + ":") + value_len + 1  # answer, stop
    if need > length:
        raise DoesNotFitError(f"{n_pairs} pairs need about {need} tokens, more than the context length {length}")
    parts = _scatter(rng, items, _fill(rng, measure, length - need))
    key, value = pairs[int(rng.integers(n_pairs))]
    return Sample("".join(parts) + f"\n{key}:", value, length, n_pairs)


def mqar_training_segments(
    rng: np.random.Generator,
    length: int,
    n_pairs: int,
    measure: Callable[[str], int] = len,
    key_len: int = KEY_LEN,
    value_len: int = VALUE_LEN,
) -> list[tuple[str, bool]]:
    """(text, is_answer) segments of at least ``length`` tokens: the pairs scattered through a
    random amount of filler (none up to all the room left after ``min(n_pairs, 4)`` queries, as
    sparse as the suite's contexts get), then queries "\nKEY:" + answer until the length is
    reached (every key once in random order, then again). Only the answers are for the loss."""
    pairs = _pairs(rng, n_pairs, key_len, value_len)
    items = [f"{k}:{v}. " for k, v in pairs]
    used = sum(measure(x) for x in items)
    query = measure("\n" + "K" * key_len + ":") + value_len
    if used + query > length:
        raise ValueError(f"{n_pairs} pairs and one query need {used + query} tokens, more than {length}")
    budget = max(0, length - used - min(n_pairs, 4) * query)
    parts = _scatter(rng, items, _fill(rng, measure, int(rng.integers(0, budget + 1))))
    out = [("".join(parts), False)]
    used = sum(measure(p) for p in parts)
    while used < length:
        for j in rng.permutation(n_pairs):
            k, v = pairs[int(j)]
            out += [(f"\n{k}:", False), (v, True)]
            used += query
            if used >= length:
                break
    return out


def passkey(seed: int, length: int, depth: float, measure: Callable[[str], int] = len) -> Sample:
    """Filler of about ``length`` tokens with the pass key at fractional ``depth``; asked for at the end."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1]; got {depth}")
    rng = np.random.default_rng([seed, length, int(depth * 1000)])
    key = f"{int(rng.integers(10000, 100000))}"
    fact = f"The pass key is {key}. "
    question = "\nWhat is the pass key? The pass key is "
    room = length - measure(fact) - measure(question) - measure(key) - 1
    if room < 0:
        raise DoesNotFitError(f"a passkey prompt needs at least {length - room} tokens; got length {length}")
    filler = _fill(rng, measure, room)
    at = round(depth * len(filler))
    return Sample("".join(filler[:at]) + fact + "".join(filler[at:]) + question, key, length, depth)


def suite(
    kind: str, seed: int, lengths: list[int], levels: list[float], samples: int, measure: Callable[[str], int] = len
) -> list[Sample]:
    """All samples of a grid (lengths x levels x samples), skipping cells that do not fit their length."""
    if kind not in ("mqar", "passkey"):
        raise ValueError(f"suite must be 'mqar' or 'passkey'; got {kind!r}")
    out = []
    for L in lengths:
        for lv in levels:
            for s in range(samples):
                try:
                    if kind == "mqar":
                        out.append(mqar(seed + s, L, int(lv), measure))
                    else:
                        out.append(passkey(seed + s, L, float(lv), measure))
                except DoesNotFitError:
                    continue
    return out
