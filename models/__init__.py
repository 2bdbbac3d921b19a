"""Model families by `model.name`: the one registry the config check, the engine and the planner read.

A family is a `models.api.ModelFamily`. The built-in ones live one per file in this package, each as
its module's `FAMILY`, imported on first use so `import models` stays light; `register` adds a
family from anywhere (a test's own model, a user's package). Adding a family to jaxdist = one file
here, its name in `BUILTIN`, and one config in `configs/`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from jaxdist.errors import ConfigError
from models.api import ModelFamily, Stages

# Modules of this package that define FAMILY.
BUILTIN = ("gpt", "llama", "mixtral", "mlp", "qwen3", "qwen3_moe", "resnet")
_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Makes `family` available as `model.name=family.name` (replacing one of the same name)."""
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes a family added with `register` (built-in ones come back on the next `get`)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every valid `model.name`."""
    return tuple(dict.fromkeys((*BUILTIN, *_REGISTRY)))


def get(name: str) -> ModelFamily:
    """The family registered as `name`; a one-line ConfigError naming the valid ones otherwise."""
    if name not in _REGISTRY and name in BUILTIN:
        _REGISTRY[name] = importlib.import_module(f"models.{name}").FAMILY
    if name not in _REGISTRY:
        raise ConfigError(f"model.name={name!r} is not valid; choose one of {', '.join(names())}")
    return _REGISTRY[name]


def for_hf(architectures: Any, where: str) -> ModelFamily:
    """The family that imports a Hugging Face config.json's `architectures`; a one-line
    ConfigError naming `where` and the supported ones otherwise."""
    supported = {}
    for name in names():
        fmt = get(name).hf
        for arch in fmt.architectures if fmt else ():
            supported[arch] = name
    found = (
        [a for a in architectures or [] if a in supported]
        if isinstance(architectures, list)
        else []
    )
    if not found:
        raise ConfigError(
            f"{where}: architectures={architectures!r} is not supported; jaxdist imports "
            + ", ".join(sorted(supported))
        )
    return get(supported[found[0]])


def stages_for(model_cfg: Any, pipeline: int) -> Stages | None:
    """The model's pipeline stages when `mesh.pipeline` = `pipeline` > 1, else None.

    Raises:
      ConfigError: `pipeline` > 1 and the family has no `Stages`.
    """
    if pipeline <= 1:
        return None
    family = get(model_cfg.name)
    if family.stages is None:
        able = [n for n in names() if get(n).stages is not None]
        raise ConfigError(
            f"mesh.pipeline={pipeline} needs a model with pipeline stages, but "
            f"model.name={model_cfg.name!r} has none (pipelined families: {', '.join(able)}); "
            "set mesh.pipeline=1"
        )
    return family.stages(model_cfg)


def check(model_cfg: Any, mesh_shape: Mapping[str, int]) -> None:
    """The model fields against the resolved mesh: the family's own rules, then pipelining."""
    get(model_cfg.name).check(model_cfg, mesh_shape)
    stages_for(model_cfg, int(mesh_shape.get("pipeline", 1)))
