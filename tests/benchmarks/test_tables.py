"""benchmarks.tables: every generated table in the docs equals its rendering from the committed
JSON, and a table edited by hand or a result re-measured without regenerating is caught."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import tables


def _check(cwd=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.tables", "--check"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)


def _copy(tmp_path):
    shutil.copytree("benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree("docs", tmp_path / "docs")
    for doc in ("README.md", "BENCHMARKS.md"):
        shutil.copy(doc, tmp_path / doc)
    return tmp_path


def test_docs_tables_equal_their_json():
    ok = _check()
    assert ok.returncode == 0, ok.stdout


def test_a_table_edited_by_hand_is_caught(tmp_path):
    root = _copy(tmp_path)
    text = (root / "docs" / "tpu.md").read_text()
    ratio = re.search(r"\| (\d+\.\d)x \|", text)  # the first estimate / limit cell
    assert ratio, "no generated ratio cell in docs/tpu.md"
    (root / "docs" / "tpu.md").write_text(text.replace(ratio.group(0), "| 1.0x |", 1))
    bad = _check(root)
    assert bad.returncode == 1 and bad.stdout.strip().splitlines() == [
        "docs/tpu.md: a generated table differs from its JSON (run python -m benchmarks.tables)"
    ]


def test_a_result_changed_without_regenerating_is_caught(tmp_path):
    """The GLA kernel's C=64 forward time re-measured: BENCHMARKS.md's table no longer matches."""
    root = _copy(tmp_path)
    path = root / "benchmarks" / "results" / "gla_cpu.json"
    r = json.loads(path.read_text())
    r["impls"]["chunk64"]["fwd_s"] *= 2
    path.write_text(json.dumps(r))
    bad = _check(root)
    assert bad.returncode == 1 and "BENCHMARKS.md" in bad.stdout and "README.md" not in bad.stdout


def test_benchmarks_md_regenerates_byte_identical_from_the_json(tmp_path):
    """Every table body of BENCHMARKS.md emptied, then regenerated: the committed file comes back byte for byte."""
    root = _copy(tmp_path)
    text = (root / "BENCHMARKS.md").read_text()
    emptied = tables.BLOCK.sub(lambda m: m.group(1) + m.group(4), text)
    assert emptied.count("<!-- table:") >= 20 and len(emptied) < 0.75 * len(text)
    (root / "BENCHMARKS.md").write_text(emptied)
    run = subprocess.run([sys.executable, "-m", "benchmarks.tables"], capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr
    assert (root / "BENCHMARKS.md").read_bytes() == Path("BENCHMARKS.md").read_bytes()


def test_every_result_is_rendered_and_every_table_is_placed():
    """No committed JSON without a table (evidence nobody reads), no table no doc shows."""
    rendered = {f for files, _ in tables.TABLES.values() for f in files}
    assert sorted(set(os.listdir(tables.RESULTS)) - rendered) == []
    placed = set()
    for doc in tables.DOCS:
        placed |= {m.group(2) for m in tables.BLOCK.finditer(Path(doc).read_text())}
    assert sorted(set(tables.TABLES) - placed) == []
