"""Gradient strategies: how one train step turns a batch into proposed new state, one name each.

`STRATEGIES` is the one registry; `choose` picks the name a config runs on a mesh:

  plain        one `value_and_grad` of the loss; XLA reduces the gradients over `data`/`fsdp`.
  accumulated  the same, averaged over `train.grad_accum` microbatches (`microbatch.accumulated`).
  pipelined    the model's stages over `mesh.pipeline` (jaxdist/pipeline/), accumulated the same way.
  compressed   per-replica gradients (one of the three above) reduced over `data` by the compressor
               `grad_sync.compression` names (jaxdist/compression.py, collectives.sync_grads).
  allreduce    the same per-replica path, reduced exactly by `grad_sync.algorithm` (ring, tree,
               parameter server, ...: jaxdist/allreduce.py) instead of XLA's own all-reduce.
  overlapped   per-replica gradients whose reduction (by the algorithm, or bf16) overlaps compute
               (`grad_sync.overlap`, jaxdist/overlap.py): each layer's inside the backward, or
               each step's during the next step.
  local_sgd    `grad_sync.local_steps` inner steps per replica, then an outer step on the average
               (jaxdist/collectives.py, local SGD / DiLoCo; streaming DiLoCo: jaxdist/streaming.py).

The first six are gradient functions behind one signature, `GradFn`:
`(params, batch, extra) -> (loss, aux, grads, extra)`, where `extra` holds the state entries the
strategy owns; `from_gradients` adds the optimizer step (and `grad_sync.staleness`, the delay of
jaxdist/staleness.py). Local SGD runs its optimizer per replica
inside its own step, so it provides `step` directly. Every strategy's step returns a `Proposal`,
and `train.apply_update` (one non-finite guard, one set of metrics) turns it into the next state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist import (
    allreduce,
    collectives,
    compression,
    microbatch,
    overlap,
    pipeline,
    sharding,
    staleness,
    streaming,
)
from jaxdist.errors import ConfigError
from jaxdist.state import Entry, TrainState
from models.api import Stages

Batch = dict[str, jax.Array]
GradFn = Callable[[Any, Batch, dict], tuple[jax.Array, dict, Any, dict]]
DATA_AXES = ("data",)


class Proposal(NamedTuple):
    """What a strategy's step proposes; `train.apply_update` guards it and counts the step."""

    loss: jax.Array  # [] mean over the batch
    grad_norm: jax.Array  # [] global L2 norm of the gradient (local SGD: replicas' mean)
    aux: dict  # the model's extra metrics (e.g. accuracy), {} where not reduced
    new: dict  # new values of the state entries the step changes (params, opt_state, extras)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every strategy builder reads: the config, the mesh, the parameters and the loss."""

    config: Any
    mesh: Mesh
    param_axes: Any  # pure dict: path -> logical axes tuple
    abstract_params: Any  # ShapeDtypeStructs
    param_shardings: Any  # storage NamedShardings, a tree like the params
    batch_axes: dict[str, tuple]
    tx: optax.GradientTransformation  # the optimizer (local SGD: each replica's inner one)
    loss_fn: Callable[[Any, Batch], tuple[jax.Array, dict]]  # (params, batch) -> (loss, aux)
    stages: Stages | None  # the model's pipeline pieces when mesh.pipeline > 1

    @property
    def param_specs(self) -> Any:
        return jax.tree.map(lambda s: s.spec, self.param_shardings)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A built strategy: its step, the state it adds, and what the Engine reports about it."""

    name: str
    step: Callable[[TrainState, Batch], Proposal]
    entries: Mapping[str, Entry] = dataclasses.field(default_factory=dict)
    state_tx: optax.GradientTransformation | None = None  # optimizer of state["opt_state"]
    schedule: Any = None  # pipeline.Schedule of the pipelined gradients, else None


def from_gradients(
    name: str,
    gradients: GradFn,
    tx: optax.GradientTransformation,
    entries: Mapping[str, Entry] | None = None,
    schedule: Any = None,
    delay: staleness.Delay | None = None,
) -> Strategy:
    """A strategy whose step is `gradients` followed by one step of the optimizer `tx`; with
    `delay` (grad_sync.staleness > 0) the step applies the gradient of `delay.tau` steps ago."""
    entries = dict(entries or {})
    if delay is not None:
        gradients, tx = delay.wrap(gradients), delay.tx(tx)
        entries[staleness.KEY] = delay.entry

    def step(state: TrainState, batch: Batch) -> Proposal:
        params = state["params"]
        extra = {k: state[k] for k in entries}
        loss, aux, grads, extra = gradients(params, batch, extra)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, **extra}
        return Proposal(loss, optax.tree.norm(grads), aux, new)

    return Strategy(name, step, entries, tx, schedule)


def optimizer_config(config, mesh_shape: Mapping[str, int]):
    """The `train` fields the optimizer is built from.

    With `grad_sync.momentum_correction` (DGC / 1-bit momentum SGD) the SGD momentum is applied per
    replica inside the compressor and each replica clips its own gradient before it; the optimizer
    then runs without momentum or clipping of its own. With `onebit_adam` AdamW's moments move into
    the compressor and `compression.frozen_variance_adam`; what is left is weight decay and the
    learning rate (momentum-free SGD with the same decay mask and schedule).
    """
    onebit = compression.preconditioner(config.grad_sync) is not None
    if not ((config.grad_sync.momentum_correction or onebit) and mesh_shape["data"] > 1):
        return config.train
    train = config.train.copy_and_resolve_references()
    train.momentum, train.grad_clip = 0.0, 0.0
    if onebit:  # Adam's moments live in the compressor and its preconditioner: AdamW's rest
        train.optimizer = "sgd"  # = weight decay + learning rate (see compressed)
    return train


# --------------------------------------------------------------------------------------------------
# Gradients of one replica's batch: plain, accumulated, pipelined.


def _accumulated_gradients(setup: Setup) -> microbatch.GradFn:
    """(params, batch) -> (loss, aux, grads), averaged over train.grad_accum microbatches."""
    grad_fn = jax.value_and_grad(setup.loss_fn, has_aux=True)

    def gradients(params, batch):
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, grads

    shardings = setup.param_shardings
    return microbatch.accumulated(  # the identity for grad_accum = 1
        gradients,
        setup.config.train.grad_accum,
        setup.batch_axes,
        setup.mesh,
        constrain=lambda tree: jax.tree.map(sharding.constrain_to, tree, shardings),
    )


def _replica_gradients(setup: Setup, *, data_manual: bool) -> tuple[microbatch.GradFn, Any]:
    """(gradients, schedule): the pipelined gradients with stages, else the accumulated ones.

    `data_manual`: called per replica inside a shard_map or vmap over `data` (compressed, local SGD).
    """
    if setup.stages is None:
        return _accumulated_gradients(setup), None
    c = setup.config
    return pipeline.make_gradients(
        c, setup.mesh, setup.stages, setup.param_axes, setup.batch_axes, data_manual=data_manual
    )


def _delay(setup: Setup) -> staleness.Delay | None:
    tau = setup.config.grad_sync.staleness
    return staleness.build(tau, setup.abstract_params, setup.param_shardings, setup.mesh)


def _stateless(gradients: microbatch.GradFn) -> GradFn:
    return lambda params, batch, extra: (*gradients(params, batch), extra)


def plain(setup: Setup) -> Strategy:
    return from_gradients(
        "plain", _stateless(_accumulated_gradients(setup)), setup.tx, delay=_delay(setup)
    )


def accumulated(setup: Setup) -> Strategy:
    return from_gradients(
        "accumulated", _stateless(_accumulated_gradients(setup)), setup.tx, delay=_delay(setup)
    )


def pipelined(setup: Setup) -> Strategy:
    gradients, schedule = _replica_gradients(setup, data_manual=False)
    return from_gradients(
        "pipelined", _stateless(gradients), setup.tx, schedule=schedule, delay=_delay(setup)
    )


# --------------------------------------------------------------------------------------------------
# Explicit data-parallel steps: compressed gradient sync, local SGD.


def _shard_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes inside one data replica (size > 1): fsdp, expert, context, tensor, pipeline.

    A replica's gradient is complete on each of its devices' shards: summed exactly over the
    axes that split its batch (fsdp, expert, context: XLA's f32 reduction inside the replica);
    the compressor or algorithm then reduces over `data` on each device's own shard.
    """
    return tuple(
        a for a in ("fsdp", "expert", "context", "tensor", "pipeline") if mesh.shape[a] > 1
    )


