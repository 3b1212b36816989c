"""prepare (datatrove pipeline -> zarr3 shards + manifest): each document's tokens, the hash split,
exactly-once under kill -9 and crashes, bad input; reading shards, mixtures and the old format;
the pipeline is deterministic and layout-free."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorstore as ts

import laplace_jax.data.store as store
from laplace_jax.data.pipeline import Mixture, array_windows, store_windows, train_batches
from laplace_jax.data.prepare import is_val, main, prepare
from laplace_jax.data.store import SplitTokens, read_manifest
from laplace_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from laplace_jax.errors import ConfigError, DataError, UserError

DOCS = [f"Document {i}: the quick brown fox {'jumps ' * i}over the lazy dog. é ✓" for i in range(40)]


def _inputs(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in DOCS[1:20]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": DOCS[20:30], "n": list(range(10))}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": DOCS[30:], "n": list(range(10))}), tmp_path / "d.parquet")
    return [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet", "d.parquet")]


def _read_array(url: str) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": store.kvstore_url(url)}
    return np.asarray(ts.open(spec, open=True, read=True).result().read().result())


def _documents(out: str, split: str) -> list[np.ndarray]:
    """Each stored document of a split (tokens + EOS), read shard by shard through its offsets."""
    docs = []
    for shard in read_manifest(out)["shards"]:
        where = store.join(store.kvstore_url(out), shard["path"], split)
        tokens, offsets = _read_array(store.join(where, "tokens")), _read_array(store.join(where, "doc_offsets"))
        docs += [tokens[lo:hi] for lo, hi in itertools.pairwise(offsets)]
    return docs


def _bytes_of(out) -> dict[str, bytes]:
    """Every file of a prepared dataset but datatrove's run records, by relative path."""
    found = {}
    for root, _, files in os.walk(out):
        for name in files:
            path = os.path.join(root, name)
            if ".prepare" not in path:
                with open(path, "rb") as f:
                    found[os.path.relpath(path, out)] = f.read()
    return found


def test_each_document_is_its_own_tokens_then_eos_and_the_split_is_a_hash(tmp_path):
    out = str(tmp_path / "out")
    manifest = prepare(_inputs(tmp_path), "byte", out, val_fraction=0.3, seed=1, tasks=3)
    tok = ByteTokenizer()
    stored = {s: _documents(out, s) for s in ("train", "val")}
    for split, docs in stored.items():
        assert manifest["splits"][split]["docs"] == len(docs) > 0
        assert manifest["splits"][split]["tokens"] == sum(map(len, docs)) == len(SplitTokens(out, split))
    want = {(*tok.encode(d), tok.eos_id): ("val" if is_val(d, 0.3, 1) else "train") for d in DOCS}
    got = {tuple(int(t) for t in doc): split for split, docs in stored.items() for doc in docs}
    assert got == want  # every document once, tokenized alone, EOS after it, in the split its hash names
    assert len(manifest["shards"]) == 3 and manifest["vocab_size"] == 256 and manifest["eos_id"] == 0


def test_split_and_totals_do_not_depend_on_task_count_or_file_order(tmp_path):
    inputs = _inputs(tmp_path)
    one = prepare(inputs, "byte", str(tmp_path / "one"), val_fraction=0.3, tasks=1)
    many = prepare(inputs[::-1], "byte", str(tmp_path / "many"), val_fraction=0.3, tasks=4, workers=2)
    assert one["splits"] == many["splits"] and len(many["shards"]) == 4
    for split in ("train", "val"):
        a = sorted(d.tobytes() for d in _documents(str(tmp_path / "one"), split))
        assert a == sorted(d.tobytes() for d in _documents(str(tmp_path / "many"), split))


