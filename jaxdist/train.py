"""The train step: abstract-first init, one pure `train_step(state, batch)`, compiled once.

`Engine` holds everything derived from a config and a mesh: the model definition, the optimizer, the
shardings of the state (storage rules) and of the batch, and the jitted init / train / eval functions.
`build` wires three pieces together:
  the state spec (jaxdist/state.py): shapes and storage shardings first, parameters born sharded;
  the gradient strategy (jaxdist/strategies.py): plain, accumulated, pipelined, compressed or local
    SGD, chosen by the config, proposing the new state;
  `apply_update`: the non-finite guard and the metrics, the same for every strategy.
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
from jaxdist import fp8, microbatch, optim, pipeline, sharding, spikes, strategies
from jaxdist import state as state_lib
from jaxdist.data import Dataset
from jaxdist.state import TrainState
from models.api import AbstractModel, ModelFamily, Stages, abstract_model

State = TrainState
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
    init_fn: Callable[..., State]  # (key, params=None) -> state
    train_step: Callable[[State, Batch], tuple[State, dict]]
    eval_step: Callable[[State, Batch], dict]
    schedule: Any = None  # pipeline.Schedule when mesh.pipeline > 1: the tables the step runs
    strategy: str = "plain"  # the jaxdist.strategies.STRATEGIES name the train step runs
    # Stored row -> layer of the stacked layers (pipeline.layer_order), None when in [L] order:
    # the state is stored reordered, checkpoints and exports keep the [L] order.
    layer_order: np.ndarray | None = None
    _reorder_state: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.abstract_state["params"]))

    def init(self, seed: int | None = None, params: Any = None) -> State:
        """A fresh train state at step 0; with `params` (a tree like the params, on their
        shardings) those weights instead of a random init (`train.init_from`)."""
        seed = self.config.train.seed if seed is None else seed
        return self.init_fn(jax.random.key(seed), params)

    @property
    def stages(self) -> Stages | None:
        """The model's pipeline pieces, None for a family that cannot be pipelined."""
        return self.family.stages(self.config.model) if self.family.stages else None

    def to_user(self, tree: Any, shardings: Any = None) -> Any:
        """A state tree (or a subtree with its `shardings`) with its stacked layers in the user's
        [L] order: what checkpoints and exports hold. The identity unless `layer_order`."""
        return self._reorder(tree, shardings, to_user=True)

    def to_storage(self, tree: Any, shardings: Any = None) -> Any:
        """The inverse of `to_user`: [L] order to the stored order the steps run on."""
        return self._reorder(tree, shardings, to_user=False)

    def _reorder(self, tree: Any, shardings: Any, *, to_user: bool) -> Any:
        if self.layer_order is None:
            return tree
        whole = shardings is None
        if whole and to_user in self._reorder_state:  # compiled once per direction
            return self._reorder_state[to_user](tree)
        shardings = self.state_shardings if whole else shardings
        fn = lambda t: pipeline.reorder_layers(t, shardings, self.layer_order, to_user=to_user)
        fn = jax.jit(fn, out_shardings=shardings)
        if whole:
            self._reorder_state[to_user] = fn
        return fn(tree)

    def merge(self, params: Any) -> nnx.Module:
        return self.model.merge(params)

    def abstract_batch(self, global_shapes: dict[str, tuple[int, ...]], dtypes: dict) -> dict:
        return {
            k: jax.ShapeDtypeStruct(global_shapes[k], dtypes[k], sharding=self.batch_shardings[k])
            for k in global_shapes
        }


def _loss_fn(config, mesh: Mesh, family: ModelFamily, model: AbstractModel) -> Callable:
    """(params, batch) -> (loss, aux): the family's loss of the model at the compute dtype."""
    compute_dtype = jnp.dtype(config.train.compute_dtype)

    def loss_fn(params, batch):
        with sharding.activation_rules(mesh):
            module = model.merge(microbatch.cast_floating(params, compute_dtype))
            return family.loss(module, batch, remat=config.train.remat)

    return loss_fn


def apply_update(
    state: TrainState,
    proposal: strategies.Proposal,
    *,
    skip_nonfinite: bool,
    lr_schedule: optax.Schedule,
    train_cfg=None,
) -> tuple[TrainState, dict]:
    """The next state and the step's metrics, for every strategy.

    A non-finite loss or gradient norm is reported as `finite=False`; with `train.on_nonfinite=
    "skip"` the whole proposal (parameters, optimizer and strategy state) is dropped and the step
    still counts, with `skipped` incremented. With `train.on_spike` on (`train_cfg`), the loss is
    judged by the spike detector (jaxdist/spikes.py): `spike` and `spike_threshold` join the
    metrics, and `skip` drops a spike's update the same way.
    """
    finite = jnp.isfinite(proposal.loss) & jnp.isfinite(proposal.grad_norm)
    new, skipped = proposal.new, state["skipped"]
    keep, extra = finite, {}
    if train_cfg is not None and spikes.KEY in state:
        spike, threshold, stats = spikes.judge(state[spikes.KEY], proposal.loss, finite, train_cfg)
        extra = {spikes.KEY: stats}
        if train_cfg.on_spike == "skip":
            keep = finite & ~spike
            skip_nonfinite = True
    if skip_nonfinite:
        old = {k: state[k] for k in new}
        new = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)
        skipped = skipped + (~keep).astype(jnp.int32)
    if extra:
        new = {**new, **extra}
    metrics = {
        "loss": proposal.loss,
        "grad_norm": proposal.grad_norm,
        "learning_rate": lr_schedule(state["step"]),
        "finite": finite,
        "skipped": skipped,
        **proposal.aux,
    }
    if extra:
        metrics["spike"], metrics["spike_threshold"] = spike, threshold
    return {**state, **new, "step": state["step"] + 1, "skipped": skipped}, metrics