def _per_replica(mesh: Mesh) -> str:
    """How replicas run: pipelined gradients need the shard_map (see collectives.sync_grads)."""
    return "shard_map" if mesh.shape["pipeline"] > 1 else "vmap"


def compressed(setup: Setup) -> Strategy:
    """Per-replica gradients inside a shard_map over `data`, reduced by the configured compressor.

    fsdp/tensor stay automatic; every device compresses its own shard of its replica's gradient
    (manual over the axes that shard the parameters too, see collectives.sync_grads).
    """
    c, mesh = setup.config, setup.mesh
    base, schedule = _replica_gradients(setup, data_manual=True)
    # Leading stacked-layer (and expert) axes per parameter: compressors treat each layer's (each
    # expert's) weight as its own tensor, so expert shards compress as one device would.
    batch_dims = jax.tree.map(
        lambda axes: next(
            (i for i, a in enumerate(axes) if a not in ("layers", "experts")), len(axes)
        ),
        setup.param_axes,
        is_leaf=sharding.is_axes,
    )
    betas = (c.train.b1, c.train.b2)
    tx_sync = compression.from_config(
        c.grad_sync, DATA_AXES, momentum=c.train.momentum, batch_dims=batch_dims, betas=betas
    )
    precondition = compression.preconditioner(c.grad_sync, betas)
    tx = setup.tx if precondition is None else optax.chain(precondition, setup.tx)
    # Clipping moves before the sync with the optimizer's momentum (optimizer_config). A replica's
    # gradient over B/R examples has ~sqrt(R) times the noise of the mean: its threshold is scaled
    # by sqrt(R) (DGC's local clipping, the threshold rescaled for a mean instead of a sum).
    local_clip = c.grad_sync.momentum_correction or precondition is not None
    clip = c.train.grad_clip * mesh.shape["data"] ** 0.5 if local_clip else 0.0

    def local_grads(params, local_batch):
        loss, _, grads = base(params, local_batch)  # aux metrics: not reduced here
        if clip > 0:
            grads, _ = optax.clip_by_global_norm(clip).update(grads, None)
        return loss, grads

    shard_axes = _shard_axes(mesh)
    specs = setup.param_specs
    sync_init, sync_specs = compression.sharded_state(
        tx_sync, setup.abstract_params, specs, mesh, DATA_AXES, shard_axes
    )
    entry = Entry.from_specs(
        jax.eval_shape(sync_init, setup.abstract_params), sync_specs, mesh, sync_init
    )
    sync = collectives.sync_grads(
        local_grads,
        tx_sync,
        mesh,
        DATA_AXES,
        shard_axes=shard_axes,
        param_specs=specs,
        state_specs=sync_specs,
        per_replica=_per_replica(mesh),
    )

    def gradients(params, batch, extra):
        loss, grads, sync_state = sync(params, batch, extra["grad_sync"])
        aux = {"grad_sync_residual_norm": compression.residual_norm(sync_state)}
        return loss, aux, grads, {"grad_sync": sync_state}

    return from_gradients(
        "compressed", gradients, tx, {"grad_sync": entry}, schedule, delay=_delay(setup)
    )


