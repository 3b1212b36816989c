"""Check the package's structure: imports only point down the declared layers, no function is
longer than ``MAX_FUNCTION_LINES`` nor any class than ``MAX_CLASS_LINES``, and every non-empty
module opens with a docstring whose first line says what it holds. The entry scripts
(``train.py``, ``serve.py``), ``benchmarks/`` and ``tests/`` are held to the same sizes and
docstrings.

    python -m laplace_jax.tools.layers          # exit 1 and list every violation

``LAYERS`` is the order, bottom first. A module may import from its own layer and the layers
below it; every import is checked, including those inside functions. A module missing from the
table is itself a violation, so a new module must be placed in a layer.
"""

from __future__ import annotations

import ast
import os
import sys

PACKAGE = "laplace_jax"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250

# (layer name, the modules in it: a dotted prefix below ``laplace_jax`` matches a module or a package)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # ops.gla.limits: what each GLA kernel accepts, which the config asks (it imports nothing)
    (
        "base",
        (
            *("errors", "xla_flags", "config", "defaults", "platform", "profiling", "hlo_stats", "tpu", "parallel"),
            "ops.gla.limits",
        ),
    ),
    ("kernels", ("ops",)),
    ("layers", ("layers",)),
    ("models", ("models",)),
    ("tasks", ("tasks",)),
    ("data", ("data",)),
    (
        "model tools",
        ("checkpoint", "convert", "hf_files", "sharding", "sampling", "loss", "generate", "speculative", "loading"),
    ),
    ("optimizers", ("optim",)),
    ("training", ("train",)),
    ("serving", ("serve",)),
    ("evaluation", ("eval",)),
    ("entry points", ("info", "cli", "serve.cli", "tools", "__init__")),
)


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of a dotted module name below the package (longest prefix wins)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _modules(root: str) -> dict[str, str]:
    """Dotted module name (below the package) -> file path, for every .py file of the package."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.join(root, PACKAGE))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__") if rel != "__init__" else "__init__"] = path
    return out


def _imports(tree: ast.AST, modules: set[str]) -> list[tuple[int, str]]:
    """(line, dotted module below the package) of every import of the package in ``tree``; a name
    imported from the package itself is a module (``from laplace_jax import platform``) or else
    comes from its ``__init__``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            base = node.module[len(PACKAGE) + 1 :]
            for alias in node.names:
                found.append((node.lineno, base or (alias.name if alias.name in modules else "__init__")))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE and alias.name != PACKAGE:
                    found.append((node.lineno, alias.name[len(PACKAGE) + 1 :]))
    return found


def check(root: str) -> list[str]:
    """Every violation under ``root`` (the repository): upward imports, unplaced modules, long functions."""
    problems, modules = [], _modules(root)
    for module, path in sorted(modules.items()):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        mine = layer_of(module)
        if mine is None:
            problems.append(f"{path}: module {module!r} is in no layer of laplace_jax.tools.layers.LAYERS")
            continue
        for line, target in _imports(tree, set(modules)):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                problems.append(
                    f"{path}:{line}: {module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), a layer above"
                )
        problems += _sizes(path, tree) + _docstring(path, tree)
    for path in _scripts(root):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        problems += _sizes(path, tree) + _docstring(path, tree)
    return problems


def _scripts(root: str) -> list[str]:
    """The repository's Python outside the package: the entry scripts, benchmarks and tests."""
    found = [os.path.join(root, f) for f in ("train.py", "serve.py") if os.path.isfile(os.path.join(root, f))]
    for folder in ("benchmarks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            found += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(found)


def _sizes(path: str, tree: ast.AST) -> list[str]:
    """Functions over ``MAX_FUNCTION_LINES`` and classes over ``MAX_CLASS_LINES``."""
    out = []
    for node in ast.walk(tree):
        kind, limit = {
            ast.FunctionDef: ("", MAX_FUNCTION_LINES),
            ast.AsyncFunctionDef: ("", MAX_FUNCTION_LINES),
            ast.ClassDef: ("class ", MAX_CLASS_LINES),
        }.get(type(node), (None, 0))
        if kind is not None and (n := node.end_lineno - node.lineno + 1) > limit:
            out.append(f"{path}:{node.lineno}: {kind}{node.name} is {n} lines (at most {limit})")
    return out


def _docstring(path: str, tree: ast.Module) -> list[str]:
    """A module with code must open with a docstring whose first line is a sentence of its own."""
    if not tree.body:
        return []
    doc = ast.get_docstring(tree, clean=False)
    first = (doc or "").split("\n")[0].strip()
    if not first:
        return [f"{path}:1: no module docstring whose first line says what the module holds"]
    return []


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    problems = check(root)
    for p in problems:
        print(p)
    print(f"{len(problems)} structure problem(s) in {PACKAGE} ({len(LAYERS)} layers, bottom first)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
