"""Explicit data-parallel steps: gradient sync through a compressor, and local SGD / DiLoCo.

Both wrap a per-replica `grad_fn(params, batch) -> (loss, grads)` in a `jax.shard_map` over the
data-parallel axes only (fsdp/tensor/pipeline stay automatic): the batch is split on dim 0 over
those axes and per-replica state carries a leading replica axis (see `jaxdist.compression`).
The synced gradients' loss runs under `sharding.per_replica_loss`, so batch statistics (the MoE
router's expert load) are the whole batch's and the mean gradient is the `plain` strategy's; local
SGD's does not (its replicas step apart: `strategies.check` refuses the load-balancing loss there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import sharding
from jaxdist.compression import replica
from jaxdist.compression.replica import AxisName, replica_local

GradFn = Callable[[Any, Any], tuple[jax.Array, Any]]
REPLICA_VMAP_AXIS = "replica"  # the per-replica vmap's axis name (`sharding.per_replica_loss`)


def _replica_vmap(fn: Callable, in_axes: tuple, mesh: Mesh, axes: tuple[str, ...]) -> Callable:
    """`fn` on each replica's slice: vmapped over a leading replica axis sharded over `axes`.

    The last argument is the batch, [B, ...] per leaf, cut into [R, B / R, ...] (replica j's rows
    are the j-th block, as on the mesh). Nothing is manual, so any mesh works; the model's sharding
    constraints leave `axes` out (`sharding.mapped_axes`), vmap puts them on the replica axis. The
    vmap's axis is named `REPLICA_VMAP_AXIS`, for a caller's `sharding.per_replica_loss`.
    """
    r = math.prod(mesh.shape[a] for a in axes)
    mapped = jax.vmap(fn, in_axes=(*in_axes, 0), axis_name=REPLICA_VMAP_AXIS, spmd_axis_name=axes)

    def run(*args):
        *rest, batch = args
        stacked = jax.tree.map(lambda x: x.reshape(r, -1, *x.shape[1:]), batch)
        with sharding.mapped_axes(axes):
            return mapped(*rest, stacked)

    return run


def sync_grads(
    grad_fn: GradFn,
    tx_sync: optax.GradientTransformation,
    mesh: Mesh,
    data_axes: AxisName,
    *,
    shard_axes: tuple[str, ...] = (),
    param_specs: Any = None,
    state_specs: Any = None,
    per_replica: str = "shard_map",
) -> Callable[[Any, Any, Any], tuple[jax.Array, Any, Any]]:
    """Per-replica gradients, reduced over `data_axes` by `tx_sync`.

    Args:
      grad_fn: `(params, local_batch) -> (loss, grads)` for one replica's slice of the batch.
      tx_sync: a compressor from `jaxdist.compression` built with `axis_name=data_axes`.
      mesh: the device mesh.
      data_axes: the data-parallel mesh axes (a name or tuple of names).
      shard_axes: the mesh axes that shard the parameters (fsdp, tensor, pipeline), if any. The
        compressor then runs in a second shard_map, manual over these too, on each device's shard
        of its replica's gradient (per-shard scales, top-k, low-rank factors): XLA's partitioner
        replicates the automatic axes around a collective in a partially manual region, so with
        them automatic every fsdp/tensor/pipeline shard would gather and send the whole gradient.
      param_specs, state_specs: with shard_axes, the PartitionSpecs of the parameters and of the
        sync state (`compression.sharded_state`).

    Returns:
      `step(params, batch, sync_state) -> (loss, grads, sync_state)`: params replicated over the
      data axes, every batch leaf split on dim 0 over them, sync_state the global state from
      `compression.init_global` ([R, ...] leaves) or, with shard_axes, `sharded_state`. loss and grads are means over replicas,
      replicated. Traceable: call it inside the jitted train step. grad_fn is differentiated with
      respect to `replica_local(params)`, so its gradients are local (no hidden f32 all-reduce).
    """
    axes = replica.axes(data_axes)
    lead = P(replica.data_spec(axes))

    if not shard_axes:

        def body(params, batch, state):
            with sharding.per_replica_loss(axes):
                loss, grads = grad_fn(replica_local(params, axes), batch)
            grads, state = tx_sync.update(grads, state, params)
            return jax.lax.pmean(loss, axes), grads, state

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), lead, lead),
            out_specs=(P(), P(), lead),
            axis_names=set(axes),
        )

    grads_of = replica_grads(grad_fn, mesh, axes, per_replica)
    reduce_of = sharded_reduce(tx_sync, mesh, axes, shard_axes, param_specs, state_specs)

    def step(params, batch, state):
        loss, grads = grads_of(params, batch)
        grads, state = reduce_of(grads, state)
        return loss, grads, state

    return step


def replica_grads(grad_fn: GradFn, mesh: Mesh, axes: tuple[str, ...], per_replica: str):
    """(params, batch) -> (mean loss, grads [R, ...]): every replica's own gradient, stacked.

    `grad_fn(params, local_batch) -> (loss, grads)` runs once per replica on its rows, in a
    shard_map manual over `axes` (`per_replica="shard_map"`) or vmapped over a leading replica
    axis (`"vmap"`); the gradients come back stacked `[R, ...]`, sharded over `axes`, for a
    reducer (`sharded_reduce`, `allreduce.reducer`) to reduce.
    """
    if per_replica == "vmap":
        stacked_grads = _replica_vmap(grad_fn, (None,), mesh, axes)

        def grads_of(params, batch):
            with sharding.per_replica_loss((REPLICA_VMAP_AXIS,)):
                losses, grads = stacked_grads(params, batch)
            return jnp.mean(losses), grads

        return grads_of

    def local_grads(params, batch):
        with sharding.per_replica_loss(axes):
            loss, grads = grad_fn(replica_local(params, axes), batch)
        return jax.lax.pmean(loss, axes), replica.stacked(grads)

    lead = P(replica.data_spec(axes))
    return jax.shard_map(
        local_grads, mesh=mesh, in_specs=(P(), lead), out_specs=(P(), lead), axis_names=set(axes)
    )


def sharded_reduce(tx_sync, mesh: Mesh, axes, shard_axes, param_specs, state_specs):
    """(grads [R, ...], state) -> (mean grads, state): `tx_sync` on each device's own shard.

    A shard_map manual over the data `axes` and the `shard_axes` that split the parameters
    (`param_specs`); the sync state has `state_specs` (`compression.sharded_state`). Every
    device hands the compressor its own `[1, ...]` block of its replica's gradient.
    """
    manual = set(axes) | set(shard_axes)
    g_specs = jax.tree.map(
        lambda sp: sharding.spec_only(P(replica.data_spec(axes), *sp), manual), param_specs
    )
    mean_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), param_specs)
    s_specs = jax.tree.map(lambda sp: sharding.spec_only(sp, manual), state_specs)

    def reduce(grads, state):
        return tx_sync.update(replica.local(grads), state)

    return jax.shard_map(
        reduce,
        mesh=mesh,
        in_specs=(g_specs, s_specs),
        out_specs=(mean_specs, s_specs),
        axis_names=manual,
    )


class LocalSGDState(NamedTuple):
    """Global view of local SGD: `params`, `outer_state` replicated, the rest [R, ...] over data."""

    step: jax.Array  # [] int32 inner steps taken
    params: Any  # the anchor (last synchronized) parameters, replicated
    outer_state: Any  # outer optimizer state, replicated
    local_params: Any  # [R, ...] each replica's parameters, P(data_axes, ...)
    inner_state: Any  # [R, ...] each replica's inner optimizer state, P(data_axes, ...)
    pending: Any = None  # streaming DiLoCo with overlap: outer gradients in flight (streaming.py)


class LocalSGD(NamedTuple):
    init: Callable[[Any], LocalSGDState]
    step: Callable[[LocalSGDState, Any], tuple[LocalSGDState, dict[str, jax.Array]]]


def diloco_outer(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer (Douillard et al., 2023): Nesterov SGD on the averaged delta."""
    return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