def reduced(setup: Setup) -> Strategy:
    """Per-replica gradients (as `compressed`), summed exactly by `grad_sync.algorithm`
    (jaxdist/allreduce.py) on each device's own shard of its replica's gradient."""
    c, mesh = setup.config, setup.mesh
    base, schedule = _replica_gradients(setup, data_manual=True)

    def local_grads(params, local_batch):
        loss, _, grads = base(params, local_batch)  # aux metrics: not reduced here
        return loss, grads

    grads_of = collectives.replica_grads(local_grads, mesh, DATA_AXES, _per_replica(mesh))
    if allreduce.per_hop(c.grad_sync):  # compressed per hop (allreduce.check)
        return _per_hop(setup, grads_of, schedule)
    shard_axes = _shard_axes(mesh)
    mean_of = allreduce.reducer(
        mesh, "data", shard_axes, setup.param_specs, c.grad_sync.algorithm, int(c.mesh.dcn_data)
    )

    def gradients(params, batch, extra):
        loss, grads = grads_of(params, batch)
        return loss, {}, mean_of(grads), extra

    return from_gradients("allreduce", gradients, setup.tx, schedule=schedule, delay=_delay(setup))


def overlapped(setup: Setup) -> Strategy:
    """Per-replica gradients whose reduction overlaps compute (`grad_sync.overlap`,
    jaxdist/overlap.py): `backward`, each layer's inside the backward, as DDP's buckets; or
    `next_step`, each step's during the next step's forward and backward (staleness 1)."""
    c, mesh = setup.config, setup.mesh
    reduce = overlap.bucket_reducer(c.grad_sync, "data", int(c.mesh.dcn_data))
    if c.grad_sync.overlap == "backward":
        grads_of = overlap.overlapped_grads(setup.loss_fn, setup.param_axes, reduce, mesh)

        def gradients(params, batch, extra):
            loss, grads = grads_of(params, batch)
            return loss, {}, grads, extra

        return from_gradients("overlapped", gradients, setup.tx)
    step = overlap.local_grads(setup.loss_fn, reduce, mesh, "data")
    r = mesh.shape["data"]
    abstract = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct((r, *p.shape), jnp.float32), setup.abstract_params
    )
    specs = jax.tree.map(lambda s: P("data", *s.spec), setup.param_shardings)

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros((r, *p.shape), jnp.float32), params)

    entry = Entry.from_specs(abstract, specs, mesh, init)

    def next_step(params, batch, extra):
        loss, reduced, held = step(params, batch, extra[overlap.KEY])
        return loss, {}, reduced, {overlap.KEY: held}

    # the first step has no earlier gradient: the optimizer is held, as with staleness 1
    tx = staleness.hold_while_filling(setup.tx, 1)
    return from_gradients("overlapped", next_step, tx, {overlap.KEY: entry})


