"""Tokenized datasets on disk: one flat uint32 token array per split (zarr v3 via tensorstore,
chunked, zstd) in which every document is followed by EOS, plus document offsets and meta.json.

    DIR/meta.json                 tokenizer spec, vocab_size, eos_id, per-split token/doc counts
    DIR/{train,val}/tokens        uint32 [n_tokens]
    DIR/{train,val}/doc_offsets   uint64 [n_docs + 1]; doc i = tokens[off[i] : off[i+1] - 1] (+ EOS)
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import tensorstore as ts

from laplace_jax.errors import DataError

CHUNK = 1 << 20


def _spec(path: str, dtype: str, shape: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.abspath(path)}}
    if shape is not None:
        spec["metadata"] = {
            "shape": [shape],
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, min(CHUNK, shape))]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
        }
    return spec


def write_array(path: str, array: np.ndarray) -> None:
    dtype = {np.dtype(np.uint32): "uint32", np.dtype(np.uint64): "uint64"}[array.dtype]
    store = ts.open(_spec(path, dtype, len(array)), create=True, delete_existing=True).result()
    store.write(array).result()


def read_meta(path: str) -> dict[str, Any]:
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise DataError(
            f"{path} is not a prepared dataset (no meta.json); create it with "
            "python -m laplace_jax.data.prepare --input FILES --tokenizer byte --out DIR"
        )
    with open(meta_file) as f:
        return json.load(f)


class TokenStore:
    """Random access to one split's flat token array (lazy reads through tensorstore)."""

    def __init__(self, path: str, split: str):
        self.meta = read_meta(path)
        if split not in self.meta["splits"]:
            raise DataError(f"{path} has no split {split!r} (has {sorted(self.meta['splits'])})")
        try:
            self.tokens = ts.open(_spec(os.path.join(path, split, "tokens"), "uint32"), open=True, read=True).result()
        except (ValueError, RuntimeError) as e:
            raise DataError(f"{path}/{split} is missing or corrupt ({e}); re-run laplace_jax.data.prepare") from e
        want = self.meta["splits"][split]["tokens"]
        if self.tokens.shape[0] != want:
            raise DataError(
                f"{path}/{split}/tokens has {self.tokens.shape[0]} tokens, meta.json says {want}; re-prepare"
            )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(self.tokens[start:stop].read().result())
        except (ValueError, RuntimeError) as e:
            raise DataError(f"reading tokens {start}:{stop} failed ({e}); the data is corrupt, re-run prepare") from e
