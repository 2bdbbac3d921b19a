"""The compressor state's global layout: per-replica leaves over the data axes, their specs.

Outside the data-parallel shard_map every state leaf has a leading replica axis of size R sharded
over the data axes, `P(data_axes, *rest)`; inside, each replica sees its `[1, ...]` slice.
`init_global` builds that state, `state_partition_spec` gives its PartitionSpecs, and
`sharded_state` the same for a compressor running on each device's shard of the gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxdist.compression.replica as replica
from jaxdist import sharding
from jaxdist.compression.replica import AxisName


def init_global(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh, data_axes: AxisName
) -> Any:
    """The global sync state: `tx.init` per replica, leaves stacked to [R, ...] over `data_axes`.

    `params` must be replicated over the data axes. Traceable: call it inside the jitted init, or
    under `jax.eval_shape` for the shapes `state_partition_spec` takes.
    """
    axes = replica.axes(data_axes)
    init = jax.shard_map(
        tx.init, mesh=mesh, in_specs=P(), out_specs=P(replica.data_spec(axes)), axis_names=set(axes)
    )
    return init(params)


def _tree_like(x: Any, pdef: Any) -> bool:
    """A state subtree with the params' tree structure (its leaves may be None)."""
    if x is None or isinstance(x, jax.ShapeDtypeStruct | jax.Array):
        return False
    try:
        pdef.flatten_up_to(x)
    except (ValueError, TypeError):
        return False
    return True


def _params_like(x: Any, pdef: Any, shapes: Sequence[tuple[int, ...]]) -> bool:
    """A state subtree structured like the params, each leaf [1 or R, *shape] or None."""
    if not _tree_like(x, pdef):
        return False
    leaves = pdef.flatten_up_to(x)
    return all(
        leaf is None or (hasattr(leaf, "shape") and tuple(leaf.shape[1:]) == shape)
        for leaf, shape in zip(leaves, shapes, strict=True)
    )


def _shard_leaf_spec(leaf, shape, pspec, *, mesh: Mesh, lead) -> P | None:
    """The spec of one per-shard state leaf of a parameter of shard shape `shape`, spec `pspec`."""
    if leaf is None:
        return None
    if tuple(leaf.shape[1:]) == shape:
        return P(lead, *pspec)
    # The shards' own copies, side by side: over the axes this parameter is split on (state of
    # a parameter replicated over an axis is the same on all its shards, typed so).
    split = [a for a in mesh.axis_names if a in jax.tree.leaves(tuple(pspec))]
    if leaf.ndim < 2 or not split:
        return P(lead, *(None,) * (leaf.ndim - 1))
    return P(lead, split[0] if len(split) == 1 else tuple(split), *(None,) * (leaf.ndim - 2))


def sharded_state(
    tx: optax.GradientTransformation,
    params: Any,
    param_specs: Any,
    mesh: Mesh,
    data_axes: AxisName,
    shard_axes: Sequence[str],
) -> tuple[Any, Any]:
    """The sync state when the compressor runs on each device's shard of the gradients.

    Inside `jax.shard_map` manual over `data_axes` and `shard_axes` (the axes that shard the
    parameters: fsdp, tensor, pipeline), `tx` sees this device's shard of its replica's gradient
    and keeps state for that shard alone (see `collectives.sync_grads`).

    Args:
      tx: a compressor built with `axis_name=data_axes`.
      params: the parameters (arrays or `jax.ShapeDtypeStruct`s), global shapes.
      param_specs: their PartitionSpecs (a tree like params).
      mesh: the device mesh.
      data_axes, shard_axes: the manual axes.

    Returns:
      (init, specs): `init(params) -> state`, traceable (run it inside the jitted init), and the
      PartitionSpecs of that state. Parameter-shaped leaves (residuals, momenta) are
      `P(data, *param_spec)`: [R, *param shape], sharded like their parameters. Other per-parameter
      leaves (PowerSGD's Q, sign's server residual) put the shards' own copies side by side along
      their first axis after the replica axis, over the mesh axes that split that parameter.
      Counters and keys are `P(data, ...)`, the same on every shard.
    """
    axes = replica.axes(data_axes)
    manual = set(axes) | set(shard_axes)
    lead = replica.data_spec(axes)
    shards = tuple(a for a in mesh.axis_names if a in set(shard_axes))
    p_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), param_specs)
    pdef = jax.tree.structure(params)
    local_shapes = [
        tuple(jax.sharding.NamedSharding(mesh, sp).shard_shape(tuple(p.shape)))
        for p, sp in zip(pdef.flatten_up_to(params), pdef.flatten_up_to(p_specs), strict=True)
    ]
    # Each device's own [1, ...] state, side by side on the leading axis: shapes of one shard.
    probe = jax.shard_map(
        tx.init,
        mesh=mesh,
        in_specs=(p_specs,),
        out_specs=P((*axes, *shards)),
        axis_names=manual,
    )
    local = jax.eval_shape(probe, params)

    structured = functools.partial(_tree_like, pdef=pdef)
    leaf_spec = functools.partial(_shard_leaf_spec, mesh=mesh, lead=lead)

    def spec(x):
        if structured(x):
            leaves = pdef.flatten_up_to(x)
            specs = pdef.flatten_up_to(p_specs)
            return pdef.unflatten(list(map(leaf_spec, leaves, local_shapes, specs)))
        return P(lead, *(None,) * (x.ndim - 1))  # counters, keys: the same on every shard

    specs = jax.tree.map(spec, local, is_leaf=structured)
    init = jax.shard_map(
        tx.init, mesh=mesh, in_specs=(p_specs,), out_specs=specs, axis_names=manual
    )
    return init, specs


def state_partition_spec(
    state: Any,
    data_axes: AxisName,
    params: Any = None,
    param_specs: Any = None,
) -> Any:
    """PartitionSpecs for the global sync state: `P(data_axes, ...)` on every leaf.

    Args:
      state: the global state, arrays or `jax.ShapeDtypeStruct`s (`jax.eval_shape(init_global...)`).
      data_axes: the data-parallel mesh axes, sharding the leading replica axis.
      params, param_specs: optional; parameter-shaped subtrees of the state (residuals, where
        leaves may be None) then get `P(data_axes, *param_spec)`, sharded like their parameters on
        the fsdp/tensor axes. Other leaves (PowerSGD Q, sign server residuals, counters, keys) are
        replicated beyond the leading axis. (The train step's compressor works on each device's
        shard instead: see `sharded_state`.)
    """
    lead = replica.data_spec(data_axes)

    def replicated(x):
        return P(lead, *(None,) * (x.ndim - 1))

    if params is None or param_specs is None:
        return jax.tree.map(replicated, state)
    pdef = jax.tree.structure(params)
    pshapes = [tuple(p.shape) for p in pdef.flatten_up_to(params)]
    pspecs = pdef.flatten_up_to(param_specs)

    params_like = functools.partial(_params_like, pdef=pdef, shapes=pshapes)

    def spec(x):
        if not params_like(x):
            return replicated(x)
        out = []
        for leaf, pspec, shape in zip(pdef.flatten_up_to(x), pspecs, pshapes, strict=True):
            rest = tuple(pspec) + (None,) * (len(shape) - len(tuple(pspec)))
            out.append(None if leaf is None else P(lead, *rest))
        return pdef.unflatten(out)

    return jax.tree.map(spec, state, is_leaf=params_like)