def _per_hop(setup: Setup, grads_of, schedule) -> Strategy:
    """bf16 / int8 / topk at every ring hop (`ring`) or across hosts only (`hierarchical`,
    compress_over=dcn), each device on its own shard (fsdp / tensor) as `reduced`;
    state["grad_sync"]: each device's residual [R * D, E] (D devices per replica)."""
    mesh, r, g = setup.mesh, setup.mesh.shape["data"], setup.config.grad_sync
    shard_axes = _shard_axes(mesh)
    manual = ("data", *shard_axes)
    # One device's shard of its replica's gradient: what it reduces, and its residual's size.
    size = sum(
        math.prod(sh.shard_shape(p.shape))
        for p, sh in zip(
            jax.tree.leaves(setup.abstract_params),
            jax.tree.leaves(setup.param_shardings),
            strict=True,
        )
    )
    hosts = int(setup.config.mesh.dcn_data) if g.compress_over == "dcn" else 1
    wire = compression.spec_of(g).per_hop(g)
    e = allreduce.per_hop_size(size, r, hosts, wire)
    rows = math.prod(mesh.shape[a] for a in manual)  # a residual row per device
    abstract = jax.ShapeDtypeStruct((rows, e), jnp.float32)
    entry = Entry.from_specs(
        abstract, P(manual), mesh, lambda params: jnp.zeros((rows, e), jnp.float32)
    )
    reduce = allreduce.per_hop_reducer(mesh, "data", shard_axes, setup.param_specs, hosts, wire)

    def gradients(params, batch, extra):
        loss, grads = grads_of(params, batch)
        mean, err = reduce(grads, extra["grad_sync"])
        return loss, {}, mean, {"grad_sync": err}

    return from_gradients(
        "allreduce", gradients, setup.tx, {"grad_sync": entry}, schedule, delay=_delay(setup)
    )