# The one registry of `grad_sync.outer_optimizer` names: name -> grad_sync config -> outer optimizer.
OUTER_OPTIMIZERS: dict[str, Callable[[Any], optax.GradientTransformation]] = {
    "average": lambda g: optax.sgd(1.0),  # plain averaging of the replicas' parameters
    "nesterov": lambda g: diloco_outer(g.outer_learning_rate, g.outer_momentum),  # DiLoCo
}


def local_sgd(
    grad_fn: GradFn,
    inner_tx: optax.GradientTransformation,
    mesh: Mesh,
    data_axes: AxisName,
    local_steps: int,
    outer_tx: optax.GradientTransformation | None = None,
    per_replica: str = "shard_map",
    sync_steps: int = 0,
) -> LocalSGD:
    """Local SGD: H = `local_steps` inner steps per replica without gradient sync, then a sync.

    Every step each replica applies `inner_tx` to its own gradient on its own copy of the
    parameters. After every H-th step the replicas' parameters are averaged: one f32 all-reduce of
    the parameters per H steps instead of one of the gradients per step. With `outer_tx` (e.g.
    `diloco_outer()`) the outer gradient `anchor - mean(local params)` goes through `outer_tx`,
    the anchor moves by its update, and every replica restarts from the new anchor (DiLoCo).
    `outer_tx=None` is plain averaging (the same as `optax.sgd(1.0)`). H = 1 with plain averaging
    and inner SGD is synchronous data-parallel SGD. The first `sync_steps` steps sync after every
    step (post-local SGD, Lin et al., 2020: the replicas drift most while the early gradients are
    large; `grad_sync.warmup_steps`).

    `per_replica` says how the replicas' steps run: "shard_map" (manual over `data_axes`, the
    other mesh axes automatic; what pipelined gradients need) or "vmap" (`jax.vmap` over the
    leading replica axis with `spmd_axis_name=data_axes`, nothing manual: any mesh, e.g.
    data x fsdp x tensor, where XLA's partitioner aborts on the partially manual form).

    Returns:
      `LocalSGD(init, step)`: `init(params) -> LocalSGDState` and
      `step(state, batch) -> (state, {"loss", "grad_norm"})`, both traceable; batch leaves split
      on dim 0. loss and grad_norm (of each replica's own gradient) are means over replicas.
    """
    if per_replica not in ("shard_map", "vmap"):
        raise ValueError(f"local_sgd: per_replica={per_replica!r} is not 'shard_map' or 'vmap'")
    if local_steps < 1:
        raise ValueError(f"local_sgd: local_steps={local_steps} must be >= 1")
    outer = optax.sgd(1.0) if outer_tx is None else outer_tx
    if sync_steps < 0:
        raise ValueError(f"local_sgd: sync_steps={sync_steps} must be >= 0")
    run = _local_sgd_vmap if per_replica == "vmap" else _local_sgd_shard_map
    due = lambda step: ((step + 1) % local_steps == 0) | (step < sync_steps)  # noqa: E731
    return run(grad_fn, inner_tx, outer, mesh, replica.axes(data_axes), due)


