"""benchmarks.tables: every generated table in the docs equals its rendering from the committed
JSON, and a table edited by hand or a result re-measured without regenerating is caught."""

import json
import re
import shutil
import subprocess
import sys


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