def test_a_tokenizer_json_encodes_each_document_alone(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"]))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    out = str(tmp_path / "out")
    prepare(_inputs(tmp_path), str(tmp_path / "tokenizer.json"), out, val_fraction=0.3, tasks=2)
    got = sorted(d.tolist() for s in ("train", "val") for d in _documents(out, s))
    assert got == sorted([*tok.encode(d), tok.eos_id] for d in DOCS)


def test_sharded_reads_cross_shard_boundaries_and_the_url_form_reads_the_same(tmp_path):
    out = str(tmp_path / "out")
    prepare(_inputs(tmp_path), "byte", out, val_fraction=0.3, tasks=4)
    tokens = SplitTokens(out, "train")
    whole = np.concatenate([d for d in _documents(out, "train")])
    np.testing.assert_array_equal(tokens.read(0, len(tokens)), whole)
    for lo, hi in [(0, 1), (5, 900), (len(whole) - 300, len(whole)), (123, 2_500)]:
        np.testing.assert_array_equal(tokens.read(lo, hi), whole[lo:hi])
    url = "file://" + out  # a tensorstore URL (gs://, s3:// read the same way)
    np.testing.assert_array_equal(store_windows(url, "train", 16)[3], store_windows(out, "train", 16)[3])


def test_the_format_before_shards_still_loads(tmp_path):
    """A dataset from the previous prepare (meta.json, one flat array per split) reads as one shard."""
    legacy = tmp_path / "legacy"
    arrays = {"train": np.arange(1, 500, dtype=np.uint32) % 250, "val": np.arange(1, 200, dtype=np.uint32) % 250}
    for split, values in arrays.items():
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(legacy / split / "tokens")},
            "metadata": {"shape": [len(values)], "data_type": "uint32"},
        }
        ts.open(spec, create=True).result().write(values).result()
    meta = {
        "tokenizer": "byte",
        "vocab_size": 256,
        "eos_id": 0,
        "splits": {s: {"tokens": len(v), "docs": 1} for s, v in arrays.items()},
    }
    (legacy / "meta.json").write_text(json.dumps(meta))
    for split, values in arrays.items():
        np.testing.assert_array_equal(SplitTokens(str(legacy), split).read(0, len(values)), values)


