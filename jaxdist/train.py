"""The train step: abstract-first init, one pure `train_step(state, batch)`, compiled once.

`Engine` holds everything derived from a config and a mesh: the model definition, the optimizer, the
shardings of the state (storage rules) and of the batch, and the jitted init / train / eval functions.
Parameters are born sharded: `jax.eval_shape` gives their shapes, the logical-axis table gives their
shardings, and `jit(init, out_shardings=...)` creates each shard on its own device.

The state is a plain dict, so checkpoints are standard orbax trees:
  {"step": int32[], "params": {...}, "opt_state": optax state, "rng": uint32[2], "skipped": int32[]}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import models
from jaxdist import microbatch, optim, sharding
from jaxdist.data import Dataset
from models.api import AbstractModel, ModelFamily, Stages, abstract_model

State = dict[str, Any]
Batch = dict[str, jax.Array]


@dataclasses.dataclass
class Engine:
    """Compiled train/eval steps and state shardings for one config on one mesh."""

    config: Any
    mesh: Mesh
    family: ModelFamily  # the `model.name` family (models/api.py)
    model: AbstractModel  # the module's structure, to rebuild it from a pure dict of params
    param_axes: Any  # pure dict: path → logical axes tuple
    abstract_state: State
    state_shardings: State
    batch_shardings: dict[str, NamedSharding]
    batch_axes: dict[str, tuple]
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    init_fn: Callable[[jax.Array], State]
    train_step: Callable[[State, Batch], tuple[State, dict]]
    eval_step: Callable[[State, Batch], dict]
    schedule: Any = None  # pipeline.Schedule when mesh.pipeline > 1: the tables the step runs

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.abstract_state["params"]))

    def init(self, seed: int | None = None) -> State:
        seed = self.config.train.seed if seed is None else seed
        return self.init_fn(jax.random.key(seed))

    @property
    def stages(self) -> Stages | None:
        """The model's pipeline pieces, None for a family that cannot be pipelined."""
        return self.family.stages(self.config.model) if self.family.stages else None

    def merge(self, params: Any) -> nnx.Module:
        return self.model.merge(params)

    def abstract_batch(self, global_shapes: dict[str, tuple[int, ...]], dtypes: dict) -> dict:
        return {
            k: jax.ShapeDtypeStruct(global_shapes[k], dtypes[k], sharding=self.batch_shardings[k])
            for k in global_shapes
        }


