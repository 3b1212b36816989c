"""The embedded default corpus: text that ships with every CPython installation.

Documents: every ``pydoc_data.topics`` entry (the language reference topics) and the module,
class and function docstrings of the pure-Python standard library, parsed with ``ast`` (nothing
is imported or executed). Deterministic for a given Python version.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from pydoc_data.topics import topics


def embedded_documents(max_chars: int = 6_000_000) -> list[str]:
    """Documents in a fixed order, about ``max_chars`` characters in all."""

    docs = [topics[k].strip() for k in sorted(topics)]
    total = sum(map(len, docs))
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__")
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(files):
            if not name.endswith(".py") or total >= max_chars:
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in [tree, *ast.walk(tree)]:
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        docs.append(doc)
                        total += len(doc)
    return docs
