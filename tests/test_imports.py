"""Imports go one way: no cycles, models use only the sharding helpers, the library no model family.

The graph is read from the source (AST), every `import` / `from ... import` at any depth, module
level or inside a function, so a lazy import cannot hide a cycle. The model registry's on-first-use
imports (`models.BUILTIN`, by name) are added as the edges `models -> models.<family>` they are.
"""

from __future__ import annotations

import ast
import pathlib

import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdist", "models")
# What a model may import from the library (logical-axis helpers, and the one error type).
MODEL_MAY_IMPORT = {"jaxdist.sharding", "jaxdist.errors"}
# What in models/ is not a model family: the registry and the protocol.
NOT_A_FAMILY = {"models", "models.api", "models.attention", "models.moe"}


def _modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _targets(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Modules of `known` that `name` imports, anywhere in its source."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {t for t in out if t in known}


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> modules it imports; importing `a.b` from another package also runs `a`."""
    mods = _modules(root, packages)
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        direct = _targets(name, path, known)
        top = name.split(".")[0]
        parents = {t.split(".")[0] for t in direct if t.split(".")[0] != top}
        graph[name] = direct | (parents & known)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _graph_with_registry() -> dict[str, set[str]]:
    graph = import_graph()
    graph["models"] |= {f"models.{name}" for name in models.BUILTIN}
    return graph


def test_no_import_cycles():
    assert find_cycle(_graph_with_registry()) is None, " -> ".join(
        find_cycle(_graph_with_registry())
    )


def test_models_import_only_the_sharding_helpers():
    bad = {
        (name, t)
        for name, targets in import_graph().items()
        if name.startswith("models")
        for t in targets
        if t.startswith("jaxdist") and t not in MODEL_MAY_IMPORT | {"jaxdist"}
    }
    assert not bad, sorted(bad)


def test_library_imports_no_model_family():
    graph = import_graph()
    families = {n for n in graph if n.startswith("models") and n not in NOT_A_FAMILY}
    assert families >= {f"models.{n}" for n in models.BUILTIN}
    bad = {
        (name, t)
        for name, targets in graph.items()
        if name.startswith("jaxdist")
        for t in targets & families
    }
    assert not bad, sorted(bad)


def test_checker_sees_function_level_and_relative_imports(tmp_path):
    """The checks above can fail: a cycle closed by a function-level relative import is found, and
    a family imported inside a library function is an edge."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "fam").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "fam" / "__init__.py").write_text("")
    (tmp_path / "lib" / "a.py").write_text("from lib import b\n")
    (tmp_path / "lib" / "b.py").write_text("def f():\n    from . import a\n    import fam.gpt\n")
    (tmp_path / "fam" / "gpt.py").write_text("x = 1\n")
    graph = import_graph(tmp_path, ("lib", "fam"))
    assert graph["lib.b"] == {"lib.a", "fam.gpt", "fam"}
    assert find_cycle(graph) == ["lib.a", "lib.b", "lib.a"]


# The library's layers, top to bottom: a module imports only its own layer or lower ones (scripts sit
# above them all). Every jaxdist module is listed, so a new one has to pick its place.
LAYERS = (
    {"jaxdist.loop"},
    # step / state; weights: what `train.init_from` and the HF tools read a model from
    {
        "jaxdist.train",
        "jaxdist.strategies",
        "jaxdist.state",
        "jaxdist.staleness",  # grad_sync.staleness: a state entry around a strategy's gradients
        "jaxdist.streaming",  # streaming DiLoCo: a local SGD step built on collectives
        "jaxdist.plan",
        "jaxdist.weights",
    },
    {  # pipeline, gradient sync, checkpoint and their helpers
        "jaxdist.pipeline",
        "jaxdist.microbatch",
        "jaxdist.collectives",
        "jaxdist.compression",
        "jaxdist.allreduce",
        "jaxdist.optim",
        "jaxdist.muon",  # train.optimizer=muon's transform, read by jaxdist.optim's spec
        "jaxdist.checkpoint",
        "jaxdist.orbax_reads",
        "jaxdist.data",
        "jaxdist.metrics",
        "jaxdist.hlo_cost",
        "jaxdist.flops",
        "jaxdist.distributed",
        "jaxdist.hf",  # Hugging Face config / tensor mapping
        "jaxdist.generate",
        "jaxdist.tokenizer",
        "jaxdist.token_shards",
    },
    {"jaxdist.sharding", "jaxdist.mesh", "jaxdist.config", "jaxdist.xla_flags"},
    {"jaxdist.aligned_switch"},  # lax.switch with as many collective-permutes in every branch
    {"jaxdist", "jaxdist.errors"},
)
# config.validate reads each choice's names and rules from the module that owns them: imports
# inside that function, never at module level (so importing config stays at the bottom).
CONFIG_READS = {
    "jaxdist.optim",
    "jaxdist.pipeline",
    "jaxdist.strategies",
    "jaxdist.allreduce",
    "jaxdist.staleness",
}


def _module_level_targets(path: pathlib.Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.update({f"{node.module}.{a.name}" for a in node.names} | {node.module or ""})
    return out & known


def test_library_imports_go_down_the_layers():
    graph = import_graph()
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    library = {n for n in graph if n.startswith("jaxdist")}
    assert library == set(rank), f"place these in LAYERS: {sorted(library ^ set(rank))}"
    up = {
        (a, b)
        for a in library
        for b in graph[a] & library
        if rank[b] < rank[a] and not (a == "jaxdist.config" and b in CONFIG_READS)
    }
    assert not up, sorted(up)
    config_top = _module_level_targets(ROOT / "jaxdist" / "config.py", set(graph))
    assert not config_top & CONFIG_READS, sorted(config_top & CONFIG_READS)


def test_loop_does_not_import_the_planner():
    """The planner's memory refusal and prediction reach the loop as hooks `scripts/train.py` passes
    (`loop.run(checks=, layout_extras=)`): the loop itself does not depend on it."""
    graph = import_graph()
    assert "jaxdist.plan" not in graph["jaxdist.loop"], sorted(graph["jaxdist.loop"])
