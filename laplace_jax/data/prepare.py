"""Tokenize Parquet / JSONL / text into a sharded dataset (``store.py``) with a datatrove pipeline.

    python -m laplace_jax.data.prepare --input notes/*.txt --tokenizer byte --out data/notes
    python -m laplace_jax.data.prepare --input 's3://bucket/fineweb-edu/*.parquet' \\
        --tokenizer gpt2/tokenizer.json --out gs://bucket/fw --tasks 512 --executor slurm ...

The pipeline is datatrove's: readers over the input files (split over ``--tasks`` tasks, file i to
task i % tasks), then a step that tokenizes batches of documents with the Rust tokenizer and
writes its task's shard. ``--executor local`` runs the tasks here, ``--workers`` at a time;
``slurm`` and ``ray`` run them on a cluster. The manifest is written once every task has finished
(by the command itself, or on Slurm by a one-task job that depends on the tasks). A rerun of
the same command skips finished tasks (datatrove's completion records in DIR/.prepare) and
redoes the others from scratch, so a killed run ends, when rerun, with the same manifest and
bytes as one that was never interrupted.

A document goes to the validation split when a seeded hash of its text falls below
``--val_fraction``: the split does not depend on the task count or the order of the files. Each
document is stored as its tokens (the document tokenized alone) followed by the tokenizer's EOS.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from laplace_jax.data.readers import expand_inputs, input_kind, readers_for
from laplace_jax.data.store import FORMAT, SPLITS, ShardWriter, join, kvstore_url, read_json, shard_name, write_json
from laplace_jax.data.tokenizer import encode_batch, load_tokenizer
from laplace_jax.errors import DataError, UserError

BATCH = 512  # documents per tokenizer call
EXECUTORS = ("local", "slurm", "ray")


def is_val(text: str, val_fraction: float, seed: int) -> bool:
    """Whether a document belongs to the validation split: a hash of its text and the seed, so
    the same text lands in the same split whatever the task count, file order or run."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") < val_fraction * 2.0**64


