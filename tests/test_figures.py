"""Figures quoted in README.md and BENCHMARKS.md equal their committed benchmark JSON."""

import shutil

from benchmarks.check_figures import CLAIMS, check


def test_every_quoted_figure_matches_its_json():
    assert check() == []


def test_a_changed_figure_is_caught(tmp_path):
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copytree("benchmarks/results", root / "benchmarks" / "results")
    for doc in {d for d, _, _ in CLAIMS}:
        shutil.copy(doc, root / doc)
    text = (root / "BENCHMARKS.md").read_text()
    (root / "BENCHMARKS.md").write_text(text.replace("1.04 GiB", "0.98 GiB"))
    bad = check(str(root))
    assert bad and all("decode_memory_3b_fp32.json" in b for b in bad)
