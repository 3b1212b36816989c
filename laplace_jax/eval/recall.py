"""Recall evaluation: score a model's greedy answers on the suites of ``tasks.recall`` and plot
accuracy against context length and difficulty."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from laplace_jax.serve.request import SamplingParams
from laplace_jax.tasks.recall import Sample


def answer_token(text: str) -> str:
    """The first word of a generated answer: leading whitespace skipped, cut at the first character
    that is not a letter or digit ("4821." -> "4821", "48213" stays "48213")."""
    m = re.match(r"\s*([0-9A-Za-z]*)", text)
    return m.group(1) if m else ""


def score(samples: list[Sample], answer_fn: Callable[[list[Sample]], list[str]]) -> dict[str, dict[str, float]]:
    """Accuracy per (length, level): an answer is right when its first word (``answer_token``) is
    exactly the expected answer; extra digits make it wrong."""
    answers = answer_fn(samples)
    cells: dict[tuple[int, float], list[bool]] = {}
    for s, a in zip(samples, answers, strict=True):
        cells.setdefault((s.length, s.level), []).append(answer_token(a) == s.answer)
    return {
        f"{L}|{lv:g}": {"length": L, "level": lv, "accuracy": float(np.mean(v)), "n": len(v)}
        for (L, lv), v in sorted(cells.items())
    }


def model_answers(
    engine_factory: Callable[[], object], tokenizer, on_done: Callable[[], None] | None = None
) -> Callable[[list[Sample]], list[str]]:
    """Greedy answers from a model through the serving engine (fixed executables, any prompt length):
    exactly as many tokens as the expected answer has, since the training recipe never trains what
    follows an answer; ``score`` then requires them to be exactly the answer.
    ``on_done`` is called (from the engine loop) as each prompt finishes, e.g. to move a progress bar."""

    def answer(samples: list[Sample]) -> list[str]:
        prompts = [tokenizer.encode(s.prompt) for s in samples]
        # exactly the answer's tokens: nothing after it is scored
        sps = [SamplingParams(max_tokens=len(tokenizer.encode(s.answer)), temperature=0.0) for s in samples]
        done = None if on_done is None else (lambda _i: on_done())
        return [tokenizer.decode(c.tokens) for c in engine_factory().generate(prompts, sps, done)]

    return answer


def _grid(res: dict) -> tuple[list[int], list[float], np.ndarray]:
    lengths = sorted({r["length"] for r in res.values()})
    levels = sorted({r["level"] for r in res.values()})
    grid = np.full((len(levels), len(lengths)), np.nan)
    for r in res.values():
        grid[levels.index(r["level"]), lengths.index(r["length"])] = r["accuracy"]
    return lengths, levels, grid


def _level_name(suite: str) -> str:
    return "pairs (N)" if suite == "mqar" else "depth"


def heatmaps(results: dict[str, dict], path: str, suite: str) -> None:
    """One accuracy heat map per checkpoint, side by side: context length (x) against level (y)."""
    import matplotlib  # imported when plotting: slow to load, and the backend must be chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    lengths, levels, _ = _grid(next(iter(results.values())))
    fig, axes = plt.subplots(1, n, figsize=(n * (1.1 * len(lengths) + 2), 0.45 * len(levels) + 2.2), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        lengths, levels, grid = _grid(res)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(len(levels)), [f"{x:g}" for x in levels])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(_level_name(suite))
        ax.set_title(f"{name}: {suite} accuracy")
        for (y, x), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(x, y, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def curves(results: dict[str, dict], path: str, suite: str) -> None:
    """Accuracy against context length (one line per level) for each checkpoint, one panel each."""
    import matplotlib  # imported when plotting: slow to load, and the backend must be chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False, sharey=True)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        lengths, levels, grid = _grid(res)
        for lv, row in zip(levels, grid, strict=True):
            ok = ~np.isnan(row)
            ax.plot(np.asarray(lengths)[ok], row[ok], "o-", label=f"{lv:g}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(title=_level_name(suite), fontsize=7)
    axes[0][0].set_ylabel(f"{suite} accuracy")
    axes[0][0].set_ylim(-0.02, 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
