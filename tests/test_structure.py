"""The package's structure: imports point down the declared layers; functions stay short."""

import os

from laplace_jax.tools import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_package_has_no_upward_import_unplaced_module_or_long_function():
    assert layers.check(ROOT) == []


def test_the_check_finds_each_kind_of_problem(tmp_path):
    pkg = tmp_path / "laplace_jax"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "serve").mkdir()
    (pkg / "serve" / "engine.py").write_text("X = 1\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(layers.MAX_FUNCTION_LINES))
    (pkg / "ops" / "kernel.py").write_text(
        "def helper():\n    from laplace_jax.serve.engine import X\n    return X\n\n\n"
        f"def long():\n{body}\n    return 0\n"
    )
    (pkg / "stray.py").write_text("from laplace_jax.ops import kernel\n")
    problems = layers.check(str(tmp_path))
    assert any("ops.kernel (kernels) imports serve.engine (serving)" in p for p in problems), problems
    assert any(f"long is {layers.MAX_FUNCTION_LINES + 2} lines" in p for p in problems), problems
    assert any("module 'stray' is in no layer" in p for p in problems), problems
    assert len(problems) == 3
