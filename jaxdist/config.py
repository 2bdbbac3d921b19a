"""The config schema: one small grouped tree, and its validation before anything compiles.

Experiment files in `configs/` start from `base_config()` and override fields; the tree is locked so a
misspelt key fails at parse time. `validate(config, num_devices)` checks every cross-field constraint a
user can hit (mesh product, batch divisibility, head/width divisibility) and raises `ConfigError` with
one line naming the field and what would be valid.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tokenize
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxdist.compression_fields import COMPRESSION_FIELDS
from jaxdist.errors import ConfigError

# Slowest- to fastest-varying device index (jaxdist/mesh.py): `expert` and `context` sit between
# the batch axes and `tensor`, so their all-to-alls and ring hops stay on neighbouring devices.
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor", "pipeline")
# The axes every message names; `expert` and `context` are named only when used.
_CORE_AXES = ("data", "fsdp", "tensor", "pipeline")
CONTEXT_ATTENTIONS = ("ring", "all_gather")
COMPUTE_DTYPES = ("float32", "bfloat16")
NONFINITE = ("stop", "skip")


def base_config() -> ml_collections.ConfigDict:
    """Every field jaxdist reads, with its default. Experiments override a handful."""
    c = ml_collections.ConfigDict()

    c.mesh = ml_collections.ConfigDict()
    for axis in MESH_AXES:
        c.mesh[axis] = 1
        c.mesh[f"dcn_{axis}"] = 1
    c.mesh.data = -1

    c.model = ml_collections.ConfigDict()
    c.model.name = "gpt"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.mlp_dim = 0  # 0 = 4 * d_model
    c.model.vocab_size = 256
    c.model.seq_len = 64
    c.model.norm = "rmsnorm"  # or "layernorm"
    c.model.attention = "xla"  # "xla", "cudnn" (flash attention on NVIDIA GPUs) or "auto"
    c.model.scan_unroll = 1  # layers per scan iteration (num_layers: no loop, no stacked copies)
    c.model.embed_grad = "scatter"  # or "matmul": one-hot matmul, no atomics (fast on GPUs)
    # llama (models/llama.py): grouped-query attention, rotary embeddings, RMSNorm, tied head.
    c.model.num_kv_heads = 0  # 0 = num_heads (no grouping)
    c.model.head_dim = 0  # 0 = d_model // num_heads
    c.model.rope_theta = 10000.0
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # or "llama3" (Llama 3.1+ long-context frequencies)
    c.model.rope_scaling.factor = 8.0
    c.model.rope_scaling.low_freq_factor = 1.0
    c.model.rope_scaling.high_freq_factor = 4.0
    c.model.rope_scaling.original_max_len = 8192
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.eos_token_id = -1  # generation stops at this token; -1 = none
    # Context parallelism (models/attention.py): how attention reads K/V across `mesh.context`.
    c.model.context_attention = "ring"  # or "all_gather"
    # Mixture of experts in the Llama family (models/moe.py); 0 experts = a dense MLP.
    c.model.num_experts = 0
    c.model.experts_per_token = 2  # top-k
    c.model.moe_capacity_factor = 0.0  # 0 = dropless; else capacity = factor·tokens·k / experts
    c.model.moe_aux_loss_weight = 0.01  # load-balancing loss (Switch / GShard)
    c.model.moe_z_loss_weight = 0.001  # router z-loss (ST-MoE)
    c.model.moe_shared_expert = False  # one dense SwiGLU every token also goes through
    c.model.hidden_dims = (256, 256)  # mlp
    c.model.widths = (16, 32, 64)  # resnet stage widths
    c.model.num_classes = 10  # mlp / resnet

    c.runtime = ml_collections.ConfigDict()
    c.runtime.cpu_devices = 0
    c.runtime.gpu_xla_flags = False  # jaxdist.xla_flags.GPU_PERFORMANCE_FLAGS into XLA_FLAGS
    c.runtime.gpu_memory_fraction = 0.0  # XLA_PYTHON_CLIENT_MEM_FRACTION; 0 = JAX's default (0.75)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.batch_size = 16
    c.train.seed = 0
    c.train.log_every = 10
    c.train.eval_every = 0  # 0 = only at the end
    c.train.eval_batches = 4
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    c.train.schedule = "cosine"
    c.train.min_lr_ratio = 0.1
    c.train.optimizer = "adamw"
    c.train.weight_decay = 0.01
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.momentum = 0.9
    c.train.nesterov = False  # sgd: Nesterov momentum
    c.train.opt_state_dtype = "float32"  # or "bfloat16": the optimizer's moments (jaxdist/optim.py)
    # train.optimizer=muon's own fields (jaxdist/optim.py `Muon`, whose defaults these are).
    c.train.muon = ml_collections.ConfigDict()
    c.train.muon.momentum = 0.95
    c.train.muon.nesterov = True
    c.train.muon.ns_steps = 5
    c.train.muon.bias_correction = False  # True: optax.contrib.muon's convention
    c.train.muon.distribution = "gather"  # or "auto" (jaxdist/muon.py)
    c.train.grad_clip = 1.0  # 0 = no clipping
    c.train.grad_accum = 1
    c.train.compute_dtype = "float32"
    c.train.remat = "none"
    c.train.on_nonfinite = "stop"  # or "skip": drop a non-finite step's update and go on
    c.train.max_skipped = 10  # on_nonfinite=skip: stop after this many skipped updates in a row
    c.train.lr_scaling = "none"
    c.train.base_batch_size = 0  # 0 = batch_size: lr_scaling is relative to this
    c.train.init_from = ""  # start from these weights: an HF folder or a jaxdist run/checkpoint

    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.val_fraction = 0.1
    c.data.max_bytes = 16_000_000  # cap on the text corpus read into memory
    c.data.sources = ()  # a mixture of token sources (replaces data.source when given)
    c.data.weights = ()  # one per data.sources entry; default equal

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0
    c.checkpoint.keep = 3

    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.microbatches = 1
    c.pipeline.schedule = "gpipe"
    c.pipeline.virtual_stages = 1
    # Gather the FSDP-sharded stage weights once per step instead of at every tick (and reduce
    # their gradients once): more memory (a stage's whole weights), fewer collectives.
    c.pipeline.fsdp_gather_once = False

    c.grad_sync = ml_collections.ConfigDict()
    # The compressors' fields: defaults and meanings in jaxdist/compression_fields.py
    for name, f in COMPRESSION_FIELDS.items():
        c.grad_sync[name] = f.default
    c.grad_sync.local_steps = 1  # H > 1: local SGD, replicas average their parameters every H steps
    c.grad_sync.outer_optimizer = "average"  # local SGD's outer step: average | nesterov (DiLoCo)
    c.grad_sync.outer_learning_rate = 0.7  # nesterov: DiLoCo's outer learning rate and momentum
    c.grad_sync.outer_momentum = 0.9
    c.grad_sync.fragments = 1  # streaming DiLoCo (jaxdist/streaming.py): F fragments, staggered
    c.grad_sync.outer_overlap = 0  # streaming: a fragment's outer step lands this many steps later
    c.grad_sync.outer_quantization = "none"  # streaming: none | int8 | int4 outer gradients
    c.grad_sync.outer_mix = 0.5  # streaming, overlap > 0: replica's share in the arriving fragment
    c.grad_sync.algorithm = "xla"  # the data-parallel all-reduce (jaxdist/allreduce.py ALGORITHMS)
    c.grad_sync.staleness = 0  # tau: step t applies the reduced gradient of step t - tau
    c.grad_sync.compress_over = "all"  # "dcn": hierarchical compresses only across hosts

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ()  # steps to trace with jax.profiler, e.g. (10, 11)
    return c


def locked(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config.lock()
    return config


def _field(config, path: str):
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(config, path: str, choices: tuple[str, ...]) -> None:
    value = _field(config, path)
    _need(value in choices, f"{path}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(config, path: str) -> None:
    value = _field(config, path)
    _need(isinstance(value, int) and value > 0, f"{path}={value!r} must be a positive integer")


def resolve_mesh_shape(mesh_cfg: Mapping[str, Any], num_devices: int) -> dict[str, int]:
    """Sizes for every mesh axis, with the one `-1` axis (if any) taking the remaining devices."""
    # An axis a caller's dict leaves out (scripts building a mesh by hand) has size 1.
    sizes = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    _need(len(free) <= 1, f"mesh: only one axis may be -1, got {', '.join(free)}")
    for a, s in sizes.items():
        _need(s == -1 or s >= 1, f"mesh.{a}={s} must be >= 1 or -1 (= all remaining devices)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        _need(
            num_devices % fixed == 0,
            f"mesh: fixed axes multiply to {fixed}, which does not divide the {num_devices} "
            f"devices, so mesh.{free[0]}=-1 has no valid size",
        )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    named = [a for a in MESH_AXES if a in _CORE_AXES or sizes[a] != 1]
    _need(
        total == num_devices,
        f"mesh: {'×'.join(named)} = "
        + "×".join(str(sizes[a]) for a in named)
        + f" = {total} but there are {num_devices} devices; make the product {num_devices} "
        "or set one axis to -1",
    )
    for a in MESH_AXES:
        dcn = int(mesh_cfg.get(f"dcn_{a}", 1))
        _need(
            dcn >= 1 and sizes[a] % dcn == 0,
            f"mesh.dcn_{a}={dcn} must be >= 1 and divide mesh.{a}={sizes[a]}",
        )
    return sizes


def validate(config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Checks every field a user can get wrong; returns the resolved mesh shape.

    The choices and rules of models (`models/`), remat policies (`models/api.py`), pipeline
    schedules (`jaxdist/pipeline/`), optimizers and learning-rate schedules (`jaxdist/optim.py`),
    compressors and the gradient strategies (`jaxdist/compression/`, `jaxdist/strategies.py`)
    are read from the modules that own them.

    Raises:
      ConfigError: one line naming the field and what would be valid.
    """
    import models
    from jaxdist import allreduce, optim, pipeline, staleness, strategies
    from models import api

    models.get(config.model.name)
    optim.check(config)
    _choice(config, "train.compute_dtype", COMPUTE_DTYPES)
    _choice(config, "train.remat", api.remat_names())
    _choice(config, "train.on_nonfinite", NONFINITE)
    _choice(config, "model.norm", ("rmsnorm", "layernorm"))
    _choice(config, "model.attention", ("xla", "cudnn", "auto"))
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
    return mesh


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
            _need(
                config.model.name == "llama",
                f"mesh.{axis}={mesh[axis]} needs model.name='llama' (got {config.model.name!r})",
            )


def to_json_dict(config: ml_collections.ConfigDict) -> dict:
    """The resolved config as plain JSON types (tuples become lists)."""
    return json.loads(config.to_json())


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
