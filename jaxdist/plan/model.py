"""The model as the planner sees it: parameter and optimizer-state leaves (`eval_shape`) and its family's `PlanCost`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax

import models
from jaxdist import optim, sharding
from jaxdist.errors import ConfigError
from models.api import PlanCost, abstract_model


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: its path, global shape, logical axes, bytes per element, and whether it is
    part of the embedding."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int
    embed: bool = False  # part of the embedding (`Stages.split`), which stays outside the stages

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the cost model needs of a model config, read from `jax.eval_shape` (nothing allocated)
    and from its family's declared accounting (`models.api.PlanCost`).

    Attributes:
      family: the family's `model.name`.
      cost: the family's `PlanCost` for this config (sizes, one layer's activations, collectives).
      params: every parameter leaf, in tree order.
      opt: every optimizer-state leaf as (shape, itemsize, index of the parameter whose sharding it
        takes, or -1 for replicated leaves such as step counts), as `train.build` maps them.
      flops: model FLOPs per token, the family's `flops_per_token`.
      forward_prepass: the family's pipeline stages add a statistics term that is not linear
        (`models.api.Stages.aux_linear`): 1f1b and zb run the forward ticks once more a step.
    """

    family: str
    cost: PlanCost
    params: tuple[Leaf, ...]
    opt: tuple[tuple[tuple[int, ...], int, int], ...]
    flops: float
    forward_prepass: bool = False

    @property
    def num_layers(self) -> int:
        return self.cost.num_layers

    @property
    def d_model(self) -> int:
        return self.cost.width

    @property
    def seq_len(self) -> int:
        return self.cost.seq_len

    @property
    def vocab_size(self) -> int:
        return self.cost.vocab_size

    @property
    def idle_params(self) -> int:
        return self.cost.idle_params

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def embed_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.embed)

    def flops_per_token(self) -> float:
        """Model FLOPs per token as the layout record counts them (the family's count: for a
        decoder 6N' + 12·L·D·T, N' without the embedding table)."""
        return self.flops


def not_modelled(name: str) -> str | None:
    """None when the planner models `model.name`=`name`, else the one line that says it does not."""
    if models.get(name).plan_cost is None:
        return (
            f"model.name={name!r} is not modelled by the planner: its family declares no "
            "plan_cost (models/api.py PlanCost), so no memory or step-time prediction"
        )
    return None


# The last config's ModelInfo, by the content of what it reads: a training run asks twice (the
# memory refusal before building, the `layout` record's prediction after compiling), and each
# answer traces the model's and the optimizer's init. The family is kept with it, so its id in the
# key cannot be reused by another object.
_LAST: dict[tuple, tuple[Any, ModelInfo]] = {}


def model_info(config) -> ModelInfo:
    """Parameter and optimizer-state leaves of the configured model, exactly as `train.build` sees
    them, and its family's accounting.

    Raises:
      ConfigError: the family declares no `plan_cost` (`not_modelled`).
    """
    m = config.model
    family = models.get(m.name)
    if (why := not_modelled(m.name)) is not None:
        raise ConfigError(why)
    key = (
        id(family),
        m.to_json_best_effort(sort_keys=True),
        config.train.to_json_best_effort(sort_keys=True),
    )
    if (hit := _LAST.get(key)) is not None:
        return hit[1]
    info = _model_info(config, family)
    _LAST.clear()
    _LAST[key] = (family, info)
    return info


def _model_info(config, family) -> ModelInfo:
    m = config.model
    abstract = abstract_model(family.make(m, None))
    abstract_params, param_axes = abstract.params, abstract.axes
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    axes = jax.tree.leaves(param_axes, is_leaf=sharding.is_axes)
    index = jax.tree.unflatten(treedef, [np.int64(i) for i in range(len(flat))])
    # The embedding's leaves, as the family's pipeline stages split them (its lookup is no matmul
    # and it stays outside the stages); a family without stages has none.
    stages = family.stages(m) if family.stages is not None else None
    embed = {int(i) for i in jax.tree.leaves(stages.split(index)[0])} if stages else set()
    leaves = tuple(
        Leaf(
            "/".join(str(getattr(k, "key", k)) for k in path),
            tuple(int(d) for d in x.shape),
            ax,
            np.dtype(x.dtype).itemsize,
            i in embed,
        )
        for i, ((path, x), ax) in enumerate(zip(flat, axes, strict=True))
    )
    tx, _ = optim.build(config.train, param_axes)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    owner = optax.tree_map_params(
        tx,
        lambda _, i: i,
        abstract_opt,
        index,
        transform_non_params=lambda _: np.int64(-1),
        is_leaf=lambda x: isinstance(x, np.int64),
    )
    opt = tuple(
        (tuple(int(d) for d in x.shape), np.dtype(x.dtype).itemsize, int(i))
        for x, i in zip(jax.tree.leaves(abstract_opt), jax.tree.leaves(owner), strict=True)
    )
    flops = family.flops_per_token(m, abstract_params) if family.flops_per_token else 0.0
    return ModelInfo(
        family=m.name,
        cost=family.plan_cost(m, abstract_params),
        params=leaves,
        opt=opt,
        flops=flops,
        forward_prepass=bool(stages and stages.aux_zero is not None and not stages.aux_linear),
    )
