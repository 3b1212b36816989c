"""Figures quoted in README.md, BENCHMARKS.md and docs/ equal their committed benchmark JSON."""

import shutil

from benchmarks.check_figures import DOCUMENTS, check


def test_every_quoted_figure_matches_its_json():
    assert check() == []


def test_a_changed_figure_is_caught(tmp_path):
    root = _copy_repo(tmp_path)
    text = (root / "BENCHMARKS.md").read_text()
    loss = next(x for x in text.split("**") if x.endswith(" nats/byte"))  # the first run's eval loss
    (root / "BENCHMARKS.md").write_text(text.replace(loss, "9.999 nats/byte"))
    bad = check(str(root))
    assert len(bad) == 1 and "first_run_tiny.json" in bad[0]


def _copy_repo(tmp_path):
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "docs").mkdir()
    shutil.copytree("benchmarks/results", root / "benchmarks" / "results")
    for doc in DOCUMENTS:
        shutil.copy(doc, root / doc)
    return root


def test_a_figure_moved_out_of_its_section_is_caught(tmp_path):
    """The first run's eval loss, moved from its section to the end of the document: the text is
    still there, but not where it is quoted, so the check fails."""
    root = _copy_repo(tmp_path)
    text = (root / "BENCHMARKS.md").read_text()
    line = next(x for x in text.splitlines() if "eval loss **" in x)
    (root / "BENCHMARKS.md").write_text(text.replace(line + "\n", "") + "\n" + line + "\n")
    bad = check(str(root))
    assert len(bad) == 1 and "first_run_tiny.json" in bad[0] and "is not under" in bad[0]


def test_every_claim_has_a_location():
    from benchmarks.check_figures import CLAIMS, LOCATIONS

    assert {(d, r) for d, r, _ in CLAIMS} == set(LOCATIONS)


def test_uncovered_lists_an_unbacked_figure_and_not_a_backed_one(tmp_path):
    from benchmarks.check_figures import uncovered

    root = _copy_repo(tmp_path)
    before = uncovered(str(root))
    text = (root / "BENCHMARKS.md").read_text()
    (root / "BENCHMARKS.md").write_text(text + "\n## New section\n\nA step took 12.34 s and used 5.67 GiB.\n")
    added = [f for f in uncovered(str(root)) if f not in before]
    assert added == [("BENCHMARKS.md", "## New section", "12.34 s"), ("BENCHMARKS.md", "## New section", "5.67 GiB")]
    assert not any(f[2] == "0.27 GiB" and "Decode step memory (3B" in f[1] for f in before)  # a claimed cell


def test_every_number_with_a_unit_is_checked_or_declared():
    """A figure added to README/BENCHMARKS must come with a claim (a committed JSON) or an
    entry in benchmarks/not_measured.py saying what it is (target, input, reference, ...)."""
    from benchmarks.check_figures import uncovered

    assert uncovered() == []


def test_not_measured_lists_only_numbers_that_are_there():
    from benchmarks.check_figures import uncovered
    from benchmarks.not_measured import NOT_MEASURED

    present = set(uncovered(exempt=False))
    kinds = {"target", "input", "reference", "derived", "history"}  # no "unstored": every current figure has a JSON
    for (doc, head), figures in NOT_MEASURED.items():
        for fig, kind in figures.items():
            assert kind in kinds, (doc, head, fig, kind)
            assert (doc, head, fig) in present, f"stale entry: {doc} {head}: {fig}"