def build(config, mesh: Mesh, ds: Dataset) -> Engine:
    """Builds the Engine: shapes and shardings first, nothing materialised."""
    family = models.get(config.model.name)
    family.check_data(config, ds)
    make_model = family.make(config.model, ds)
    batch_axes = family.batch_axes(config.model, ds)
    if config.data.get("packing", "windows") == "documents":  # packed rows' extra entries
        batch_axes = batch_axes | {k: ("batch", "length") for k in ("segment_ids", "positions")}
    model = abstract_model(make_model)
    mesh_shape = {k: int(v) for k, v in mesh.shape.items()}
    tx, lr_schedule = optim.build(strategies.optimizer_config(config, mesh_shape), model.axes, mesh)
    param_shardings = sharding.tree_shardings(model.axes, model.params, mesh)
    loss_fn = _loss_fn(config, mesh, family, model)
    setup = strategies.Setup(
        config=config,
        mesh=mesh,
        param_axes=model.axes,
        abstract_params=model.params,
        param_shardings=param_shardings,
        batch_axes=batch_axes,
        tx=tx,
        loss_fn=loss_fn,
        stages=models.stages_for(config.model, mesh_shape["pipeline"]),
    )
    strategy = strategies.STRATEGIES[strategies.choose(config, mesh_shape)](setup)
    entries = dict(strategy.entries)
    if config.train.on_spike != "none":  # the loss-spike detector's running statistics
        entries[spikes.KEY] = spikes.entry(mesh)
    spec = state_lib.build_spec(
        make_model, model.params, param_shardings, strategy.state_tx, mesh, entries
    )
    batch_shardings = {
        k: NamedSharding(mesh, sharding.logical_to_spec(v, sharding.COMPUTE_RULES, mesh))
        for k, v in batch_axes.items()
    }
    skip = config.train.on_nonfinite == "skip"

    precision = config.train.matmul_precision  # read while tracing (jaxdist/fp8.py)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        with fp8.precision(precision):
            proposal = strategy.step(state, batch)
        return apply_update(
            state, proposal, skip_nonfinite=skip, lr_schedule=lr_schedule, train_cfg=config.train
        )

    eval_step = _eval_step(setup, model, loss_fn)
    init, order = _init(setup, spec, mesh_shape)
    repl = sharding.replicated(mesh)
    in_shardings = (spec.shardings, batch_shardings)
    return Engine(
        config=config,
        mesh=mesh,
        family=family,
        model=model,
        param_axes=model.axes,
        abstract_state=spec.abstract,
        state_shardings=spec.shardings,
        batch_shardings=batch_shardings,
        batch_axes=batch_axes,
        tx=tx,
        lr_schedule=lr_schedule,
        init_fn=jax.jit(init, out_shardings=spec.shardings),
        train_step=jax.jit(
            train_step,
            in_shardings=in_shardings,
            out_shardings=(spec.shardings, repl),
            donate_argnums=0,
        ),
        eval_step=jax.jit(eval_step, in_shardings=in_shardings, out_shardings=repl),
        schedule=strategy.schedule,
        strategy=strategy.name,
        layer_order=order,
    )


def _eval_step(setup: strategies.Setup, model, loss_fn) -> Callable:
    """(state, batch) -> {"loss", ...}; through the pipeline when there is one (the plain model
    would gather every layer onto every device)."""
    eval_loss = loss_fn
    if setup.stages is not None:
        eval_loss = pipeline.make_loss(
            setup.config, setup.mesh, setup.stages, model.axes, setup.batch_axes
        )

    def eval_step(state: TrainState, batch: Batch) -> dict:
        with fp8.precision(setup.config.train.matmul_precision):
            loss, aux = eval_loss(state["params"], batch)
        return {"loss": loss, **aux}

    return eval_step


def _init(setup: strategies.Setup, spec, mesh_shape: dict[str, int]):
    """(init(key, params=None) -> state, the pipeline's stored layer order or None)."""
    if setup.stages is None:
        return spec.init, None
    order = pipeline.layer_order(setup.config, mesh_shape)

    def init(key: jax.Array, params: Any = None) -> TrainState:
        state = spec.init(key, params)  # the stacked layers in [L] order, then as stored
        if order is None:
            return state
        return pipeline.reorder_layers(state, spec.shardings, order, to_user=False)

    return init, order


def param_spec_table(engine: Engine) -> list[tuple[str, tuple, PartitionSpec]]:
    """(path, shape, storage PartitionSpec) per parameter, for summaries and tests."""
    flat = jax.tree_util.tree_flatten_with_path(engine.abstract_state["params"])[0]
    return [
        ("/".join(str(getattr(k, "key", k)) for k in path), leaf.shape, leaf.sharding.spec)
        for path, leaf in flat
    ]
