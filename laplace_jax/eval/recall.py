"""Recall suites generated on the fly from a seed (no downloads), as text for any tokenizer.

MQAR: N key-value pairs ("QZXK:4821") spread through filler text, then a query "\\nQZXK:" whose
answer is the value. Passkey: filler with "The pass key is 48213." at a chosen depth, then "What
is the pass key? The pass key is " -> "48213". Keys are upper-case, values digits, filler
lower-case words without digits, so every answer occurs in its context exactly once.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable

import numpy as np

FILLER = (
    "the grass is green and the sky is blue. ",
    "a river runs past the old mill and into the sea. ",
    "the morning was quiet and the streets were empty. ",
    "people walked slowly along the shore in the evening. ",
)


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str
    length: int  # target context length (tokens)
    level: float  # N pairs (MQAR) or depth fraction (passkey)


def _fill(rng: np.random.Generator, measure: Callable[[str], int], budget: int) -> list[str]:
    out: list[str] = []
    while budget > 0:
        s = FILLER[int(rng.integers(len(FILLER)))]
        out.append(s)
        budget -= measure(s)
    return out


def mqar(seed: int, length: int, n_pairs: int, measure: Callable[[str], int] = len) -> Sample:
    """One MQAR sample of about ``length`` tokens with ``n_pairs`` pairs; queries one random key."""
    rng = np.random.default_rng([seed, length, n_pairs])
    keys: set[str] = set()
    while len(keys) < n_pairs:
        keys.add("".join(rng.choice(list(string.ascii_uppercase), 4)))
    pairs = [(k, f"{int(rng.integers(1000, 10000))}") for k in sorted(keys)]
    rng.shuffle(pairs)
    items = [f"{k}:{v}. " for k, v in pairs]
    need = sum(measure(x) for x in items) + measure("\nABCD:") + 4
    if need > length:
        raise ValueError(f"{n_pairs} pairs need about {need} tokens, more than the context length {length}")
    filler = _fill(rng, measure, length - need)
    slots = sorted(rng.integers(0, len(filler) + 1, len(items)).tolist())
    parts, j = [], 0
    for i, f in enumerate([*filler, None]):
        while j < len(items) and slots[j] == i:
            parts.append(items[j])
            j += 1
        if f is not None:
            parts.append(f)
    key, value = pairs[int(rng.integers(n_pairs))]
    return Sample("".join(parts) + f"\n{key}:", value, length, n_pairs)


def passkey(seed: int, length: int, depth: float, measure: Callable[[str], int] = len) -> Sample:
    """Filler of about ``length`` tokens with the pass key at fractional ``depth``; asked for at the end."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1]; got {depth}")
    rng = np.random.default_rng([seed, length, int(depth * 1000)])
    key = f"{int(rng.integers(10000, 100000))}"
    fact = f"The pass key is {key}. "
    question = "\nWhat is the pass key? The pass key is "
    filler = _fill(rng, measure, length - measure(fact) - measure(question))
    at = round(depth * len(filler))
    return Sample("".join(filler[:at]) + fact + "".join(filler[at:]) + question, key, length, depth)


def suite(
    kind: str, seed: int, lengths: list[int], levels: list[float], samples: int, measure: Callable[[str], int] = len
) -> list[Sample]:
    """All samples of a grid (lengths x levels x samples); MQAR skips cells whose pairs do not fit."""
    out = []
    for L in lengths:
        for lv in levels:
            for s in range(samples):
                if kind == "mqar":
                    try:
                        out.append(mqar(seed + s, L, int(lv), measure))
                    except ValueError:
                        continue
                elif kind == "passkey":
                    out.append(passkey(seed + s, L, float(lv), measure))
                else:
                    raise ValueError(f"suite must be 'mqar' or 'passkey'; got {kind!r}")
    return out


def score(samples: list[Sample], answer_fn: Callable[[list[Sample]], list[str]]) -> dict[str, dict[str, float]]:
    """Accuracy per (length, level): an answer is right when its text starts with the expected answer."""
    answers = answer_fn(samples)
    cells: dict[tuple[int, float], list[bool]] = {}
    for s, a in zip(samples, answers, strict=True):
        cells.setdefault((s.length, s.level), []).append(a.strip().startswith(s.answer))
    return {
        f"{L}|{lv:g}": {"length": L, "level": lv, "accuracy": float(np.mean(v)), "n": len(v)}
        for (L, lv), v in sorted(cells.items())
    }


def model_answers(engine_factory: Callable[[], object], tokenizer) -> Callable[[list[Sample]], list[str]]:
    """Greedy answers from a model through the serving engine (fixed executables, any prompt length)."""
    from laplace_jax.serve.engine import Request, SamplingParams

    def answer(samples: list[Sample]) -> list[str]:
        engine = engine_factory()
        engine.warmup()
        outs: list[list[int]] = [[] for _ in samples]
        for i, s in enumerate(samples):
            n = len(tokenizer.encode(s.answer)) + 1

            def emit(toks, reason, i=i):
                outs[i].extend(toks)

            engine.submit(Request(tokenizer.encode(s.prompt), SamplingParams(max_tokens=n, temperature=0.0), emit))
        engine.run_until_idle()
        return [tokenizer.decode(o) for o in outs]

    return answer


def heatmap(results: dict, path: str, title: str) -> None:
    """Accuracy heat map: context length (x) against N pairs / depth (y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in results.values()})
    levels = sorted({r["level"] for r in results.values()})
    grid = np.full((len(levels), len(lengths)), np.nan)
    for r in results.values():
        grid[levels.index(r["level"]), lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.5 * len(levels) + 2))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(levels)), [f"{x:g}" for x in levels])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("pairs" if levels and levels[-1] > 1 else "depth")
    ax.set_title(title)
    for (y, x), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(x, y, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