def local_sgd(setup: Setup) -> Strategy:
    """Local SGD / DiLoCo: `setup.tx` is each replica's inner optimizer.

    state["opt_state"] holds the outer optimizer's state and state["local"] the replicas' own
    parameters and inner states ([R, ...] over `data`); state["params"] is the last average.
    """
    g, mesh = setup.config.grad_sync, setup.mesh
    base, schedule = _replica_gradients(setup, data_manual=True)
    outer_tx = collectives.OUTER_OPTIMIZERS[g.outer_optimizer](g)

    def replica_grads(params, local_batch):
        loss, _, grads = base(params, local_batch)  # aux metrics: not reduced here
        return loss, grads

    if streaming.active(g):  # streaming DiLoCo: fragments, overlap, quantized outer gradients
        frags = streaming.partition(setup.abstract_params, setup.param_axes, g.fragments)
        local = streaming.local_sgd(
            replica_grads, setup.tx, outer_tx, mesh, DATA_AXES, g, frags,
            setup.abstract_params, setup.param_specs,
        )  # fmt: skip
    else:
        local = collectives.local_sgd(
            replica_grads,
            setup.tx,
            mesh,
            DATA_AXES,
            g.local_steps,
            outer_tx,
            _per_replica(mesh),
            sync_steps=g.warmup_steps,
        )

    def init(params):
        ls = local.init(params)
        return {"params": ls.local_params, "opt_state": ls.inner_state}

    abstract = jax.eval_shape(init, setup.abstract_params)
    specs = compression.state_partition_spec(
        abstract, DATA_AXES, setup.abstract_params, setup.param_specs
    )

    def step(state: TrainState, batch: Batch) -> Proposal:
        ls = collectives.LocalSGDState(
            state["step"],
            state["params"],
            state["opt_state"],
            state["local"]["params"],
            state["local"]["opt_state"],
            state.get(streaming.PENDING),
        )
        ls, m = local.step(ls, batch)
        new = {
            "params": ls.params,
            "opt_state": ls.outer_state,
            "local": {"params": ls.local_params, "opt_state": ls.inner_state},
        }
        if ls.pending is not None:
            new[streaming.PENDING] = ls.pending
        return Proposal(m["loss"], m["grad_norm"], {}, new)

    entries = {"local": Entry.from_specs(abstract, specs, mesh, init)}
    if streaming.active(g) and g.outer_overlap > 0:  # outer gradients in flight, like the params
        zeros = lambda params: jax.tree.map(jnp.zeros_like, params)
        entries[streaming.PENDING] = Entry.from_specs(
            setup.abstract_params, setup.param_specs, mesh, zeros
        )
    return Strategy("local_sgd", step, entries, outer_tx, schedule)


# The strategies that compute each replica's gradients inside a shard_map manual over `data`
# (`_replica_gradients(..., data_manual=True)`): a pipeline's stages nest in it and every schedule
# runs its backward inside them (jaxdist/pipeline/gradients.py `make_gradients`).
DATA_MANUAL = ("compressed", "allreduce", "local_sgd")

STRATEGIES: dict[str, Callable[[Setup], Strategy]] = {
    "plain": plain,
    "accumulated": accumulated,
    "pipelined": pipelined,
    "compressed": compressed,
    "allreduce": reduced,
    "overlapped": overlapped,
    "local_sgd": local_sgd,
}


def choose(config, mesh_shape: Mapping[str, int]) -> str:
    """The `STRATEGIES` name a config runs on a mesh of these axis sizes."""
    if mesh_shape["data"] > 1 and config.grad_sync.local_steps > 1:
        return "local_sgd"
    if mesh_shape["data"] > 1 and config.grad_sync.get("overlap", "none") != "none":
        return "overlapped"
    if mesh_shape["data"] > 1 and config.grad_sync.algorithm != "xla":
        return "allreduce"
    if mesh_shape["data"] > 1 and config.grad_sync.compression != "none":
        return "compressed"
    if mesh_shape["pipeline"] > 1:
        return "pipelined"
    return "accumulated" if config.train.grad_accum > 1 else "plain"


