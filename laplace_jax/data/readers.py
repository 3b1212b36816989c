"""Input files as datatrove readers: Parquet, JSONL and plain text, on any fsspec path.

Each reader is handed its file list (sorted) and reads every ``world_size``-th file from its task's
rank, through datatrove's ``BaseDiskReader`` (fsspec I/O, compression inferred from the name,
per-task limits, stats). Unlike datatrove's own readers, which log a warning and skip, a missing
column, an unparsable row or a file that is not UTF-8 stops the task with a ``DataError`` that
names the file and the row: nothing is dropped silently.
"""

from __future__ import annotations

import fsspec
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.readers.base import BaseDiskReader

from laplace_jax.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".xz")


def input_kind(path: str) -> str:
    """'parquet', 'jsonl' or 'text' (anything else: one file is one document)."""
    name = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"


class _FileList:
    """Mixin: the reader's files are given, each with its position in the whole input list; file i
    goes to task i % world_size, whatever reader reads it."""

    files: list[str]
    positions: list[int]

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        mine = [f for f, i in zip(self.files, self.positions, strict=True) if i % world_size == rank]
        for doc in self.read_files_shard(mine):
            self.update_doc_stats(doc)
            yield doc


class ParquetDocuments(_FileList, ParquetReader):
    """Parquet rows; the text is column ``text_key`` (FineWeb-Edu: "text"); null rows are skipped."""

    name = "📒 Parquet (laplace-jax)"

    def __init__(self, data_folder: str, files: list[str], positions: list[int], text_key: str = "text"):
        super().__init__(data_folder, text_key=text_key, read_metadata=False)
        self.files, self.positions = files, positions

    def read_file(self, filepath: str) -> DocumentsPipeline:
        import pyarrow.parquet as pq

        where = self.data_folder.resolve_paths(filepath)
        with self.data_folder.open(filepath, "rb") as f:
            try:
                pqf = pq.ParquetFile(f)
            except Exception as e:  # pyarrow raises several types for a corrupt file
                raise DataError(f"{where}: not a readable Parquet file ({e})") from e
            names = pqf.schema_arrow.names
            if self.text_key not in names:
                raise DataError(f"{where}: no column {self.text_key!r} (columns: {names}); pass --field")
            row = 0
            for batch in pqf.iter_batches(batch_size=self.batch_size, columns=[self.text_key]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield Document(text=str(text), id=f"{filepath}/{row}")
                    row += 1


class JsonlDocuments(_FileList, JsonlReader):
    """JSON lines (optionally .gz / .zst); the text is field ``text_key``; blank lines are skipped."""

    name = "🐿 Jsonl (laplace-jax)"

    def __init__(self, data_folder: str, files: list[str], positions: list[int], text_key: str = "text"):
        super().__init__(data_folder, text_key=text_key)
        self.files, self.positions = files, positions

    def read_file(self, filepath: str) -> DocumentsPipeline:
        import orjson

        where = self.data_folder.resolve_paths(filepath)
        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise DataError(f"{where}:{n}: not valid JSON ({e})") from e
                if not isinstance(row, dict) or self.text_key not in row:
                    fields = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise DataError(f"{where}:{n}: no field {self.text_key!r} (found: {fields}); pass --field")
                if row[self.text_key]:
                    yield Document(text=str(row[self.text_key]), id=f"{filepath}/{n}")


class TextDocuments(_FileList, BaseDiskReader):
    """Plain text, one file = one document (UTF-8)."""

    name = "📄 Text (laplace-jax)"

    def __init__(self, data_folder: str, files: list[str], positions: list[int]):
        super().__init__(data_folder)
        self.files, self.positions = files, positions

    def read_file(self, filepath: str) -> DocumentsPipeline:
        with self.data_folder.open(filepath, "rb", compression="infer") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            where = self.data_folder.resolve_paths(filepath)
            raise DataError(f"{where}: not UTF-8 text at byte {e.start}; convert it or leave it out") from e
        if text:
            yield Document(text=text, id=filepath)


READERS = {"parquet": ParquetDocuments, "jsonl": JsonlDocuments, "text": TextDocuments}


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def expand_inputs(items: list[str]) -> list[str]:
    """Every input file as a full path or URL, sorted: files, directories (the files under them,
    but names starting with '.' or '_'), globs, and fsspec URLs (s3://, gs://, hf://datasets/...)."""
    found: list[str] = []
    for item in items:
        fs, path = fsspec.core.url_to_fs(item)
        if _has_magic(path):
            paths = sorted(fs.glob(path))
            if not paths:
                raise DataError(f"--input {item!r} matches no file")
        elif fs.isdir(path):  # every file under it but hidden and marker files (.crc, _SUCCESS)
            paths = sorted(p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith((".", "_")))
            if not paths:
                raise DataError(f"--input {item!r} is an empty directory")
        elif fs.isfile(path):
            paths = [path]
        else:
            raise DataError(f"input {item} does not exist")
        found += [fs.unstrip_protocol(p) if "://" in item else p for p in paths if not fs.isdir(p)]
    return sorted(set(found))


def readers_for(files: list[str], text_key: str) -> list[BaseDiskReader]:
    """One datatrove reader per input kind present, each over its files relative to their common
    folder; together they hand file i of ``files`` to task i % tasks."""
    import os

    readers = []
    for kind, cls in READERS.items():
        positions = [i for i, f in enumerate(files) if input_kind(f) == kind]
        if not positions:
            continue
        mine = [files[i] for i in positions]
        protocols = {f.split("://")[0] if "://" in f else "file" for f in mine}
        if len(protocols) > 1:
            raise DataError(f"{kind} inputs on several stores ({sorted(protocols)}): prepare them separately")
        prefix = f"{protocols.pop()}://" if "://" in mine[0] else ""
        bare = [f.removeprefix(prefix) for f in mine]
        folder = os.path.commonpath([os.path.dirname(b) for b in bare])
        relative = [os.path.relpath(b, folder) for b in bare]
        kwargs = {} if kind == "text" else {"text_key": text_key}
        readers.append(cls(prefix + folder, relative, positions, **kwargs))
    return readers
