"""The whole test suite as CI runs it, timed: counts, wall time and the slowest tests, as JSON.

    python -m benchmarks.bench_tests --out benchmarks/results/tests_cpu.json
    python -m benchmarks.bench_tests --pytest-args "-p randomly -p no:cacheprovider --randomly-seed 7" --out r.json

Runs ``python -m pytest -q`` (README's test command; extra arguments after it) in a child
process with a JUnit XML report, and reads the per-test times from that report.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from benchmarks.common import write_result


def read_report(path: str) -> dict:
    """Counts and per-test seconds from a JUnit XML report."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[tag]
        cases.append(
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "seconds": float(case.get("time", 0)),
                "outcome": outcome,
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "errors", "skipped")}
    return {"counts": counts, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pytest-args", default="", help="arguments appended to `python -m pytest -q`")
    ap.add_argument("--slowest", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}", *shlex.split(a.pytest_args)]
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        wall = time.perf_counter() - t0
        if not os.path.exists(report):  # pytest stopped before running anything (its usage error is above)
            print(f"pytest wrote no report (exit {rc}): check --pytest-args", file=sys.stderr)
            return rc or 1
        r = read_report(report)
    slow = sorted(r["cases"], key=lambda c: -c["seconds"])[: a.slowest]
    res = {
        "pytest_args": a.pytest_args,
        "returncode": rc,
        "wall_s": wall,
        **r["counts"],
        "slowest": [{"name": c["name"], "seconds": c["seconds"]} for c in slow],
        "failed_tests": [c["name"] for c in r["cases"] if c["outcome"] in ("failed", "errors")],
    }
    write_result(res, "bench_tests", argv, a.out)
    print(f"{res['passed']} passed, {res['failed']} failed, {res['errors']} errors in {wall:.0f} s")
    for c in res["slowest"]:
        print(f"  {c['seconds']:7.1f} s  {c['name']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
