"""Where a training run's tokens come from: the config's data source as train windows, eval
batches and the tokenizer's facts. ``text``: a prepared dataset (``data.path``, a directory or a
tensorstore URL) or the embedded corpus; ``mqar``: the synthetic recall mixture; ``data.sources``:
a weighted mixture of prepared datasets and ``mqar`` (``"PATH=WEIGHT"`` entries)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from laplace_jax.config import DataConfig, ModelConfig, parse_sources
from laplace_jax.data.corpus import embedded_documents
from laplace_jax.data.pipeline import Interleaved, Mixture, WindowSource, array_windows, eval_batches, store_windows
from laplace_jax.data.store import read_manifest
from laplace_jax.data.synthetic import MQARWindows
from laplace_jax.data.tokenizer import load_tokenizer
from laplace_jax.errors import DataError, UserError

MQAR = "mqar"  # the data.sources entry of the synthetic recall mixture


def tokenizer_spec(data: Mapping[str, Any]) -> str:
    """The tokenizer a ``data`` block trains with (prepared data records its own)."""
    paths = [w for w, _ in parse_sources(tuple(data.get("sources") or ()))] or [data.get("path") or ""]
    for where in paths:
        if where and where != MQAR:
            return read_manifest(where)["tokenizer"]
    return data.get("tokenizer", "byte")


class TrainingData:
    """``train`` windows (one source or a ``Mixture``), ``val`` eval batches and the tokenizer's
    facts (``tokenizer`` spec, ``vocab_size``, ``eos_id``) for a ``data`` block; checked against the
    model's vocabulary."""

    def __init__(self, data: DataConfig, model_cfg: ModelConfig):
        try:
            self._load(data)
        except FileNotFoundError as e:
            raise DataError(f"{e}; check data.path (a directory written by laplace_jax.data.prepare)") from e
        if self.vocab_size > model_cfg.vocab_size:
            raise UserError(
                f"the data's tokenizer has {self.vocab_size} ids but model.vocab_size is {model_cfg.vocab_size}; "
                f"set --config.model.vocab_size={self.vocab_size} (or larger) or use matching data"
            )

    def _load(self, d: DataConfig) -> None:
        self.train: WindowSource | Mixture
        if d.sources:
            parts = [(self._source(d, where), w) for where, w in parse_sources(d.sources)]
            self.train = Mixture([(train, w) for (train, _), w in parts])
            val: WindowSource = Interleaved([v for (_, v), _ in parts])
        else:
            self.train, val = self._source(d, MQAR if d.source == "mqar" else d.path)
        self.val = eval_batches(val, min(d.global_batch, 8), d.eval_batches)

    def _source(self, d: DataConfig, where: str) -> tuple[WindowSource, WindowSource]:
        """(train, val) windows of one source; its tokenizer must agree with the sources before it."""
        if where == MQAR:
            tok = load_tokenizer(d.tokenizer)
            facts = (tok.spec, tok.vocab_size, tok.eos_id)
            args = (tok, d.seq_len, d.seed, d.mqar.min_pairs, d.mqar.max_pairs)
            windows = MQARWindows(*args), MQARWindows(*args, split="val")
        elif where:
            meta = read_manifest(where)
            facts = (meta["tokenizer"], meta["vocab_size"], meta["eos_id"])
            windows = store_windows(where, "train", d.seq_len), store_windows(where, "val", d.seq_len)
        else:
            tok = load_tokenizer(d.tokenizer)
            facts = (tok.spec, tok.vocab_size, tok.eos_id)
            tokens = embedded_tokens(tok.spec, d.embedded_max_chars)
            cut = int(len(tokens) * 0.98)
            windows = array_windows(tokens[:cut], d.seq_len), array_windows(tokens[cut:], d.seq_len)
        if hasattr(self, "tokenizer") and facts != (self.tokenizer, self.vocab_size, self.eos_id):
            raise DataError(
                f"data.sources: {where or 'the embedded corpus'} uses tokenizer {facts[0]} (vocab {facts[1]}, "
                f"EOS {facts[2]}), the sources before it {self.tokenizer} (vocab {self.vocab_size}, EOS "
                f"{self.eos_id}); a mixture needs one tokenizer (prepare every source with it; mqar uses "
                "data.tokenizer)"
            )
        self.tokenizer, self.vocab_size, self.eos_id = facts
        return windows


@functools.lru_cache(maxsize=4)
def embedded_tokens(spec: str, max_chars: int) -> np.ndarray:
    """The embedded corpus as one flat token array (documents joined by EOS), cached per process."""
    tok = load_tokenizer(spec)
    parts = []
    for doc in embedded_documents(max_chars):
        parts += [np.asarray(tok.encode(doc), np.uint32), np.asarray([tok.eos_id], np.uint32)]
    return np.concatenate(parts)
