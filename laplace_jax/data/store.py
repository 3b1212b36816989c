"""Prepared datasets: sharded token arrays (zarr3 through tensorstore) and their manifest, on a
local path or a tensorstore URL (``gs://``, ``s3://``, ``file://``).

    DIR/manifest.json                         written last: the dataset exists once it does
    DIR/shards/NNNNN/shard.json               one per preparation task, written when its arrays are
    DIR/shards/NNNNN/{train,val}/tokens       uint32 [tokens]: documents, each followed by EOS
    DIR/shards/NNNNN/{train,val}/doc_offsets  uint64 [docs + 1]: document i is tokens[o_i : o_{i+1}]

A split reads as one token sequence: its shards in task order. A task's shard is written under a
temporary name and renamed into place on a local disk; on an object store its ``shard.json`` is
the last object written, and the manifest lists only shards whose ``shard.json`` exists, so a
crashed task or a full disk never puts a partial shard in a dataset.

The format before the shards (``DIR/meta.json``, ``DIR/{train,val}/tokens`` and ``doc_offsets``)
still loads: each split is one shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from typing import Any

import numpy as np
import tensorstore as ts

from laplace_jax.errors import DataError

SPLITS = ("train", "val")
FORMAT = "laplace-jax shards 1"
# Whole zarr3 shards are written at once (a worker buffers one: 16 MiB of tokens); reads
# decompress one inner chunk (128 KiB of tokens) per window.
SHARD_ELEMENTS = {"uint32": 1 << 22, "uint64": 1 << 20}
INNER_ELEMENTS = 1 << 15
PREPARE_HINT = "python -m laplace_jax.data.prepare --input FILES --tokenizer byte --out DIR"


def is_url(path: str) -> bool:
    return "://" in path


def kvstore_url(path: str) -> str:
    """A dataset location as a tensorstore kvstore URL ending in '/' (local paths as file://)."""
    url = path if is_url(path) else "file://" + os.path.abspath(path)
    return url.rstrip("/") + "/"


def join(root: str, *parts: str) -> str:
    return root.rstrip("/") + "/" + "/".join(p for p in parts if p)


def _array_spec(url: str, dtype: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kvstore_url(url)}
    if dtype is not None:
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]
        index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        spec["metadata"] = {
            "shape": [0],
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD_ELEMENTS[dtype]]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {"chunk_shape": [INNER_ELEMENTS], "codecs": inner, "index_codecs": index},
                }
            ],
        }
    return spec


class ArrayAppender:
    """A 1-D zarr3 array written front to back in whole zarr shards: holds at most one shard in
    memory, and hashes (sha256) the little-endian bytes it writes."""

    def __init__(self, url: str, dtype: str):
        self._store = ts.open(_array_spec(url, dtype), create=True, delete_existing=True).result()
        self._buffer = np.empty(SHARD_ELEMENTS[dtype], np.dtype(dtype).newbyteorder("<"))
        self._fill, self.count, self._hash = 0, 0, hashlib.sha256()

    @property
    def size(self) -> int:
        """Elements appended so far (written or buffered)."""
        return self.count + self._fill

    def append(self, values: np.ndarray) -> None:
        while len(values):
            take = min(len(values), len(self._buffer) - self._fill)
            self._buffer[self._fill : self._fill + take] = values[:take]
            self._fill, values = self._fill + take, values[take:]
            if self._fill == len(self._buffer):
                self._flush()

    def _flush(self) -> None:
        piece = self._buffer[: self._fill]
        self._store = self._store.resize(exclusive_max=[self.count + self._fill], expand_only=True).result()
        self._store[self.count : self.count + self._fill].write(piece).result()
        self._hash.update(piece.tobytes())
        self.count += self._fill
        self._fill = 0

    def close(self) -> dict[str, Any]:
        if self._fill:
            self._flush()
        return {"count": self.count, "sha256": self._hash.hexdigest()}


class SplitWriter:
    """One split of one shard: documents appended as tokens + EOS, with their offsets."""

    def __init__(self, url: str, eos_id: int):
        self._tokens = ArrayAppender(join(url, "tokens"), "uint32")
        self._offsets = ArrayAppender(join(url, "doc_offsets"), "uint64")
        self._eos = np.asarray([eos_id], np.uint32)
        self._offsets.append(np.zeros(1, np.uint64))

    def add(self, docs: list[np.ndarray]) -> None:
        if not docs:
            return
        lengths = np.asarray([len(d) + 1 for d in docs], np.uint64)
        self._offsets.append(np.uint64(self._tokens.size) + np.cumsum(lengths, dtype=np.uint64))
        for d in docs:
            self._tokens.append(d)
            self._tokens.append(self._eos)

    def close(self) -> dict[str, Any]:
        tokens, offsets = self._tokens.close(), self._offsets.close()
        return {
            "tokens": tokens["count"],
            "docs": offsets["count"] - 1,
            "tokens_sha256": tokens["sha256"],
            "offsets_sha256": offsets["sha256"],
        }


