"""The package's structure: imports point down the declared layers; functions and classes stay
short; every module says what it holds."""

import os

from helpers import ROOT

from laplace_jax.tools import layers


def test_the_package_has_no_upward_import_unplaced_module_long_function_or_class_or_bare_module():
    assert layers.check(ROOT) == []


def test_the_check_finds_each_kind_of_problem(tmp_path):
    pkg = tmp_path / "laplace_jax"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "serve").mkdir()
    (pkg / "serve" / "engine.py").write_text("X = 1\n")  # no module docstring
    body = "\n".join(f"    x{i} = {i}" for i in range(layers.MAX_FUNCTION_LINES))
    (pkg / "ops" / "kernel.py").write_text(
        '"""A kernel."""\n\n\n'
        "def helper():\n    from laplace_jax.serve.engine import X\n    return X\n\n\n"
        f"def long():\n{body}\n    return 0\n"
    )
    (pkg / "stray.py").write_text("from laplace_jax.ops import kernel\n")
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(layers.MAX_CLASS_LINES // 2))
    (pkg / "ops" / "big.py").write_text(f'"""\nA first line that is blank."""\n\n\nclass Big:\n{methods}')
    problems = layers.check(str(tmp_path))
    assert any("ops.kernel (kernels) imports serve.engine (serving)" in p for p in problems), problems
    assert any(f"long is {layers.MAX_FUNCTION_LINES + 2} lines" in p for p in problems), problems
    assert any("module 'stray' is in no layer" in p for p in problems), problems
    assert any("class Big is " in p and f"(at most {layers.MAX_CLASS_LINES})" in p for p in problems), problems
    bare = [p for p in problems if "no module docstring" in p]
    assert sorted(p.split(":")[0].rsplit("/", 1)[1] for p in bare) == ["big.py", "engine.py"], problems
    assert len(problems) == 6


def test_readme_is_short_and_every_doc_link_resolves():
    """README stays a front page (the long sections live in docs/), and a relative link in README,
    BENCHMARKS.md or docs/ names a file that exists."""
    import glob
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        assert len(f.read().splitlines()) <= 250
    docs = ["README.md", "BENCHMARKS.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]
    broken = []
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read()):
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
                if "://" not in target and not os.path.exists(path):
                    broken.append(f"{doc}: {target}")
    assert len(docs) >= 10 and broken == []
