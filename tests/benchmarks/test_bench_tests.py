"""benchmarks.bench_tests reads pytest's JUnit report: counts and per-test seconds."""

from benchmarks.bench_tests import read_report

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.test_a" name="test_bad" time="0.25"><failure message="x">boom</failure></testcase>
<testcase classname="tests.test_b" name="test_skip" time="0.0"><skipped message="no gpu"/></testcase>
<testcase classname="tests.test_b" name="test_err" time="2.0"><error message="e">setup</error></testcase>
</testsuite></testsuites>"""


def test_read_report_counts_and_times(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(REPORT)
    r = read_report(str(path))
    assert r["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert [(c["name"], c["seconds"]) for c in r["cases"]][:2] == [
        ("tests.test_a::test_ok", 1.5),
        ("tests.test_a::test_bad", 0.25),
    ]
