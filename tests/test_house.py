"""The library reads in short functions and files that each do one job (issue 29).

No function in jaxdist/ or models/ runs over 80 lines: counted from the source (AST), a function's
lines from its `def` to its last line, docstring and nested functions included (a nested function
counts on its own too). A longer one is split into helpers that each do one job.

No module runs over 700 lines, but the three kinds issue 29 lets stay whole, each one job:
`jaxdist/hlo_cost.py` (the HLO text reader), `jaxdist/distributed.py` (the multi-process runtime)
and the model families' files. Each module opens with a docstring whose first line says its job.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdist", "models")
MAX_LINES = 80
MAX_MODULE_LINES = 700
ONE_JOB_WHOLE = ("jaxdist/hlo_cost.py", "jaxdist/distributed.py", "models/")  # may run longer


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


def library_modules() -> list[pathlib.Path]:
    return [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]


def long_modules(files: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[str]:
    """`path (lines)` of each file over MAX_MODULE_LINES that is not one of ONE_JOB_WHOLE."""
    out = []
    for f in files:
        rel, n = f.relative_to(root).as_posix(), len(f.read_text().splitlines())
        if n > MAX_MODULE_LINES and not rel.startswith(ONE_JOB_WHOLE):
            out.append(f"{rel} ({n} lines)")
    return out


def test_no_library_module_over_700_lines():
    long = long_modules(library_modules())
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split along a seam): {long}"


def test_long_modules_can_fail(tmp_path):
    (tmp_path / "jaxdist").mkdir()
    (tmp_path / "models").mkdir()
    for name in ("jaxdist/loop.py", "jaxdist/hlo_cost.py", "models/llama.py"):
        (tmp_path / name).write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "jaxdist/data.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    files = sorted(tmp_path.rglob("*.py"))
    assert long_modules(files, tmp_path) == [f"jaxdist/loop.py ({MAX_MODULE_LINES + 1} lines)"]


def test_every_library_module_opens_with_its_job():
    """The first line of each module is its docstring's, saying what the file holds."""
    silent = []
    for f in library_modules():
        tree = ast.parse(f.read_text(), str(f))
        doc = ast.get_docstring(tree)
        if not doc or not doc.splitlines()[0].strip() or tree.body[0].lineno != 1:
            silent.append(str(f.relative_to(ROOT)))
    assert not silent, f"modules that do not open with a docstring saying their job: {silent}"
