"""The model, abstractly: every parameter and optimizer-state leaf the planner costs, from `eval_shape`."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax

import models
from jaxdist import optim, sharding
from jaxdist.errors import ConfigError
from models.api import abstract_model


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: its path, global shape, logical axes and bytes per element."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the cost model needs of a GPT config, read from `jax.eval_shape` (nothing allocated).

    Attributes:
      params: every parameter leaf, in tree order.
      opt: every optimizer-state leaf as (shape, itemsize, index of the parameter whose sharding it
        takes, or -1 for replicated leaves such as step counts), as `train.build` maps them.
    """

    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    vocab_size: int
    seq_len: int
    params: tuple[Leaf, ...]
    opt: tuple[tuple[tuple[int, ...], int, int], ...]
    flops: float  # model FLOPs per token, the family's `flops_per_token`
    idle_params: int = 0  # MoE: expert weights a token does not pass through (1 − k/E of them)

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def embed_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.path == "embed")

    def flops_per_token(self) -> float:
        """Model FLOPs per token as the layout record counts them (6N' + 12·L·D·T, N' without the
        embedding table)."""
        return self.flops


def model_info(config) -> ModelInfo:
    """Parameter and optimizer-state leaves of the configured GPT, exactly as `train.build` sees them."""
    m = config.model
    if m.name not in ("gpt", "llama"):
        raise ConfigError(
            f"the planner models the GPT and Llama families; model.name={m.name!r} is not supported"
        )
    family = models.get(m.name)
    abstract = abstract_model(family.make(m, None))
    abstract_params, param_axes = abstract.params, abstract.axes
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    axes = jax.tree.leaves(param_axes, is_leaf=sharding.is_axes)
    leaves = tuple(
        Leaf(
            "/".join(str(getattr(k, "key", k)) for k in path),
            tuple(int(d) for d in x.shape),
            ax,
            np.dtype(x.dtype).itemsize,
        )
        for (path, x), ax in zip(flat, axes, strict=True)
    )
    tx, _ = optim.build(config.train, param_axes)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    index = jax.tree.unflatten(treedef, [np.int64(i) for i in range(len(leaves))])
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
    mlp, idle = m.mlp_dim or 4 * m.d_model, 0
    if m.get("num_experts", 0):  # a token's MLP activations: k experts' (+ the shared one's)
        k, experts = m.experts_per_token, m.num_experts
        expert_elems = sum(math.prod(x.shape) for x in leaves if "experts" in x.axes)
        idle = round(expert_elems * (1 - k / experts))
        mlp = mlp * (k + bool(m.moe_shared_expert))
    return ModelInfo(
        num_layers=m.num_layers,
        d_model=m.d_model,
        num_heads=m.num_heads,
        mlp_dim=mlp,
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        params=leaves,
        opt=opt,
        flops=family.flops_per_token(m, abstract_params),
        idle_params=idle,
    )