def _batches(docs: DocumentsPipeline, size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for d in docs or ():
        batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class TokenizeToShard(PipelineStep):
    """The pipeline's last step: tokenizes its task's documents ``BATCH`` at a time and appends them
    to the task's shard (``store.ShardWriter``), which is committed only when every document is in."""

    name = "🔢 tokenize to a shard"
    type = "💽 - WRITER"

    def __init__(self, out: str, tokenizer: str, eos_id: int, val_fraction: float, seed: int):
        super().__init__()
        self.out, self.tokenizer, self.eos_id = out, tokenizer, eos_id
        self.val_fraction, self.seed = val_fraction, seed

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        writer = ShardWriter(self.out, rank, self.eos_id)
        if writer.done:  # committed by a run that was stopped before datatrove recorded the task
            return
        writer.open()
        try:
            with self.track_time("task"):  # reading, tokenizing and writing: the task's whole time
                for batch in _batches(data, BATCH):
                    ids = encode_batch(self.tokenizer, [d.text for d in batch])
                    picks: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
                    for doc, tokens in zip(batch, ids, strict=True):
                        picks["val" if is_val(doc.text, self.val_fraction, self.seed) else "train"].append(tokens)
                    for split, docs in picks.items():
                        writer.splits[split].add(docs)
                        self.stat_update(f"{split}_documents", value=len(docs))
                        self.stat_update(f"{split}_tokens", value=sum(len(t) + 1 for t in docs))
                writer.commit()
        except BaseException:
            writer.abort()
            raise


def collect_manifest(out: str, tasks: int, header: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a finished run: every task's shard record, summed per split; a dataset with
    an empty split is refused (the message says what to change)."""
    root = kvstore_url(out)
    shards = []
    for r in range(tasks):
        info = read_json(join(root, "shards", shard_name(r), "shard.json"))
        if info is None:
            raise DataError(f"task {r} left no finished shard in {out}; rerun the same command")
        shards.append({"path": f"shards/{shard_name(r)}", **info})
    splits = {s: {k: sum(sh[s][k] for sh in shards) for k in ("tokens", "docs")} for s in SPLITS}
    empty = [s for s in SPLITS if splits[s]["docs"] == 0]
    if empty:
        n = sum(splits[s]["docs"] for s in SPLITS)
        raise DataError(
            f"the {' and '.join(empty)} split would be empty: {n} document(s) in all, each sent to validation "
            f"with probability --val_fraction {header['val_fraction']}. Give more documents (a text file is one "
            "document: split a long text into several files) or change --val_fraction, with a new --out"
        )
    return {**header, "splits": splits, "shards": shards}


class WriteManifest(PipelineStep):
    """The one-task Slurm job after the tokenizing tasks: writes the manifest (``collect_manifest``)."""

    name = "📜 manifest"
    type = "💽 - WRITER"

    def __init__(self, out: str, tasks: int, header: dict[str, Any]):
        super().__init__()
        self.out, self.tasks, self.header = out, tasks, header

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        write_json(join(kvstore_url(self.out), "manifest.json"), collect_manifest(self.out, self.tasks, self.header))


def _settings(args: dict[str, Any], out: str) -> None:
    """Record the run's settings beside its shards; a rerun into the same --out with other settings
    is refused (its finished shards would mix two datasets)."""
    where = join(kvstore_url(out), ".prepare", "settings.json")
    before = read_json(where)
    if before is not None and before != args:
        changed = sorted(k for k in args if before.get(k) != args[k])
        raise UserError(
            f"{out} was prepared with other settings ({', '.join(changed)} differ); "
            "use a new --out, or delete it to start over"
        )
    if before is None:
        write_json(where, args)


def _check_first_files(files: list[str], field: str) -> None:
    """A wrong --field fails here, before any task starts, on the first file of each kind."""
    firsts = {input_kind(f): f for f in reversed(files)}
    for reader in readers_for(list(firsts.values()), field):
        if input_kind(reader.files[0]) == "text":
            continue
        for _ in reader.read_file(reader.files[0]):
            break


def _run(kind: str, pipeline: list, out: str, tasks: int, workers: int, header: dict, cluster: dict) -> bool:
    """Run the tasks on datatrove's ``kind`` executor; True when they ran here (local, Ray: the
    caller writes the manifest), False when Slurm took them and a dependent one-task job will."""
    logs = join(kvstore_url(out).removeprefix("file://"), ".prepare", "tasks")
    if kind == "local":
        from datatrove.executor import LocalPipelineExecutor

        LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=logs).run()
        return True
    if kind == "ray":
        import ray
        from datatrove.executor import RayPipelineExecutor

        ray.init(address=cluster.get("ray_address") or None, ignore_reinit_error=True, log_to_driver=False)
        RayPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=logs).run()
        return True
    from datatrove.executor import SlurmPipelineExecutor as Slurm

    opts = {"time": cluster["slurm_time"], "partition": cluster["slurm_partition"], "cpus_per_task": 1}
    main = Slurm(pipeline, tasks=tasks, workers=workers, logging_dir=logs, job_name="prepare", **opts)
    manifest = [WriteManifest(out, tasks, header)]
    Slurm(manifest, tasks=1, logging_dir=logs + "-manifest", job_name="manifest", depends=main, **opts).run()
    return False


def prepare(
    inputs: list[str],
    tokenizer: str,
    out: str,
    *,
    field: str = "text",
    val_fraction: float = 0.01,
    seed: int = 0,
    tasks: int = 1,
    workers: int = 1,
    executor: str = "local",
    max_vocab: int | None = None,
    cluster: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Prepare the dataset; returns its manifest (None when a cluster executor was only submitted).
    ``max_vocab``: the model's vocabulary size, checked against the tokenizer before any work."""
    if not 0 < val_fraction < 1:
        raise UserError(f"--val_fraction must be in (0, 1): training evaluates on the val split; got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    if max_vocab is not None and tok.vocab_size > max_vocab:
        raise UserError(
            f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is {max_vocab}: a model for this data "
            f"needs --config.model.vocab_size={tok.vocab_size} (or larger)"
        )
    files = expand_inputs(inputs)
    _check_first_files(files, field)
    tasks = max(1, min(tasks, len(files)))  # a task reads whole files: more tasks than files would idle
    header = {
        "format": FORMAT,
        "tokenizer": tok.spec,
        "tokenizer_sha256": _file_sha256(tok.spec),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "val_fraction": val_fraction,
        "seed": seed,
        "field": field,
        "inputs": files,
        "tasks": tasks,
    }
    _settings(header, out)
    pipeline = [*readers_for(files, field), TokenizeToShard(out, tok.spec, tok.eos_id, val_fraction, seed)]
    if not _run(executor, pipeline, out, tasks, workers, header, cluster or {}):
        return None  # submitted: the manifest job runs after the tasks, on the cluster
    manifest = collect_manifest(out, tasks, header)  # an empty split is refused here, in one line
    write_json(join(kvstore_url(out), "manifest.json"), manifest)
    return manifest


def _file_sha256(spec: str) -> str | None:
    if not os.path.isfile(spec):
        return None
    with open(spec, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m laplace_jax.data.prepare",
        description=__doc__.split("\n\n")[0],
        epilog="docs/data.md has the layout, the cluster commands and the figures.",
    )
    ap.add_argument(
        "--input", nargs="+", required=True,
        help="files, directories, globs or fsspec URLs (s3://, gs://, hf://datasets/...): .parquet, "
        ".jsonl/.json/.ndjson (optionally .gz/.zst) and plain text, where one file is one document",
    )  # fmt: skip
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    ap.add_argument("--out", required=True, help="output dataset: a directory or a tensorstore URL (gs://, s3://)")
    ap.add_argument("--field", default="text", help="the JSONL field / Parquet column holding the text")
    ap.add_argument(
        "--val_fraction", type=float, default=0.01,
        help="share of documents held out for evaluation, chosen by a hash of each document's text",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="seed of the validation hash (another seed, another split)")
    ap.add_argument("--tasks", type=int, default=1, help="tasks (output shards); each reads whole input files")
    ap.add_argument("--workers", type=int, default=1, help="tasks run at once (local: processes; ray/slurm: jobs)")
    ap.add_argument("--executor", choices=EXECUTORS, default="local", help="where tasks run (datatrove's executors)")
    ap.add_argument("--config", help="a training config (configs/3b.py): a tokenizer its model cannot hold is refused")
    ap.add_argument("--ray_address", help="with --executor ray: the cluster (default: RAY_ADDRESS, or a local Ray)")
    ap.add_argument("--slurm_partition", help="with --executor slurm: the partition")
    ap.add_argument("--slurm_time", default="24:00:00", help="with --executor slurm: each task's time limit")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.executor == "slurm" and not a.slurm_partition:
            raise UserError("--executor slurm needs --slurm_partition")
        max_vocab = None
        if a.config:
            from laplace_jax.config import load_run_config

            max_vocab = load_run_config(a.config).model.vocab_size
        cluster = {"ray_address": a.ray_address, "slurm_partition": a.slurm_partition, "slurm_time": a.slurm_time}
        manifest = prepare(
            a.input, a.tokenizer, a.out, field=a.field, val_fraction=a.val_fraction, seed=a.seed, tasks=a.tasks,
            workers=a.workers, executor=a.executor, max_vocab=max_vocab, cluster=cluster,
        )  # fmt: skip
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if manifest is None:
        print(f"submitted to {a.executor}: {a.out}/manifest.json appears when every task has finished")
        return 0
    s = manifest["splits"]
    print(
        f"wrote {a.out}: {len(manifest['shards'])} shard(s); train {s['train']['tokens']:,} tokens / "
        f"{s['train']['docs']:,} docs, val {s['val']['tokens']:,} tokens / {s['val']['docs']:,} docs "
        f"(vocab {manifest['vocab_size']}, EOS {manifest['eos_id']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