def test_kill_9_then_rerun_gives_the_same_manifest_and_bytes(tmp_path):
    """A real SIGKILL of the whole process group once the first shard is committed; the rerun
    skips the finished tasks and ends byte-identical to an uninterrupted run."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta"])
    inputs = []
    for i in range(6):
        path = tmp_path / f"part{i}.jsonl"
        with open(path, "w") as f:
            for _ in range(400):
                f.write(json.dumps({"text": " ".join(rng.choice(words, 600))}) + "\n")
        inputs.append(str(path))
    args = ["--input", *inputs, "--tokenizer", "byte", "--tasks", "6", "--workers", "1", "--val_fraction", "0.1"]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    cmd = [sys.executable, "-m", "laplace_jax.data.prepare", *args, "--out", str(tmp_path / "killed")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    shards = tmp_path / "killed" / "shards"
    deadline = time.time() + 120
    while not (shards.exists() and any(not p.name.endswith(".tmp") for p in shards.iterdir())):
        assert proc.poll() is None and time.time() < deadline, "prepare ended before a shard was committed"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "manifest.json").exists()
    finished = {p.name for p in shards.iterdir() if not p.name.endswith(".tmp")}
    assert 0 < len(finished) < 6
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0
    assert _bytes_of(tmp_path / "killed") == _bytes_of(tmp_path / "straight")


def test_a_crashed_task_or_a_full_disk_leaves_no_partial_shard(tmp_path, monkeypatch):
    inputs = _inputs(tmp_path)
    bad = tmp_path / "e.jsonl"
    bad.write_text('{"text": "fine"}\n' * 3 + "{broken\n")
    out = str(tmp_path / "out")
    with pytest.raises(DataError, match=r"e\.jsonl:4: not valid JSON"):
        prepare([*inputs, str(bad)], "byte", out, val_fraction=0.3, tasks=5)
    shards = sorted(p.name for p in (tmp_path / "out" / "shards").iterdir())
    assert "00004" not in shards and not any(s.endswith(".tmp") for s in shards)  # the crashed task left nothing
    assert not (tmp_path / "out" / "manifest.json").exists()
    bad.write_text('{"text": "fine"}\n' * 4)  # the file mended, the same command finishes the run
    assert prepare([*inputs, str(bad)], "byte", out, val_fraction=0.3, tasks=5)["splits"]["train"]["docs"] > 0

    def no_space(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.ArrayAppender, "_flush", no_space)
    with pytest.raises(OSError, match="No space"):
        prepare(inputs, "byte", str(tmp_path / "full"), val_fraction=0.3, tasks=2)
    assert not (tmp_path / "full" / "shards").exists() or not list((tmp_path / "full" / "shards").iterdir())
    assert not (tmp_path / "full" / "manifest.json").exists()


def test_bad_input_is_refused_with_what_to_do(tmp_path, capsys):
    inputs = _inputs(tmp_path)
    with pytest.raises(DataError, match=r"no column 'body' \(columns: \['text', 'n'\]\)"):
        prepare([inputs[2]], "byte", str(tmp_path / "o1"), field="body")
    with pytest.raises(DataError, match=r"no field 'body' \(found: \['id', 'text'\]\)"):
        prepare([inputs[1]], "byte", str(tmp_path / "o2"), field="body")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable Parquet file"):
        prepare([str(tmp_path / "broken.parquet")], "byte", str(tmp_path / "o3"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 text at byte 3"):
        prepare([str(tmp_path / "latin1.txt"), *inputs], "byte", str(tmp_path / "o4"), tasks=1)
    with pytest.raises(DataError, match="matches no file"):
        prepare([str(tmp_path / "*.csv")], "byte", str(tmp_path / "o5"))
    with pytest.raises(UserError, match=r"model\.vocab_size is 128"):
        prepare(inputs, "byte", str(tmp_path / "o6"), max_vocab=128)
    assert not (tmp_path / "o6").exists()  # refused before any work
    with pytest.raises(DataError, match="val split would be empty: 1 document"):
        prepare([inputs[0]], "byte", str(tmp_path / "o7"))  # one text file is one document
    assert main(["--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err
    prepare(inputs, "byte", str(tmp_path / "o8"), val_fraction=0.3)
    with pytest.raises(UserError, match=r"other settings \(val_fraction differ\)"):
        prepare(inputs, "byte", str(tmp_path / "o8"), val_fraction=0.2)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer("gpt2")


def test_a_corrupt_or_mismatched_shard_is_a_clear_error(tmp_path):
    out = tmp_path / "out"
    prepare(_inputs(tmp_path), "byte", str(out), val_fraction=0.3, tasks=2)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0]["train"]["tokens"] += 5
    manifest["splits"]["train"]["tokens"] += 5
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="the manifest says"):
        SplitTokens(str(out), "train").read(0, 10)
    with pytest.raises(DataError, match="not a prepared dataset"):
        store_windows(str(tmp_path), "train", 16)


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_pipeline_deterministic_and_independent_of_process_layout():
    tokens = np.arange(10_000, dtype=np.uint32) % 251
    mixture = Mixture([(array_windows(tokens, 32), 0.7), (array_windows(tokens[::-1].copy(), 32), 0.3)])
    for w in (array_windows(tokens, 32), mixture):
        one = _take(train_batches(w, global_batch=8, seed=3, num_steps=50), 30)
        again = _take(train_batches(w, global_batch=8, seed=3, num_steps=50), 30)
        np.testing.assert_array_equal(np.stack(one), np.stack(again))
        halves = [
            _take(train_batches(w, global_batch=8, seed=3, num_steps=50, process_index=p, process_count=2), 30)
            for p in range(2)
        ]
        for t in range(30):
            np.testing.assert_array_equal(np.concatenate([halves[0][t], halves[1][t]]), one[t])
        other = _take(train_batches(w, global_batch=8, seed=4, num_steps=50), 1)
        assert not np.array_equal(other[0], one[0])
        assert one[0].shape == (8, 33) and one[0].dtype == np.int32


def test_a_mixture_draws_by_weight():
    ones, twos = np.ones(5_000, np.uint32), np.full(5_000, 2, np.uint32)
    mixture = Mixture([(array_windows(ones, 16), 3.0), (array_windows(twos, 16), 1.0)])
    rows = np.concatenate(_take(train_batches(mixture, global_batch=8, seed=0, num_steps=100), 100))
    assert (rows[:, 0] == 1).mean() == pytest.approx(0.75, abs=0.01)


def test_iterator_state_resumes_same_batches():
    tokens = np.arange(5_000, dtype=np.uint32) % 97
    for w in (array_windows(tokens, 16), Mixture([(array_windows(tokens, 16), 1), (array_windows(tokens[1:], 16), 2)])):
        it = iter(train_batches(w, global_batch=4, seed=0, num_steps=100))
        _take(it, 7)
        state = it.get_state()
        expected = _take(it, 5)
        it2 = iter(train_batches(w, global_batch=4, seed=0, num_steps=100))
        it2.set_state(state)
        np.testing.assert_array_equal(np.stack(_take(it2, 5)), np.stack(expected))


def test_data_sources_entries_are_checked():
    from helpers import micro_config

    with pytest.raises(ConfigError, match="weight after '=' must be a number"):
        micro_config(data=dict(sources=("data/x=lots",)))
    with pytest.raises(ConfigError, match=r"leave data\.path empty"):
        micro_config(data=dict(sources=("data/x=1",), path="data/y"))
