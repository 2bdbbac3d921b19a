"""Imports go one way: no cycles, models use only the sharding helpers, the library no model family.

The graph is read from the source (AST), every `import` / `from ... import` at any depth, module
level or inside a function, so a lazy import cannot hide a cycle. The model registry's on-first-use
imports (`models.BUILTIN`, by name) are added as the edges `models -> models.<family>` they are.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxdist", "models")
# What a model may import from the library (logical-axis helpers, and the one error type).
# jaxdist.fp8: the blocks' einsum at `train.matmul_precision`, the one compute helper beside sharding.
MODEL_MAY_IMPORT = {"jaxdist.sharding", "jaxdist.errors", "jaxdist.fp8"}
# What in models/ is not a model family: the registry and the protocol.
NOT_A_FAMILY = {"models", "models.api", "models.attention", "models.moe"}


def _modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, subpackages included (`jaxdist/pipeline/spec.py`)."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if f.stem == "__init__" else parts)] = f
    return out


def _ancestors(name: str) -> set[str]:
    """`a.b.c` -> {`a`, `a.b`}: the packages Python runs before the module."""
    parts = name.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts))}


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
    """module -> modules it imports; importing `a.b` from outside package `a` also runs `a`."""
    mods = _modules(root, packages)
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        direct = _targets(name, path, known)
        # Importing a.b.c runs the packages a and a.b first, unless the importer is inside them.
        parents = set().union(*map(_ancestors, direct)) - _ancestors(name) - {name}
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


# jaxdist/plan/'s modules: they sit in the planner's layer.
PLAN_MODULES = (
    "algorithms",
    "guard",
    "hardware",
    "layouts",
    "model",
    "plot",
    "predict",
    "search",
    "terms",
)

# The library's layers, top to bottom: a module imports only its own layer or lower ones (scripts sit
# above them all). Every jaxdist module is listed, so a new one has to pick its place.
LAYERS = (
    {"jaxdist.loop"},
    {"jaxdist.resume"},  # where a run starts: a checkpoint's tier, init_from's weights, or fresh
    # step / state; weights: what `train.init_from` and the HF tools read a model from
    {
        "jaxdist.train",
        "jaxdist.config",  # validate: reads every registry (models, optim, pipeline, strategies)
        "jaxdist.strategies",
        "jaxdist.state",
        "jaxdist.spikes",  # train.on_spike: the loss-spike detector, a state entry
        "jaxdist.step_guard",  # a non-finite or spiking step: stop, skip or roll back
        "jaxdist.layout_record",  # the compiled step's `layout` record
        "jaxdist.staleness",  # grad_sync.staleness: a state entry around a strategy's gradients
        "jaxdist.streaming",  # streaming DiLoCo: a local SGD step built on collectives
        "jaxdist.plan",  # the planner package, its modules beside it
        *(f"jaxdist.plan.{m}" for m in PLAN_MODULES),
        "jaxdist.weights",
        "jaxdist.lm_eval_adapter",  # lm-eval's LM over the forward, generate and weights
    },
    {  # pipeline, gradient sync, checkpoint and their helpers
        "jaxdist.pipeline",
        "jaxdist.microbatch",
        "jaxdist.collectives",
        "jaxdist.compression",
        "jaxdist.allreduce",
        "jaxdist.overlap",  # grad_sync.overlap: each layer reduced inside the backward
        "jaxdist.optim",
        "jaxdist.muon",  # train.optimizer=muon's transform, read by jaxdist.optim's spec
        "jaxdist.checkpoint",  # the package: its modules below
        "jaxdist.checkpoint.manager",
        "jaxdist.checkpoint.offline",
        "jaxdist.checkpoint.restore",
        "jaxdist.checkpoint.compat",
        "jaxdist.checkpoint.integrity",
        "jaxdist.checkpoint.layout",
        "jaxdist.checkpoint.trees",
        "jaxdist.checkpoint.processes",
        "jaxdist.checkpoint.write_errors",
        "jaxdist.checkpoint.fast",  # checkpoint.local_every: the fast tier
        "jaxdist.workdir_lock",  # one training run per --workdir
        "jaxdist.goodput",  # the run's wall time by cause
        "jaxdist.job_goodput",  # a launched job's attempts summed (read by scripts/launch.py)
        "jaxdist.console",  # the run's printed lines
        "jaxdist.preemption",  # SIGTERM / SIGINT to a checkpointed stop
        "jaxdist.network",  # the emulated cluster: its modules below
        "jaxdist.network.counters",
        "jaxdist.network.namespaces",
        "jaxdist.network.profiles",
        "jaxdist.network.wire",
        "jaxdist.orbax_reads",
        "jaxdist.data",
        "jaxdist.packing",  # data.packing=documents: rows of whole documents, numpy only
        "jaxdist.metrics",
        "jaxdist.hlo_cost",
        "jaxdist.flops",
        "jaxdist.distributed",
        "jaxdist.hf",  # Hugging Face config / tensor mapping
        "jaxdist.generate",
        "jaxdist.tokenizer",
        "jaxdist.token_shards",
    },
    {
        "jaxdist.sharding",
        "jaxdist.mesh",
        "jaxdist.schema",
        "jaxdist.config_files",  # files, flags and gin read against the schema, without JAX
        "jaxdist.recipes",
        "jaxdist.xla_flags",
        "jaxdist.fp8",  # train.matmul_precision: the blocks' FP8 einsum, read by the models
    },
    {"jaxdist.aligned_switch"},  # lax.switch with as many collective-permutes in every branch
    {"jaxdist", "jaxdist.errors", "jaxdist.compression_fields"},
)
# The config schema is a leaf anyone can import: no registry, no model, nothing that imports them.
SCHEMA_IMPORTS = {"jaxdist.errors", "jaxdist.compression_fields"}


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
    listed = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    library = {n for n in graph if n.startswith("jaxdist")}
    # A subpackage's modules sit in the subpackage's layer (`jaxdist.pipeline.spec`: pipeline's).
    home = {n: n if n in listed else max(_ancestors(n) - {"jaxdist"} & set(listed), default=None)
            for n in library}  # fmt: skip
    unplaced = {n for n, h in home.items() if h is None} | (set(listed) - library)
    assert not unplaced, f"place these in LAYERS: {sorted(unplaced)}"
    rank = {n: listed[h] for n, h in home.items()}
    up = {(a, b) for a in library for b in graph[a] & library if rank[b] < rank[a]}
    assert not up, sorted(up)
    schema = _module_level_targets(ROOT / "jaxdist" / "schema.py", set(graph)) - {"jaxdist"}
    assert schema <= SCHEMA_IMPORTS, sorted(schema - SCHEMA_IMPORTS)


def test_loop_does_not_import_the_planner():
    """The planner's memory refusal and prediction reach the loop as hooks `scripts/train.py` passes
    (`loop.run(checks=, layout_extras=)`): the loop itself does not depend on it."""
    graph = import_graph()
    planner = {n for n in graph if n == "jaxdist.plan" or n.startswith("jaxdist.plan.")}
    assert "jaxdist.plan" not in graph["jaxdist.loop"], sorted(graph["jaxdist.loop"])
    assert not planner & graph["jaxdist.loop"], sorted(graph["jaxdist.loop"])


# Packages whose private names (`_x`) no other module uses and which use no other module's:
# what they share is public and documented. (Every package should join; each refactor adds its.)
PRIVATE_CHECKED = ("jaxdist.pipeline",)


def _private_uses(name: str, path: pathlib.Path, known: set[str]) -> set[tuple[str, str]]:
    """(module, private name) pairs that `name` takes from another module of `known`:
    `from m import _x`, and `m._x` through a name an import bound to module `m`."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    private = lambda attr: attr.startswith("_") and not attr.startswith("__")
    bound: dict[str, str] = {}  # local name -> the module it is
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                if private(a.name) and base in known and base != name:
                    out.add((base, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = ".".join([bound[value.id], *reversed(chain)])
                if target in known and target != name:
                    out.add((target, node.attr))
    return out


def _all_sources(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """The library and model modules by name, and the scripts and tests by path."""
    out = dict(_modules(root))
    for folder in ("scripts", "tests"):
        out.update({str(f.relative_to(root)): f for f in sorted((root / folder).glob("*.py"))})
    return out


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_private_names_across_module_boundaries():
    known = set(_modules(ROOT))
    bad = sorted(
        (name, f"{target}.{attr}")
        for name, path in _all_sources().items()
        for target, attr in _private_uses(name, path, known)
        if _in(name, PRIVATE_CHECKED) or _in(target, PRIVATE_CHECKED)
    )
    assert not bad, bad


def test_private_name_checker_can_fail(tmp_path):
    (tmp_path / "lib" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "pkg" / "__init__.py").write_text("from lib.pkg import a as _a\n")
    (tmp_path / "lib" / "pkg" / "a.py").write_text("from lib.b import _helper\n_x = 1\n")
    (tmp_path / "lib" / "b.py").write_text("from lib import pkg\ny = pkg.a._x\n_helper = 2\n")
    known = set(_modules(tmp_path, ("lib",)))
    uses = lambda n: _private_uses(n, _modules(tmp_path, ("lib",))[n], known)
    assert uses("lib.pkg.a") == {("lib.b", "_helper")}
    assert uses("lib.b") == {("lib.pkg.a", "_x")}
    assert uses("lib.pkg") == set()  # its own submodule, imported under a private alias


def test_no_private_names_across_library_modules():
    """What library modules share is public and documented (e.g. jaxdist/compression/replica.py,
    jaxdist/hlo_cost.py's parser): no module of jaxdist/ or models/ uses another's `_x`."""
    mods = _modules(ROOT)
    known = set(mods)
    bad = sorted(
        (name, f"{target}.{attr}")
        for name, path in mods.items()
        for target, attr in _private_uses(name, path, known)
    )
    assert not bad, bad


def test_weights_has_no_function_local_project_imports():
    """`jaxdist/weights.py` imports the project at module level only (issue 29)."""
    tree = ast.parse((ROOT / "jaxdist" / "weights.py").read_text())
    top = set(map(id, tree.body))
    local = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        and id(n) not in top
        and any((getattr(n, "module", None) or a.name).split(".")[0] in PACKAGES for a in n.names)
    ]
    assert not local, local


def test_experiment_files_and_their_front_doors_import_no_jax():
    """A bad experiment file, flag or gin binding is refused before JAX, flax or orbax load:
    `jaxdist.config_files` and every file of configs/ import none of them."""
    code = (
        "import glob, sys\n"
        "from jaxdist.config_files import load_config_file\n"
        "for f in sorted(set(glob.glob('configs/*.py')) - {'configs/__init__.py'}):\n"
        "    load_config_file(f)\n"
        "heavy = ('jax', 'jaxlib', 'flax', 'orbax', 'optax')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
