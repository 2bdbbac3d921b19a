"""The config's rules, checked before anything compiles, and its front doors (files, flags, gin).

The schema itself (`base_config`, `MESH_AXES`, ...) is the leaf `jaxdist/schema.py`, re-exported
here. `validate(config, num_devices)` checks every cross-field constraint a user can hit (mesh
product, batch divisibility, head/width divisibility), reading each choice's names and rules from
the registry that owns it (models, optimizers, schedules, compressors, strategies), and raises
`ConfigError` with one line naming the field and what would be valid.
"""

from __future__ import annotations

import logging
import math
import os
import tokenize
from collections.abc import Mapping
from typing import Any

import ml_collections

import models
from jaxdist import allreduce, data, fp8, optim, pipeline, spikes, staleness, strategies
from jaxdist.errors import ConfigError
from jaxdist.schema import (  # the schema's names, re-exported: `config.base_config()` etc.
    COMPUTE_DTYPES,
    CONTEXT_ATTENTIONS,
    MESH_AXES,  # noqa: F401
    NONFINITE,
    base_config,
    locked,  # noqa: F401
    resolve_mesh_shape,
    to_json_dict,  # noqa: F401
)
from jaxdist.schema import need as _need
from models import api


def _field(config, path: str):
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def _choice(config, path: str, choices: tuple[str, ...]) -> None:
    value = _field(config, path)
    _need(value in choices, f"{path}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(config, path: str) -> None:
    value = _field(config, path)
    _need(isinstance(value, int) and value > 0, f"{path}={value!r} must be a positive integer")


def validate(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Checks every field a user can get wrong; returns the resolved mesh shape.

    The choices and rules of models (`models/`), remat policies (`models/api.py`), pipeline
    schedules (`jaxdist/pipeline/`), optimizers and learning-rate schedules (`jaxdist/optim.py`),
    compressors and the gradient strategies (`jaxdist/compression/`, `jaxdist/strategies.py`)
    are read from the modules that own them.

    Raises:
      ConfigError: one line naming the field and what would be valid.
    """
    models.get(config.model.name)
    optim.check(config)
    _choice(config, "train.compute_dtype", COMPUTE_DTYPES)
    _choice(config, "train.remat", api.remat_names())
    _choice(config, "train.on_nonfinite", NONFINITE)
    _choice(config, "train.on_spike", spikes.MODES)
    _need(config.train.spike_k > 0, "train.spike_k must be > 0 (standard deviations), e.g. 6")
    _need(config.train.spike_warmup >= 2, "train.spike_warmup must be >= 2 (losses seen first)")
    _need(
        0 <= config.train.spike_decay < 1,
        "train.spike_decay must be in [0, 1) (the past's weight in the running statistics)",
    )
    _need(
        config.train.on_spike != "rollback" or config.checkpoint.local_every > 0,
        "train.on_spike=rollback returns to the newest fast-tier step: set "
        "checkpoint.local_every > 0 (or use train.on_spike=skip)",
    )
    _choice(config, "model.norm", ("rmsnorm", "layernorm"))
    _choice(config, "model.attention", ("xla", "cudnn", "auto"))
    _check_matmul_precision(config)
    for path in (
        "train.steps",
        "train.batch_size",
        "train.grad_accum",
        "train.log_every",
        "train.max_skipped",
    ):
        _positive(config, path)
    _positive(config, "grad_sync.local_steps")
    lr = config.train.learning_rate
    _need(
        isinstance(lr, int | float) and math.isfinite(lr) and lr > 0,
        f"train.learning_rate={lr!r} must be a finite number > 0, e.g. 3e-3",
    )
    _need(config.train.warmup_steps >= 0, "train.warmup_steps must be >= 0")
    _need(config.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0 = off)")
    _need(config.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
    _need(
        config.checkpoint.local_every >= 0,
        "checkpoint.local_every must be >= 0 (steps between fast-tier saves; 0 = off)",
    )
    _need(config.runtime.cpu_devices >= 0, "runtime.cpu_devices must be >= 0 (0 = JAX default)")
    _need(
        0.0 <= config.runtime.gpu_memory_fraction <= 1.0,
        "runtime.gpu_memory_fraction must be in [0, 1] (0 = JAX's default of 0.75)",
    )

    mesh = resolve_mesh_shape(config.mesh, num_devices)
    models.check(config.model, mesh)
    replicas = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    per_step = replicas * config.train.grad_accum
    ep = "×mesh.expert" if mesh["expert"] > 1 else ""
    ep_n = f"×{mesh['expert']}" if mesh["expert"] > 1 else ""
    _need(
        config.train.batch_size % per_step == 0,
        f"train.batch_size={config.train.batch_size} must be divisible by "
        f"mesh.data×mesh.fsdp{ep}×train.grad_accum = {mesh['data']}×{mesh['fsdp']}{ep_n}×"
        f"{config.train.grad_accum} = {per_step}",
    )
    _check_context_expert(config, mesh)
    pipeline.check(config, mesh)
    strategies.check(config, mesh)
    allreduce.check(config, mesh)
    staleness.check(config, mesh)
    _check_sources(config.data)
    _check_packing(config, mesh)
    return mesh


def _check_packing(config, mesh: Mapping[str, int]) -> None:
    """`data.packing`: a known mode; `documents` needs a family that takes packed batches (and,
    through the pipeline, whose stages have a logits head for the masked loss)."""
    _choice(config, "data.packing", data.PACKINGS)
    if config.data.packing != "documents":
        return
    name = config.model.name
    _need(
        models.get(name).packing,
        f"data.packing='documents' needs a decoder that attends per document; model.name="
        f"{name!r} does not (use data.packing=windows)",
    )
    stages = models.get(name).stages
    _need(
        mesh["pipeline"] == 1 or (stages is not None and stages(config.model).head_logits),
        f"data.packing='documents' through the pipeline (mesh.pipeline={mesh['pipeline']}) "
        f"needs pipeline stages with a logits head; model.name={name!r} has none: set "
        "mesh.pipeline=1 or data.packing=windows",
    )


def _check_matmul_precision(config) -> None:
    """train.matmul_precision: a `jaxdist.fp8.MODES` name; FP8 only where there are transformer
    blocks to cast (the families with pipeline stages: their blocks call `fp8.einsum`)."""
    _choice(config, "train.matmul_precision", fp8.MODES)
    mode, name = config.train.matmul_precision, config.model.name
    if mode != "default" and models.get(name).stages is None:
        able = [n for n in models.names() if models.get(n).stages is not None]
        _need(
            False,
            f"train.matmul_precision={mode!r} casts transformer-block matmuls, but "
            f"model.name={name!r} has none ({', '.join(able)} do); set "
            "train.matmul_precision='default'",
        )


def _check_sources(d) -> None:
    """data.source, or the mixture data.sources / data.weights: paths that exist and read."""
    sources = tuple(d.sources) or (d.source,)
    for src in sources:
        if src not in ("stdlib", "digits"):
            name = f"data.sources entry {src!r}" if tuple(d.sources) else f"data.source={src!r}"
            _need(os.path.exists(src), f"{name}: no such file or directory")
            _need(os.access(src, os.R_OK), f"{name}: not readable")
    if tuple(d.sources):
        _need("digits" not in sources, "data.sources mixes token sources; 'digits' is images")
        weights = tuple(d.weights)
        _need(
            not weights or len(weights) == len(sources),
            f"data.weights has {len(weights)} entries for {len(sources)} data.sources; give one "
            "per source (or none: equal weights)",
        )
        _need(
            all(float(w) > 0 for w in weights),
            f"data.weights={list(weights)}: each must be > 0",
        )
    else:
        _need(not tuple(d.weights), "data.weights is set without data.sources; give both")


def _check_context_expert(config, mesh: Mapping[str, int]) -> None:
    """`mesh.context` / `mesh.expert` rules every model shares (the family checks its own)."""
    _choice(config, "model.context_attention", CONTEXT_ATTENTIONS)
    for axis in ("context", "expert"):
        if mesh[axis] > 1:
            able = [n for n in models.names() if axis in models.get(n).mesh_axes]
            _need(
                axis in models.get(config.model.name).mesh_axes,
                f"mesh.{axis}={mesh[axis]} needs a model that runs over it: model.name="
                f"{' or '.join(repr(n) for n in able)} (got {config.model.name!r})",
            )


def apply_gin(config: ml_collections.ConfigDict, files: list[str], params: list[str]) -> None:
    """Applies gin bindings (`train.steps = 10`) to the same fields as `--config.train.steps=10`.

    Each config section is a gin configurable of that name, so gin's own parser checks the syntax and
    this function checks that every bound field exists.
    """
    if not files and not params:
        return
    import gin

    gin.clear_config()
    sections = _gin_sections(tuple(config.keys()))
    for f in files:
        if not os.path.isfile(f):
            raise ConfigError(f"--gin_file={f!r}: no such file")
    logging.disable(logging.ERROR)  # gin logs a missing `include` before raising it
    try:
        gin.parse_config_files_and_bindings(files, params)
    except Exception as e:  # noqa: BLE001 — gin's parser raises many types for a user's file
        raise ConfigError(f"gin: {_gin_message(e)}") from None
    finally:
        logging.disable(logging.NOTSET)
    for name, fn in sections.items():
        for key, value in fn().items():
            if key not in config[name]:
                valid = ", ".join(sorted(config[name].keys()))
                raise ConfigError(f"gin: unknown field {name}.{key}; {name} has {valid}")
            if isinstance(config[name][key], tuple) and isinstance(value, list):
                value = tuple(value)
            problem = _type_problem(config[name][key], value, f"{name}.{key}")
            if problem:
                raise ConfigError(f"gin: {name}.{key} = {_shown(value)} {problem}")
            try:
                config[name][key] = value
            except (TypeError, ValueError, AttributeError) as e:
                raise ConfigError(f"gin: {name}.{key} = {_shown(value)}: {e}") from None


def _gin_message(error: Exception) -> str:
    """gin's error as one line: its first line, and where in which file (gin's own second line)."""
    text = str(error) if not isinstance(error, tokenize.TokenError) else error.args[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(error).__name__
    where = next((ln for ln in lines[1:] if ln.startswith("In ")), "")
    return f"{first} ({where})" if where else first


_GIN_SECTIONS: dict = {}
# Integers a run computes with as int32 (steps, sizes, seeds) are bounded by it; these may be more.
_INT64_FIELDS = ("data.max_bytes",)
_INT32_MAX = 2**31 - 1


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    return "a tuple or list"


def _type_problem(default: Any, value: Any, field: str = "") -> str:
    """Why `value` cannot stand where base_config() has `default`, or "" when it can."""
    if isinstance(default, ml_collections.ConfigDict):
        return "" if isinstance(value, dict | ml_collections.ConfigDict) else "must be a dict"
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        tuple: lambda v: isinstance(v, tuple | list),
    }[type(default)](value)
    if not ok:
        return f"must be {_kind(default)}"
    if isinstance(value, int) and not isinstance(value, bool) and field not in _INT64_FIELDS:
        if abs(value) > _INT32_MAX:
            return f"is out of range (at most {_INT32_MAX})"
    return ""


def _shown(value: Any) -> str:
    """A value for a one-line message: a huge integer by its first digits and its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        n = len(str(abs(value))) if value.bit_length() < 20_000 else value.bit_length() * 3 // 10
        return f"{str(value)[:9]}... ({n} digits)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_schema(config: Any, where: str) -> None:
    """Every field of base_config() is in `config` with a value of its type (an int where an int
    is, within int32; a number where a float is; a tuple or list where a tuple is).

    Raises:
      ConfigError: one line naming `where` (e.g. `--config=FILE`; "" for the `--config.a.b=v`
        overrides, which are then named as such), the field and its type.
    """
    at = f"{where}: " if where else "--config."
    _need(
        isinstance(config, ml_collections.ConfigDict),
        f"{where}: get_config() returned {type(config).__name__}, not an "
        "ml_collections.ConfigDict; start from jaxdist.config.base_config() (see configs/default.py)",
    )
    for section, fields in base_config().items():
        _need(
            section in config and isinstance(config[section], ml_collections.ConfigDict),
            f"{where}: the config has no section {section!r}; start from "
            "jaxdist.config.base_config() (see configs/default.py)",
        )
        for key, default in _leaves(fields):
            field = f"{section}.{key}"
            try:
                value = _field(config[section], key)
            except (KeyError, AttributeError, TypeError):
                raise ConfigError(
                    f"{where}: the config has no field {field}; start from "
                    "jaxdist.config.base_config() (see configs/default.py)"
                ) from None
            problem = _type_problem(default, value, field)
            _need(not problem, f"{at}{field}={_shown(value)} {problem}")


def _leaves(node: ml_collections.ConfigDict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Runs the experiment file's `get_config()` as ml_collections will, refusing in one line a
    file that fails to parse, raises, has no `get_config`, or returns something that is not a
    config of jaxdist's schema (`check_schema`)."""
    import importlib.util

    where = f"--config={path}"
    spec = importlib.util.spec_from_file_location("_jaxdist_checked_config", path)
    _need(spec is not None and spec.loader is not None, f"{where}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{where}: line {e.lineno}: {e.msg}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 — whatever the user's file raises
        raise ConfigError(f"{where} raised {_error_line(e)} while loading") from None
    get_config = getattr(module, "get_config", None)
    _need(
        callable(get_config),
        f"{where} has no get_config(); an experiment file defines get_config() returning "
        "jaxdist.config.base_config() with its changes (see configs/default.py)",
    )
    try:
        config = get_config()
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ConfigError(f"{where}: get_config() raised {_error_line(e)}") from None
    check_schema(config, where)
    return config


def _error_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (an `app.run` flags_parser), a bad value one ConfigError line instead
    of absl's two-line FATAL message; then the schema check of the overridden config."""
    from absl import flags

    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    if "config" in flags.FLAGS:
        check_schema(flags.FLAGS.config, "")  # the file passed; what is wrong is an override
    return rest


def _gin_sections(names: tuple[str, ...]) -> dict:
    """One gin configurable per config section, registered once per process."""
    import gin

    for name in names:
        if name not in _GIN_SECTIONS:

            def section(**kwargs):
                return kwargs

            section.__name__ = name
            _GIN_SECTIONS[name] = gin.external_configurable(section, name=name, module="jaxdist")
    return {n: _GIN_SECTIONS[n] for n in names}


def check_override_names(args: list[str]) -> None:
    """Checks `--config.section.key=value` flags name existing fields, before any parsing."""
    schema = base_config()
    for arg in args:
        dotted = arg[len("--config.") :].split("=", 1)[0]
        node, seen = schema, []
        for part in dotted.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                where = ".".join(seen) or "config"
                valid = (
                    ", ".join(sorted(node.keys()))
                    if isinstance(node, ml_collections.ConfigDict)
                    else "nothing"
                )
                raise ConfigError(f"{arg}: unknown field {dotted!r}; {where} has {valid}")
            node = node[part]
            seen.append(part)


def define_config_flag(
    argv: list[str], default: str, help_text: str = "Experiment config file."
) -> None:
    """Defines the `--config` flag (ml_collections) for a script, failing in one line on bad input.

    ml_collections loads the file and applies `--config.a.b=v` overrides while the flag is being
    defined; checking the path and the override names against the schema first turns a typo into
    a ConfigError instead of a KeyError traceback.
    """
    from ml_collections import config_flags

    path = default
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    if not os.path.isfile(path):
        raise ConfigError(
            f"--config={path}: no such config file (see configs/ for the experiments)"
        )
    given = [a for a in argv if a == "--config" or a.startswith("--config=")]
    _need(len(given) <= 1, f"--config is given {len(given)} times; give one experiment file")
    load_config_file(path)
    check_override_names([a for a in argv if a.startswith("--config.")])
    try:
        config_flags.DEFINE_config_file("config", default, help_text, lock_config=True)
    except (KeyError, AttributeError, TypeError, ValueError, OSError) as e:
        raise ConfigError(f"config: {str(e).strip().splitlines()[-1]}") from None
