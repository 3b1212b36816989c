"""Synthetic training windows generated on the fly: the MQAR recall mixture.

Window i is a pure function of (seed, i): N pairs (uniform in [min_pairs, max_pairs]) scattered
through filler, then queries; tokens that are not answers carry ``NO_LOSS`` so that only the
answers are trained. Random access, so grain shuffles, batches and checkpoints it like a corpus.
"""

from __future__ import annotations

import numpy as np

from laplace_jax.errors import DataError
from laplace_jax.tasks.recall import mqar_training_segments

NO_LOSS = 1 << 30  # ORed into a token id: the model sees the plain id, the loss skips it as a target


class MQARWindows:
    """[seq_len + 1] int32 windows of the MQAR mixture for ``tokenizer``; ``size`` of them per split."""

    def __init__(
        self,
        tokenizer,
        seq_len: int,
        seed: int,
        min_pairs: int,
        max_pairs: int,
        split: str = "train",
        size: int = 1 << 24,
    ) -> None:
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.min_pairs, self.max_pairs, self._size = min_pairs, max_pairs, size
        self._stream = {"train": 0, "val": 1}[split]  # disjoint random streams per split
        try:  # the most pairs is the tightest fit
            mqar_training_segments(np.random.default_rng(0), seq_len + 1, max_pairs, self._measure)
        except ValueError as e:
            raise DataError(f"data.mqar.max_pairs={max_pairs} does not fit data.seq_len={seq_len}: {e}") from e

    def _measure(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self._stream, int(i)])
        n = int(rng.integers(self.min_pairs, self.max_pairs + 1))
        ids: list[int] = []
        for text, is_answer in mqar_training_segments(rng, self.seq_len + 1, n, self._measure):
            flag = 0 if is_answer else NO_LOSS
            ids += [t | flag for t in self.tokenizer.encode(text)]
        return np.asarray(ids[: self.seq_len + 1], np.int32)