def _outer_step(outer: optax.GradientTransformation) -> Callable:
    """(anchor, outer_state, mean of the replicas' params) -> (new anchor, outer_state)."""

    def step(anchor, outer_state, mean):
        delta = jax.tree.map(lambda a, m: a - m, anchor, mean)  # the outer "gradient"
        upd, outer_state = outer.update(delta, outer_state, anchor)
        return optax.apply_updates(anchor, upd), outer_state

    return step


def keep(anchor, outer_state, local):
    """The no-sync branch of local SGD's `lax.cond`: (anchor, outer state, replicas) unchanged."""
    return anchor, outer_state, local


def _local_sgd_shard_map(grad_fn, inner_tx, outer, mesh, axes, due) -> LocalSGD:
    """Local SGD with each replica's step in a shard_map manual over `axes`."""
    lead = P(replica.data_spec(axes))
    outer_step = _outer_step(outer)

    def init(params):
        def one(p):
            return replica.stacked(p), replica.stacked(inner_tx.init(p))

        local, inner = jax.shard_map(
            one, mesh=mesh, in_specs=P(), out_specs=lead, axis_names=set(axes)
        )(params)
        return LocalSGDState(jnp.zeros((), jnp.int32), params, outer.init(params), local, inner)

    def body(step, anchor, outer_state, local, inner, batch):
        local, inner = replica.local(local), replica.local(inner)
        loss, grads = grad_fn(local, batch)
        grad_norm = optax.tree.norm(grads)
        updates, inner = inner_tx.update(grads, inner, local)
        local = optax.apply_updates(local, updates)

        def sync(anchor, outer_state, local):
            anchor, outer_state = outer_step(anchor, outer_state, jax.lax.pmean(local, axes))
            return anchor, outer_state, jax.tree.map(replica.varying_like, anchor, local)

        anchor, outer_state, local = jax.lax.cond(due(step), sync, keep, anchor, outer_state, local)
        metrics = {"loss": loss, "grad_norm": grad_norm}
        metrics = jax.lax.pmean(metrics, axes)
        return metrics, anchor, outer_state, replica.stacked(local), replica.stacked(inner)

    stepped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P(), lead, lead, lead),
        out_specs=(P(), P(), P(), lead, lead),
        axis_names=set(axes),
    )

    def step(state, batch):
        metrics, anchor, outer_state, local, inner = stepped(*state[:5], batch)
        return LocalSGDState(state.step + 1, anchor, outer_state, local, inner), metrics

    return LocalSGD(init, step)