def shard_name(rank: int) -> str:
    return f"{rank:05d}"


class ShardWriter:
    """A preparation task's shard, both splits; committed atomically by ``commit`` (see the module
    docstring), removed by ``abort``. ``done`` is true when a run before this one committed it."""

    def __init__(self, root: str, rank: int, eos_id: int):
        self.final = join(kvstore_url(root), "shards", shard_name(rank))
        self._local = None if is_url(root) else os.path.join(os.path.abspath(root), "shards", shard_name(rank))
        self.done = read_json(join(self.final, "shard.json")) is not None
        self._eos_id = eos_id
        self.splits: dict[str, SplitWriter] = {}

    def open(self) -> None:
        if self._local is not None:  # a killed run's leftovers under the temporary name go first
            shutil.rmtree(self._local + ".tmp", ignore_errors=True)
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
        where = self.final if self._local is None else kvstore_url(self._local + ".tmp")
        self._where = where
        self.splits = {s: SplitWriter(join(where, s), self._eos_id) for s in SPLITS}

    def commit(self) -> dict[str, Any]:
        info = {s: w.close() for s, w in self.splits.items()}
        write_json(join(self._where, "shard.json"), info)
        if self._local is not None:
            os.replace(self._local + ".tmp", self._local)
        return info

    def abort(self) -> None:
        if self._local is not None:
            shutil.rmtree(self._local + ".tmp", ignore_errors=True)


def read_json(url: str) -> Any | None:
    """A JSON object at a kvstore URL, or None when there is none."""
    root, key = url.rsplit("/", 1)
    result = ts.KvStore.open(root + "/").result().read(key).result()
    return json.loads(result.value) if result.state == "value" else None


def write_json(url: str, value: Any) -> None:
    """One object written whole (a local file through a temporary name and a rename)."""
    data = json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"
    if url.startswith("file://"):
        path = url[len("file://") :]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        return
    root, key = url.rsplit("/", 1)
    ts.KvStore.open(root + "/").result().write(key, data).result()


def read_manifest(path: str) -> dict[str, Any]:
    """A prepared dataset's manifest (tokenizer, vocab_size, eos_id, splits, shards); a dataset in
    the format before shards is read as one shard per split."""
    root = kvstore_url(path)
    manifest = read_json(join(root, "manifest.json"))
    if manifest is not None:
        if manifest.get("format") != FORMAT:
            raise DataError(f"{path}: manifest format {manifest.get('format')!r}, this version reads {FORMAT!r}")
        return manifest
    meta = read_json(join(root, "meta.json"))
    if meta is None:
        raise DataError(f"{path} is not a prepared dataset (no manifest.json); create it with {PREPARE_HINT}")
    meta["shards"] = [{"path": "", **{s: meta["splits"][s] for s in SPLITS if s in meta["splits"]}}]
    return meta


class SplitTokens:
    """One split of a prepared dataset as one flat uint32 token sequence (its shards in order),
    read lazily through tensorstore; safe to read from several threads."""

    def __init__(self, path: str, split: str, manifest: dict[str, Any] | None = None):
        self.path, self.split = path, split
        self.manifest = manifest or read_manifest(path)
        if split not in self.manifest["splits"]:
            raise DataError(f"{path} has no split {split!r} (has {sorted(self.manifest['splits'])})")
        root = kvstore_url(path)
        shards = [s for s in self.manifest["shards"] if s.get(split, {}).get("tokens", 0) > 0]
        self._urls = [join(root, s["path"], split, "tokens") for s in shards]
        self._counts = [int(s[split]["tokens"]) for s in shards]
        self._starts = np.concatenate([[0], np.cumsum(self._counts, dtype=np.int64)])
        self._arrays: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _array(self, i: int) -> Any:
        with self._lock:
            if i not in self._arrays:
                try:
                    array = ts.open(_array_spec(self._urls[i]), open=True, read=True).result()
                except (ValueError, RuntimeError) as e:
                    raise DataError(f"{self._urls[i]} is missing or corrupt ({e}); prepare the dataset again") from e
                if array.shape[0] != self._counts[i]:
                    raise DataError(
                        f"{self._urls[i]} has {array.shape[0]} tokens, the manifest says {self._counts[i]}; "
                        "prepare the dataset again"
                    )
                self._arrays[i] = array
            return self._arrays[i]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split, across shard boundaries."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts, at = [], start
        for i in range(max(first, 0), len(self._counts)):
            if at >= stop:
                break
            lo, hi = at - int(self._starts[i]), min(stop, int(self._starts[i + 1])) - int(self._starts[i])
            try:
                parts.append(np.asarray(self._array(i)[lo:hi].read().result()))
            except (ValueError, RuntimeError) as e:
                raise DataError(f"reading {self._urls[i]}[{lo}:{hi}] failed ({e}); prepare the dataset again") from e
            at = int(self._starts[i]) + hi
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
