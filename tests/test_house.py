"""The library reads in short functions: none in jaxdist/ or models/ runs over 80 lines.

Counted from the source (AST): a function's lines from its `def` to its last line, docstring and
nested functions included (a nested function counts on its own too). A longer one is split into
helpers that each do one job.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdist", "models")
MAX_LINES = 80


def function_lengths(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method in `path`, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_library_function_over_80_lines():
    long = [
        f"{f.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for pkg in PACKAGES
        for f in sorted((ROOT / pkg).rglob("*.py"))
        for name, line, n in function_lengths(f)
        if n > MAX_LINES
    ]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_function_lengths_counts_nested_functions(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    src = tmp_path / "m.py"
    src.write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    lengths = {name: n for name, _, n in function_lengths(src)}
    assert lengths == {"outer": 83, "inner": 81}
