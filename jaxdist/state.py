"""The train state: its typed layout, its storage shardings, and its abstract-first init.

The state is a plain dict, so checkpoints are standard orbax trees:
  {"step": int32[], "params": {...}, "opt_state": optax state, "rng": uint32[2], "skipped": int32[]}
plus one entry per piece of state a gradient strategy owns (`Entry`): "grad_sync" (the compressor's
residuals, jaxdist/compression.py) or "local" (local SGD's replicas, jaxdist/collectives.py).

`build_spec` gives the shapes and shardings of every leaf without materialising anything, and an
`init(key)` that `jax.jit(init, out_shardings=spec.shardings)` turns into parameters born sharded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxdist import sharding


class TrainState(TypedDict, total=False):
    """The train state; the last four keys exist only for the strategy that owns them."""

    step: jax.Array  # int32[] steps taken
    params: Any  # pure dict of the model's nnx.Param values
    opt_state: Any  # optax state of the optimizer (local SGD: of the outer optimizer)
    rng: jax.Array  # uint32[2] key data
    skipped: jax.Array  # int32[] steps dropped by train.on_nonfinite="skip"
    grad_sync: Any  # compressed gradient sync: per-replica residuals, [R, ...] over `data`
    local: Any  # local SGD: {"params", "opt_state"} of every replica, [R, ...] over `data`
    in_flight: Any  # grad_sync.staleness = tau: the last tau reduced gradients, [tau, ...]
    outer_pending: Any  # streaming DiLoCo (jaxdist/streaming.py): outer gradients still in flight


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """`abstract` (ShapeDtypeStructs or arrays) as ShapeDtypeStructs that carry `shardings`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One state entry a strategy adds: its abstract leaves (with shardings) and its init."""

    abstract: Any
    shardings: Any
    init: Callable[[Any], Any]  # params -> the entry's value; traced inside the jitted init

    @classmethod
    def from_specs(cls, abstract: Any, specs: Any, mesh: Mesh, init: Callable) -> Entry:
        shardings = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs)
        return cls(with_shardings(abstract, shardings), shardings, init)


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """Shapes, shardings and init of the whole state, built before anything is materialised."""

    abstract: dict[str, Any]  # TrainState of ShapeDtypeStructs carrying their shardings
    shardings: dict[str, Any]  # TrainState of NamedShardings (storage rules)
    init: Callable[..., TrainState]  # (key, params=None) -> state; jit with out_shardings


def opt_shardings(
    tx: optax.GradientTransformation, abstract_params: Any, param_shardings: Any, mesh: Mesh
) -> tuple[Any, Any]:
    """(abstract optimizer state, its shardings): each leaf sharded like its parameter."""
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # A partitioned optimizer (`jaxdist.muon.partition`: Muon's and AdamW's halves) keeps a scalar
    # where the other half's parameters are: replicated.
    shardings = optax.tree_map_params(
        tx,
        lambda leaf, s: s if leaf.ndim else sharding.replicated(mesh),
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: sharding.replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return abstract_opt, shardings


def build_spec(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    abstract_params: Any,
    param_shardings: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    entries: Mapping[str, Entry] | None = None,
) -> StateSpec:
    """The state of a model, the optimizer `tx` and the strategy's extra `entries`.

    Args:
      make_model: `rngs -> module`, the model family's constructor bound to its config.
      abstract_params: the parameters' ShapeDtypeStructs (pure dict).
      param_shardings: their storage NamedShardings (a tree like abstract_params).
      tx: the optimizer whose state is `opt_state`.
      mesh: the device mesh.
      entries: extra state entries by key ("grad_sync", "local").
    """
    repl = sharding.replicated(mesh)
    abstract_opt, opt_sh = opt_shardings(tx, abstract_params, param_shardings, mesh)
    shardings = {
        "step": repl,
        "params": param_shardings,
        "opt_state": opt_sh,
        "rng": repl,
        "skipped": repl,
    }
    abstract = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": abstract_params,
        "opt_state": abstract_opt,
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "skipped": jax.ShapeDtypeStruct((), jnp.int32),
    }
    abstract = with_shardings(abstract, shardings)
    entries = dict(entries or {})
    for key, e in entries.items():
        shardings[key], abstract[key] = e.shardings, e.abstract

    def init(key: jax.Array, params: Any = None) -> TrainState:
        if params is None:  # else given weights (`train.init_from`), on their shardings
            module = make_model(nnx.Rngs(key))
            params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
        state: TrainState = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)),
            "skipped": jnp.zeros((), jnp.int32),
        }
        for k, e in entries.items():
            state[k] = e.init(params)
        return state

    return StateSpec(abstract, shardings, init)
