"""Where a training run's tokens come from: the config's data source as train windows, eval
batches and the tokenizer's facts (``text``: a prepared store or the embedded corpus; ``mqar``:
the synthetic recall mixture)."""

from __future__ import annotations

import functools

import numpy as np

from laplace_jax.config import DataConfig, ModelConfig
from laplace_jax.data.corpus import embedded_documents
from laplace_jax.data.pipeline import WindowSource, array_windows, eval_batches, store_windows
from laplace_jax.data.store import read_meta
from laplace_jax.data.synthetic import MQARWindows
from laplace_jax.data.tokenizer import load_tokenizer
from laplace_jax.errors import DataError, UserError


class TrainingData:
    """``train`` windows, ``val`` eval batches and the tokenizer's facts (``tokenizer`` spec,
    ``vocab_size``, ``eos_id``) for a ``data`` block; checked against the model's vocabulary."""

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
        self.train: WindowSource
        val: WindowSource
        if d.source == "mqar":
            tok = load_tokenizer(d.tokenizer)
            self.tokenizer, self.vocab_size, self.eos_id = tok.spec, tok.vocab_size, tok.eos_id
            args = (tok, d.seq_len, d.seed, d.mqar.min_pairs, d.mqar.max_pairs)
            self.train = MQARWindows(*args)
            val = MQARWindows(*args, split="val")
        elif d.path:
            meta = read_meta(d.path)
            self.tokenizer, self.vocab_size, self.eos_id = meta["tokenizer"], meta["vocab_size"], meta["eos_id"]
            self.train = store_windows(d.path, "train", d.seq_len)
            val = store_windows(d.path, "val", d.seq_len)
        else:
            tok = load_tokenizer(d.tokenizer)
            self.tokenizer, self.vocab_size, self.eos_id = tok.spec, tok.vocab_size, tok.eos_id
            tokens = embedded_tokens(tok.spec, d.embedded_max_chars)
            cut = int(len(tokens) * 0.98)
            self.train = array_windows(tokens[:cut], d.seq_len)
            val = array_windows(tokens[cut:], d.seq_len)
        self.val = eval_batches(val, min(d.global_batch, 8), d.eval_batches)


@functools.lru_cache(maxsize=4)
def embedded_tokens(spec: str, max_chars: int) -> np.ndarray:
    """The embedded corpus as one flat token array (documents joined by EOS), cached per process."""
    tok = load_tokenizer(spec)
    parts = []
    for doc in embedded_documents(max_chars):
        parts += [np.asarray(tok.encode(doc), np.uint32), np.asarray([tok.eos_id], np.uint32)]
    return np.concatenate(parts)