def vmap_init(inner_tx: optax.GradientTransformation, outer, mesh: Mesh, axes) -> Callable:
    """params -> LocalSGDState at step 0: every replica's copy [R, ...] starts at `params`."""

    def init(params):
        r = math.prod(mesh.shape[a] for a in axes)
        local = jax.tree.map(lambda p: jnp.broadcast_to(p, (r, *p.shape)), params)
        inner = jax.vmap(inner_tx.init)(local)
        return LocalSGDState(jnp.zeros((), jnp.int32), params, outer.init(params), local, inner)

    return init


def vmap_inner_steps(grad_fn: GradFn, inner_tx, mesh: Mesh, axes) -> Callable:
    """(local [R, ...], inner [R, ...], batch) -> (local, inner, losses [R], grad norms [R]): one
    inner step of every replica on its own rows, vmapped (`spmd_axis_name=axes`)."""

    def inner_step(local, inner, rows):
        loss, grads = grad_fn(local, rows)
        updates, inner = inner_tx.update(grads, inner, local)
        return optax.apply_updates(local, updates), inner, loss, optax.tree.norm(grads)

    return _replica_vmap(inner_step, (0, 0), mesh, axes)


def _local_sgd_vmap(grad_fn, inner_tx, outer, mesh, axes, due) -> LocalSGD:
    """Local SGD with the replicas vmapped over a leading axis (`spmd_axis_name=axes`)."""
    outer_step = _outer_step(outer)
    replica_steps = vmap_inner_steps(grad_fn, inner_tx, mesh, axes)

    def sync(anchor, outer_state, local):
        mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), local)  # all-reduce over data
        anchor, outer_state = outer_step(anchor, outer_state, mean)
        restart = jax.tree.map(lambda a, x: jnp.broadcast_to(a, x.shape), anchor, local)
        return anchor, outer_state, restart

    def step(state, batch):
        local, inner, losses, norms = replica_steps(state.local_params, state.inner_state, batch)
        anchor, outer_state, local = jax.lax.cond(
            due(state.step), sync, keep, state.params, state.outer_state, local
        )
        metrics = {"loss": jnp.mean(losses), "grad_norm": jnp.mean(norms)}
        return LocalSGDState(state.step + 1, anchor, outer_state, local, inner), metrics

    return LocalSGD(vmap_init(inner_tx, outer, mesh, axes), step)
