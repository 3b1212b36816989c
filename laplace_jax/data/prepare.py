"""Tokenize text / JSONL / Parquet files into a dataset directory (see ``store.py``).

    python -m laplace_jax.data.prepare --input a.parquet b.jsonl c.txt --tokenizer byte --out data/mine
    python -m laplace_jax.data.prepare --input shard-*.parquet --tokenizer gpt2/tokenizer.json --out data/fw

.txt/.md files are one document each; .jsonl lines and Parquet rows take ``--field`` (default
"text", FineWeb-Edu's column). Each input is tokenized (``--workers`` processes) into a staging
file, so an interrupted run resumes where it stopped; the arrays are written at the end.
Documents go to the validation split with probability ``--val_fraction`` (seeded).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from laplace_jax.data.store import write_array
from laplace_jax.data.tokenizer import encode_batch, load_tokenizer
from laplace_jax.errors import DataError

BATCH = 256


def read_documents(path: str, field: str = "text") -> Iterator[str]:
    """Documents of one input file, by extension."""
    if not os.path.isfile(path):
        raise DataError(f"input {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e})") from e
                if field not in row:
                    raise DataError(f"{path}:{n}: no field {field!r} (fields: {sorted(row)}); pass --field")
                yield str(row[field])
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: not a readable Parquet file ({e})") from e
        if field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names}); pass --field")
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            yield from (str(x) for x in batch.column(0).to_pylist() if x is not None)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _tokenize_file(path: str, field: str, spec: str, pool, stage: str, desc: str) -> None:
    pieces: list[np.ndarray] = []
    batches = _batches(read_documents(path, field))
    results = pool.imap(_encode, ((spec, b) for b in batches)) if pool else (_encode((spec, b)) for b in batches)
    with tqdm(desc=desc, unit="doc", leave=False) as bar:
        for arrays in results:
            pieces += arrays
            bar.update(len(arrays))
    lengths = np.asarray([len(p) for p in pieces], np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.uint32)
    np.savez(stage + ".tmp.npz", tokens=tokens, lengths=lengths)
    os.replace(stage + ".tmp.npz", stage)


def _encode(args: tuple[str, list[str]]) -> list[np.ndarray]:
    spec, texts = args
    return encode_batch(spec, texts)


def prepare(
    inputs: list[str],
    tokenizer: str,
    out: str,
    *,
    field: str = "text",
    val_fraction: float = 0.01,
    seed: int = 0,
    workers: int = 1,
    documents: list[str] | None = None,
) -> dict:
    """Build the dataset; returns meta.json's content. ``documents`` adds in-memory texts (tests)."""
    tok = load_tokenizer(tokenizer)
    for p in inputs:
        if not os.path.isfile(p):
            raise DataError(f"input {p} does not exist")
    stage_dir = os.path.join(out, ".staging")
    os.makedirs(stage_dir, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(workers) if workers > 1 else None
    stages = []
    try:
        for i, path in enumerate(tqdm(inputs, desc="files", unit="file", disable=len(inputs) < 2)):
            stage = os.path.join(stage_dir, f"{i:05d}.npz")
            stages.append(stage)
            if not os.path.exists(stage):  # resumable: finished inputs are kept
                _tokenize_file(path, field, tok.spec, pool, stage, os.path.basename(path))
        if documents:
            stage = os.path.join(stage_dir, "inline.npz")
            arrays = encode_batch(tok.spec, documents)
            np.savez(stage, tokens=np.concatenate(arrays), lengths=np.asarray([len(a) for a in arrays]))
            stages.append(stage)
    finally:
        if pool:
            pool.close()
    toks, lens = [], []
    for s in stages:
        with np.load(s) as z:
            toks.append(z["tokens"])
            lens.append(z["lengths"])
    tokens = np.concatenate(toks) if toks else np.zeros((0,), np.uint32)
    lengths = np.concatenate(lens) if lens else np.zeros((0,), np.int64)
    if len(lengths) == 0:
        raise DataError("no documents found in the inputs")
    if tokens.size and int(tokens.max()) >= tok.vocab_size:
        raise DataError(f"token id {int(tokens.max())} >= tokenizer vocab {tok.vocab_size}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    is_val = np.random.default_rng(seed).random(len(lengths)) < val_fraction
    if val_fraction > 0 and not is_val.any():
        is_val[-1] = True
    meta = {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "inputs": inputs, "splits": {}}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        idx = np.flatnonzero(mask)
        parts = []
        for i in idx:
            parts += [tokens[starts[i] : starts[i] + lengths[i]], np.asarray([tok.eos_id], np.uint32)]
        flat = np.concatenate(parts).astype(np.uint32) if parts else np.zeros((0,), np.uint32)
        offsets = np.concatenate([[0], np.cumsum(lengths[idx] + 1)]).astype(np.uint64)
        write_array(os.path.join(out, split, "tokens"), flat)
        write_array(os.path.join(out, split, "doc_offsets"), offsets)
        meta["splits"][split] = {"tokens": len(flat), "docs": len(idx)}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    for s in stages:
        os.remove(s)
    os.rmdir(stage_dir)
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m laplace_jax.data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="text, .jsonl or .parquet files")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    ap.add_argument("--out", required=True, help="output dataset directory")
    ap.add_argument("--field", default="text", help="JSONL field / Parquet column holding the text")
    ap.add_argument("--val_fraction", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 0))
    a = ap.parse_args(argv)
    try:
        meta = prepare(
            a.input, a.tokenizer, a.out, field=a.field, val_fraction=a.val_fraction, seed=a.seed, workers=a.workers
        )
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = meta["splits"]
    print(
        f"wrote {a.out}: train {s['train']['tokens']:,} tokens / {s['train']['docs']:,} docs, "
        f"val {s['val']['tokens']:,} tokens / {s['val']['docs']:,} docs (vocab {meta['vocab_size']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
