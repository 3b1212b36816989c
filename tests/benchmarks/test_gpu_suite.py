"""The prepared GPU command, dry-run on tiny shapes here: every item writes its JSON lines, none
fails (the GPU run itself needs a lent GPU)."""

import json

import pytest

from benchmarks.gpu_suite import main
from laplace_jax.platform import on_gpu


@pytest.mark.slow
def test_dry_run_writes_every_item(tmp_path):
    out = tmp_path / "suite.jsonl"
    assert main(["--dry-run", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert not [x for x in lines if "error" in x], [x["error"] for x in lines if "error" in x]
    kernels = {(x["kernel"], x["chunk"], x["pass"]) for x in lines if x["name"] == "chunk_gla"}
    assert len(kernels) == 8 and all(x["seconds"] > 0 for x in lines if x["name"] == "chunk_gla")
    assert [x["width"] for x in lines if x["name"] == "decode"] == [4]
    assert [x["config"] for x in lines if x["name"] == "train_step"] == ["tiny"]


@pytest.mark.skipif(on_gpu(), reason="the refusal is for machines without a GPU")
def test_refuses_a_full_run_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.jsonl")])
    assert "no GPU here" in capsys.readouterr().err