def check(config, mesh_shape: Mapping[str, int]) -> None:
    """The gradient strategies' rules: the compressor's fields (`compression.check`), and how the
    explicit data-parallel strategies combine with the mesh and the optimizer. Each is checked
    here only; config.validate calls this.

    Raises:
      ConfigError: one line naming the field and what would be valid.
    """
    g, t = config.grad_sync, config.train
    compression.check(g)
    if g.outer_optimizer not in collectives.OUTER_OPTIMIZERS:
        raise ConfigError(
            f"grad_sync.outer_optimizer={g.outer_optimizer!r} is not valid; choose one of "
            + ", ".join(collectives.OUTER_OPTIMIZERS)
        )
    if compression.preconditioner(g) is not None:
        what = "freeze_variance" if g.freeze_variance else f"compression={g.compression!r}"
        if t.optimizer != "adamw":
            raise ConfigError(
                f"grad_sync.{what} is AdamW with a frozen variance: it needs "
                f"train.optimizer='adamw', not {t.optimizer!r}"
            )
        if g.warmup_steps < 1:
            raise ConfigError(
                f"grad_sync.{what} needs grad_sync.warmup_steps >= 1: the full-precision Adam "
                "steps whose variance it then freezes (e.g. 15-25% of training)"
            )
    if (new := compression.deprecated(g)) is not None:
        logging.getLogger("jaxdist").warning(
            "grad_sync.compression=%r is deprecated: it is %r (the same method, renamed)",
            g.compression,
            new,
        )
    sgd_momentum = t.optimizer == "sgd" and t.momentum > 0
    if g.momentum_correction and not (sgd_momentum or g.freeze_variance):
        raise ConfigError(
            "grad_sync.momentum_correction moves the SGD momentum into the compressor: it needs "
            "train.optimizer='sgd' with train.momentum > 0 (or AdamW's, with "
            f"grad_sync.freeze_variance=True), not {t.optimizer!r} with momentum {t.momentum}"
        )
    if g.momentum_correction and t.get("nesterov", False):
        raise ConfigError(
            "grad_sync.momentum_correction applies plain momentum inside the compressor: set "
            "train.nesterov=False"
        )
    streaming.check(g, mesh_shape)
    overlap.check(config, mesh_shape)
    if g.local_steps > 1:
        _check_explicit("grad_sync.local_steps", g.local_steps, "local_steps=1", mesh_shape)
        if g.compression != "none":
            raise ConfigError(
                f"grad_sync.local_steps={g.local_steps} sends no gradients to compress; set "
                f"grad_sync.compression='none' (not {g.compression!r})"
            )
        if g.outer_learning_rate <= 0:
            raise ConfigError("grad_sync.outer_learning_rate must be > 0")
        if not isinstance(g.warmup_steps, int) or g.warmup_steps < 0:
            raise ConfigError(f"grad_sync.warmup_steps={g.warmup_steps} must be an integer >= 0")
        if g.warmup_steps and streaming.active(g):
            raise ConfigError(
                "grad_sync.warmup_steps (local SGD's synchronous first steps) is not supported "
                "with streaming DiLoCo (grad_sync.fragments > 1 or outer_overlap/quantization); "
                "set grad_sync.warmup_steps=0"
            )
        if not 0 <= g.outer_momentum < 1:
            raise ConfigError("grad_sync.outer_momentum must be in [0, 1)")
        m = config.model
        if m.get("num_experts", 0) and m.get("moe_aux_loss_weight", 0.0):
            raise ConfigError(
                f"grad_sync.local_steps={g.local_steps} with model.moe_aux_loss_weight="
                f"{m.moe_aux_loss_weight}: local SGD's replicas step apart, so each one's "
                "load-balancing loss would see only its own router statistics, not the batch's; "
                "set model.moe_aux_loss_weight=0 or grad_sync.local_steps=1"
            )
    elif g.compression != "none":
        _check_explicit("grad_sync.compression", g.compression, "compression='none'", mesh_shape)
    elif g.get("algorithm", "xla") != "xla" and mesh_shape["data"] > 1:
        _check_explicit("grad_sync.algorithm", g.algorithm, "algorithm='xla'", mesh_shape)


def _check_explicit(field: str, value: Any, off: str, mesh_shape: Mapping[str, int]) -> None:
    """compressed / local_sgd run per replica over `data`: they need mesh.data > 1, and with
    pipeline stages each replica's gradients come from a shard_map manual over `data`, on which
    XLA's SPMD partitioner (jax 0.10) aborts while two or more other axes stay automatic; refuse
    that here instead of crashing in compilation."""
    if mesh_shape["data"] <= 1:
        raise ConfigError(
            f"{field}={value!r} works on the data-parallel replicas, but "
            f"mesh.data={mesh_shape['data']}; set mesh.data > 1 or {off}"
        )
    others = [a for a in ("fsdp", "tensor") if mesh_shape[a] > 1]
    if mesh_shape["pipeline"] > 1 and others:
        raise ConfigError(
            f"{field}={value!r} with mesh axes {'×'.join(['data', *others, 'pipeline'])} > 1 "
            "needs fsdp = tensor = 1 (XLA SPMD partitioner limit); with mesh.pipeline > 1 set "
            "fsdp = tensor = 1"
        )
