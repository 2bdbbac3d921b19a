"""The config's rules, checked before anything compiles.

The schema itself (`base_config`, `MESH_AXES`, ...) is the leaf `jaxdist/schema.py`, and the
front doors (files, flags, gin) are `jaxdist/config_files.py`; both are re-exported here.
`validate(config, num_devices)` checks every cross-field constraint a user can hit (mesh product,
batch divisibility, head/width divisibility), reading each choice's names and rules from the
registry that owns it (models, optimizers, schedules, compressors, strategies), and raises
`ConfigError` with one line naming the field and what would be valid.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import ml_collections

import models
from jaxdist import allreduce, data, fp8, optim, pipeline, spikes, staleness, strategies
from jaxdist.config_files import (  # the front doors, re-exported: `config.load_config_file()` etc.
    apply_gin,  # noqa: F401
    check_override_names,  # noqa: F401
    check_schema,  # noqa: F401
    define_config_flag,  # noqa: F401
    load_config_file,  # noqa: F401
    parse_flags,  # noqa: F401
    value_at,
)
from jaxdist.schema import (  # the schema's names, re-exported: `config.base_config()` etc.
    COMPUTE_DTYPES,
    CONTEXT_ATTENTIONS,
    MESH_AXES,  # noqa: F401
    NONFINITE,
    base_config,  # noqa: F401
    locked,  # noqa: F401
    resolve_mesh_shape,
    to_json_dict,  # noqa: F401
)
from jaxdist.schema import need as _need
from models import api


def _choice(config, path: str, choices: tuple[str, ...]) -> None:
    value = value_at(config, path)
    _need(value in choices, f"{path}={value!r} is not valid; choose one of {', '.join(choices)}")


def _positive(config, path: str) -> None:
    value = value_at(config, path)
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