def build(config, mesh: Mesh, ds: Dataset) -> Engine:
    """Builds the Engine: shapes and shardings first, nothing materialised."""
    family = models.get(config.model.name)
    family.check_data(config, ds)
    make_model = family.make(config.model, ds)
    batch_axes = family.batch_axes(config.model, ds)
    model = abstract_model(make_model)
    abstract_params, param_axes = model.params, model.axes

    # DGC / 1-bit Adam: with grad_sync.momentum_correction the SGD momentum is applied per replica
    # inside the compressor (jaxdist/compression.py), and each replica clips its own gradient
    # before it; the optimizer then runs without momentum or clipping of its own.
    momentum_in_sync = config.grad_sync.momentum_correction and mesh.shape["data"] > 1
    opt_cfg = config.train
    if momentum_in_sync:
        opt_cfg = config.train.copy_and_resolve_references()
        opt_cfg.momentum, opt_cfg.grad_clip = 0.0, 0.0
    tx, lr_schedule = optim.build(opt_cfg, param_axes)
    # Local SGD / DiLoCo (grad_sync.local_steps > 1): `tx` is each replica's inner optimizer;
    # state["opt_state"] holds the outer optimizer's state and state["local"] the replicas' own
    # parameters and inner states ([R, ...] over `data`). state["params"] is the last average.
    local_steps = config.grad_sync.local_steps if mesh.shape["data"] > 1 else 1
    outer_tx = None
    if local_steps > 1:
        from jaxdist import collectives

        g = config.grad_sync
        outer_tx = (
            optax.sgd(1.0)
            if g.outer_optimizer == "average"
            else collectives.diloco_outer(g.outer_learning_rate, g.outer_momentum)
        )
    state_tx = outer_tx or tx
    param_shardings = sharding.tree_shardings(param_axes, abstract_params, mesh)
    abstract_opt = jax.eval_shape(state_tx.init, abstract_params)
    repl = sharding.replicated(mesh)
    opt_shardings = optax.tree_map_params(
        state_tx,
        lambda _, s: s,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: repl,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    state_shardings = {
        "step": repl,
        "params": param_shardings,
        "opt_state": opt_shardings,
        "rng": repl,
        "skipped": repl,
    }
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": abstract_params,
        "opt_state": abstract_opt,
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "skipped": jax.ShapeDtypeStruct((), jnp.int32),
    }
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_state,
        state_shardings,
    )
    batch_shardings = {
        k: NamedSharding(mesh, sharding.logical_to_spec(v, sharding.COMPUTE_RULES, mesh))
        for k, v in batch_axes.items()
    }

    t = config.train
    compute_dtype = jnp.dtype(t.compute_dtype)
    accum = t.grad_accum
    skip_nonfinite = t.on_nonfinite == "skip"

    def init(key: jax.Array) -> State:
        module = make_model(nnx.Rngs(key))
        params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": state_tx.init(params),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)),
            "skipped": jnp.zeros((), jnp.int32),
        }
        if sync is not None:
            state["grad_sync"] = sync_init(params)
        if local is not None:
            ls = local.init(params)
            state["local"] = {"params": ls.local_params, "opt_state": ls.inner_state}
        return state

    def loss_fn(params, batch):
        with sharding.activation_rules(mesh):
            module = model.merge(microbatch.cast_floating(params, compute_dtype))
            return family.loss(module, batch, remat=t.remat)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def plain_gradients(params, batch):
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, grads

    gradients = microbatch.accumulated(
        plain_gradients,
        accum,
        batch_axes,
        mesh,
        constrain=lambda tree: jax.tree.map(sharding.constrain_to, tree, param_shardings),
    )

    schedule = None
    stages = models.stages_for(config.model, mesh.shape["pipeline"])
    if stages is not None:  # stages over the pipeline axis (jaxdist/pipeline.py)
        from jaxdist import pipeline

        # Compression and local SGD call `gradients` per replica, inside their shard_map over data.
        per_replica = mesh.shape["data"] > 1 and (
            config.grad_sync.compression != "none" or local_steps > 1
        )
        gradients, schedule = pipeline.make_gradients(
            config, mesh, stages, param_axes, batch_axes, data_manual=per_replica
        )
        # Evaluation runs through the pipeline too: the plain model would gather every layer.
        loss_fn = pipeline.make_loss(config, mesh, stages, param_axes, batch_axes)

    def add_per_replica_state(key: str, abstract: Any) -> None:
        """state[key]: leaves [R, ...] over `data`, sharded like their parameters on the rest."""
        from jaxdist import compression

        param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
        specs = compression.state_partition_spec(abstract, ("data",), abstract_params, param_specs)
        state_shardings[key] = jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs)
        abstract_state[key] = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            state_shardings[key],
        )

    # Explicit gradient synchronisation (jaxdist/compression.py): per-replica gradients inside a
    # shard_map over `data`, reduced by the configured compressor; fsdp/tensor stay automatic.
    sync = None
    if config.grad_sync.compression != "none" and mesh.shape["data"] > 1:
        from jaxdist import collectives, compression

        data_axes = ("data",)
        # Leading stacked-layer axes per parameter: compressors treat each layer as its own tensor.
        batch_dims = jax.tree.map(
            lambda axes: next((i for i, a in enumerate(axes) if a != "layers"), len(axes)),
            param_axes,
            is_leaf=sharding.is_axes,
        )
        tx_sync = compression.from_config(
            config.grad_sync, data_axes, momentum=t.momentum, batch_dims=batch_dims
        )

        def local_grads(params, local_batch):
            loss, _, grads = gradients(params, local_batch)  # aux metrics: not reduced here
            if momentum_in_sync and t.grad_clip > 0:
                grads, _ = optax.clip_by_global_norm(t.grad_clip).update(grads, None)
            return loss, grads

        # Every device compresses its own shard of its replica's gradient: manual over the axes
        # that shard the parameters too (see collectives.sync_grads).
        shard_axes = tuple(a for a in ("fsdp", "tensor", "pipeline") if mesh.shape[a] > 1)
        param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
        sync_init, sync_specs = compression.sharded_state(
            tx_sync, abstract_params, param_specs, mesh, data_axes, shard_axes
        )
        state_shardings["grad_sync"] = jax.tree.map(lambda sp: NamedSharding(mesh, sp), sync_specs)
        abstract_state["grad_sync"] = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            jax.eval_shape(sync_init, abstract_params),
            state_shardings["grad_sync"],
        )
        sync = collectives.sync_grads(
            local_grads,
            tx_sync,
            mesh,
            data_axes,
            shard_axes=shard_axes,
            param_specs=param_specs,
            state_specs=sync_specs,
            per_replica="shard_map" if mesh.shape["pipeline"] > 1 else "vmap",
        )

    local = None
    if local_steps > 1:  # (collectives is imported above, with outer_tx)
        data_axes = ("data",)

        def replica_grads(params, local_batch):
            loss, _, grads = gradients(params, local_batch)  # aux metrics: not reduced here
            return loss, grads

        local = collectives.local_sgd(
            replica_grads,
            tx,
            mesh,
            data_axes,
            local_steps,
            outer_tx,
            # pipelined gradients need the shard_map (see collectives.sync_grads)
            per_replica="shard_map" if mesh.shape["pipeline"] > 1 else "vmap",
        )
        abstract_ls = jax.eval_shape(local.init, abstract_params)
        add_per_replica_state(
            "local", {"params": abstract_ls.local_params, "opt_state": abstract_ls.inner_state}
        )

    def train_step(state: State, batch: Batch) -> tuple[State, dict]:
        if local is not None:
            return local_train_step(state, batch)
        params = state["params"]
        extra = {}
        if sync is not None:
            loss, grads, extra["grad_sync"] = sync(params, batch, state["grad_sync"])
            aux = {}
        else:
            loss, aux, grads = gradients(params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        skipped = state["skipped"]
        if skip_nonfinite:  # drop the whole update; keep counting steps
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
            new_params, opt_state = keep(new_params, params), keep(opt_state, state["opt_state"])
            skipped = skipped + (~finite).astype(jnp.int32)
        new_state = {
            "step": state["step"] + 1,
            "params": new_params,
            "opt_state": opt_state,
            "rng": state["rng"],
            "skipped": skipped,
            **extra,
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": lr_schedule(state["step"]),
            "finite": finite,
            "skipped": skipped,
            **aux,
        }
        return new_state, metrics

    def local_train_step(state: State, batch: Batch) -> tuple[State, dict]:
        ls = collectives.LocalSGDState(
            state["step"],
            state["params"],
            state["opt_state"],
            state["local"]["params"],
            state["local"]["opt_state"],
        )
        ls, m = local.step(ls, batch)
        new = {
            "params": ls.params,
            "opt_state": ls.outer_state,
            "local": {"params": ls.local_params, "opt_state": ls.inner_state},
        }
        finite = jnp.isfinite(m["loss"]) & jnp.isfinite(m["grad_norm"])
        skipped = state["skipped"]
        if skip_nonfinite:  # drop the whole step, replicas included
            new = jax.tree.map(
                lambda n, o: jnp.where(finite, n, o), new, {k: state[k] for k in new}
            )
            skipped = skipped + (~finite).astype(jnp.int32)
        new_state = {**state, **new, "step": state["step"] + 1, "skipped": skipped}
        metrics = {
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "learning_rate": lr_schedule(state["step"]),
            "finite": finite,
            "skipped": skipped,
        }
        return new_state, metrics

    def eval_step(state: State, batch: Batch) -> dict:
        loss, aux = loss_fn(state["params"], batch)
        return {"loss": loss, **aux}

    init_fn = jax.jit(init, out_shardings=state_shardings)
    step_fn = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        eval_step, in_shardings=(state_shardings, batch_shardings), out_shardings=repl
    )
    return Engine(
        config=config,
        mesh=mesh,
        family=family,
        model=model,
        param_axes=param_axes,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        batch_shardings=batch_shardings,
        batch_axes=batch_axes,
        tx=tx,
        lr_schedule=lr_schedule,
        init_fn=init_fn,
        train_step=step_fn,
        eval_step=eval_fn,
        schedule=schedule,
    )


def param_spec_table(engine: Engine) -> list[tuple[str, tuple, PartitionSpec]]:
    """(path, shape, storage PartitionSpec) per parameter, for summaries and tests."""
    flat = jax.tree_util.tree_flatten_with_path(engine.abstract_state["params"])[0]
    return [
        ("/".join(str(getattr(k, "key", k)) for k in path), leaf.shape, leaf.sharding.spec)
        for path, leaf in flat
    ]
