"""prepare (text / JSONL / Parquet -> zarr3) round trips; the pipeline is deterministic and layout-free."""

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorstore as ts

from laplace_jax.data.pipeline import array_windows, store_windows, train_batches
from laplace_jax.data.prepare import main, prepare
from laplace_jax.data.store import TokenStore
from laplace_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from laplace_jax.errors import DataError

DOCS = [f"Document {i}: the quick brown fox {'jumps ' * i}over the lazy dog. é ✓" for i in range(40)]


def _inputs(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in DOCS[1:20]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": DOCS[20:], "n": list(range(20))}), tmp_path / "c.parquet")
    return [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet")]


def _doc_offsets(split_dir) -> np.ndarray:
    """The document offsets prepare writes beside the tokens (zarr3, read with tensorstore)."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(split_dir / "doc_offsets")}}
    return np.asarray(ts.open(spec, open=True, read=True).result().read().result())


def test_prepare_round_trips_token_ids(tmp_path):
    meta = prepare(_inputs(tmp_path), "byte", str(tmp_path / "out"), val_fraction=0.2, seed=1)
    tok = ByteTokenizer()
    got = []
    for split in ("train", "val"):
        store = TokenStore(str(tmp_path / "out"), split)
        offsets = _doc_offsets(tmp_path / "out" / split)  # document i is tokens[o_i : o_{i+1} - 1], then EOS
        for lo, hi in itertools.pairwise(offsets):
            got.append(tok.decode(store.read(int(lo), int(hi) - 1).tolist()))
        assert len(offsets) == meta["splits"][split]["docs"] + 1
        assert int(store.read(len(store) - 1, len(store))[0]) == tok.eos_id
    assert sorted(got) == sorted(DOCS)
    assert meta["splits"]["val"]["docs"] > 0 and meta["vocab_size"] == 256


def test_prepare_cli_and_errors(tmp_path, capsys):
    paths = _inputs(tmp_path)
    assert main(["--input", *paths, "--tokenizer", "byte", "--out", str(tmp_path / "o"), "--workers", "2"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x")]) == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    assert main(["--input", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "y")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer("gpt2")


def test_corrupt_store_is_a_clear_error(tmp_path):
    prepare(_inputs(tmp_path), "byte", str(tmp_path / "out"))
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] += 5
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="re-prepare"):
        TokenStore(str(tmp_path / "out"), "train")
    with pytest.raises(DataError, match="not a prepared dataset"):
        store_windows(str(tmp_path), "train", 16)


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_pipeline_deterministic_and_independent_of_process_layout():
    tokens = np.arange(10_000, dtype=np.uint32) % 251
    w = array_windows(tokens, 32)
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


def test_iterator_state_resumes_same_batches():
    w = array_windows(np.arange(5_000, dtype=np.uint32) % 97, 16)
    it = iter(train_batches(w, global_batch=4, seed=0, num_steps=100))
    _take(it, 7)
    state = it.get_state()
    expected = _take(it, 5)
    it2 = iter(train_batches(w, global_batch=4, seed=0, num_steps=100))
    it2.set_state(state)
    np.testing.assert_array_equal(np.stack(_take(it2, 5)), np.stack(expected))


def test_interrupted_prepare_resumes_without_retokenizing_finished_inputs(tmp_path, monkeypatch):
    """An input that fails mid-run leaves the finished inputs' staging files; the rerun tokenizes
    only what was left and writes exactly the dataset an uninterrupted run writes."""
    import laplace_jax.data.prepare as prep

    inputs = _inputs(tmp_path)
    straight = prepare(inputs, "byte", str(tmp_path / "straight"), val_fraction=0.2, seed=1)
    real = prep._tokenize_file
    calls = []

    def failing(path, *a):
        calls.append(path)
        if path.endswith(".parquet"):
            raise KeyboardInterrupt  # the run dies while tokenizing the third input
        real(path, *a)

    monkeypatch.setattr(prep, "_tokenize_file", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, "byte", str(tmp_path / "out"), val_fraction=0.2, seed=1)
    assert sorted(p.name for p in (tmp_path / "out" / ".staging").iterdir()) == ["00000.npz", "00001.npz"]
    calls.clear()
    monkeypatch.setattr(prep, "_tokenize_file", lambda path, *a: (calls.append(path), real(path, *a)))
    resumed = prepare(inputs, "byte", str(tmp_path / "out"), val_fraction=0.2, seed=1)
    assert calls == [inputs[2]]  # only the unfinished input
    assert resumed["splits"] == straight["splits"]
    for split in ("train", "val"):
        a, b = TokenStore(str(tmp_path / "straight"), split), TokenStore(str(tmp_path / "out"), split)
        np.testing.assert_array_equal(a.read(0, len(a)), b.read(0, len(b)))
    assert not (tmp_path / "out" / ".staging").exists()
