"""The training input pipeline on grain.

documents (each followed by EOS, concatenated) -> windows of seq_len + 1 tokens (stride seq_len)
-> shuffled with a seed (reshuffled every epoch; a ``Mixture`` shuffles each source and draws from
them by weight with grain's ``mix``) -> global batches of ``global_batch`` windows
-> each process reads only its rows [p * B/P, (p + 1) * B/P) of every global batch.

The global batch at step t depends only on (data, seed, seq_len, global_batch), not on the
process or device layout, and the iterator state is a small dict checkpointed with the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import grain
import numpy as np

from laplace_jax.data.store import SplitTokens
from laplace_jax.errors import DataError


class WindowSource(Protocol):
    """What the pipeline reads: ``len`` windows, each [seq_len + 1] int32 (``Windows``, ``MQARWindows``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class Windows:
    """Random-access windows [seq_len + 1] (int32) over a flat token array read by ``read(lo, hi)``."""

    def __init__(self, read: Callable[[int, int], np.ndarray], n_tokens: int, seq_len: int):
        self._read, self.seq_len = read, seq_len
        self._len = (n_tokens - 1) // seq_len
        if self._len < 1:
            raise DataError(f"only {n_tokens} tokens: not enough for one window of {seq_len + 1}; use more data")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        lo = int(i) * self.seq_len
        return self._read(lo, lo + self.seq_len + 1).astype(np.int32)


def array_windows(tokens: np.ndarray, seq_len: int) -> Windows:
    return Windows(lambda lo, hi: tokens[lo:hi], len(tokens), seq_len)


def store_windows(path: str, split: str, seq_len: int) -> Windows:
    """Windows over one split of a prepared dataset (its shards read as one sequence)."""
    tokens = SplitTokens(path, split)
    return Windows(tokens.read, len(tokens), seq_len)


class Mixture:
    """Weighted window sources: each shuffled with its own seed and repeated, then interleaved by
    grain's ``MapDataset.mix`` (a fixed pattern of the weights), so window k of the stream is a pure
    function of (sources, weights, seed, k): deterministic and resumable like one source."""

    def __init__(self, parts: list[tuple[WindowSource, float]]):
        self.parts = parts

    def stream(self, seed: int) -> grain.MapDataset:
        shuffled = [grain.MapDataset.source(w).shuffle(seed=seed + i).repeat() for i, (w, _) in enumerate(self.parts)]
        return grain.MapDataset.mix(shuffled, [weight for _, weight in self.parts])


class Interleaved:
    """Window i of source i % n, in turn: the held-out windows of a mixture, every source in each batch."""

    def __init__(self, sources: list[WindowSource]):
        self.sources = sources

    def __len__(self) -> int:
        return len(self.sources) * min(map(len, self.sources))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sources[i % len(self.sources)][i // len(self.sources)]


def train_batches(
    windows: WindowSource | Mixture,
    *,
    global_batch: int,
    seed: int,
    num_steps: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """This process's [global_batch / process_count, seq_len + 1] int32 batches for ``num_steps`` steps."""
    if global_batch % process_count:
        raise DataError(f"global batch {global_batch} is not divisible by {process_count} processes")
    local = global_batch // process_count
    if isinstance(windows, Mixture):
        shuffled = windows.stream(seed)
    else:
        shuffled = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()

    def pick(k: int) -> np.ndarray:
        step, row = divmod(int(k), local)
        return shuffled[step * global_batch + process_index * local + row]

    return grain.MapDataset.range(0, num_steps * local).map(pick).batch(local).to_iter_dataset()


def eval_batches(windows: WindowSource, batch: int, num_batches: int) -> list[np.ndarray]:
    """The first ``num_batches`` full batches of held-out windows, in order (a fixed eval set)."""
    n = min(num_batches, len(windows) // batch)
    if n < 1:
        raise DataError(f"validation split has {len(windows)} windows, fewer than one batch of {batch}")
    return [np.stack([windows[i * batch + j] for j in range(batch)]) for i in range(n)]
