"""The gradient function the train step calls: the stages' shard_map around a schedule's executor.

`make_gradients` is the pipelined replacement for `train.build`'s `gradients(params, batch)`:
embedding outside the stages, the stacked layers cut into `[p, v, Lc, ...]` chunks over
`pipeline`, the schedule's executor (`executors.py`) inside one `jax.shard_map` manual over
`pipeline` (and `data` / `fsdp` / `context` / `expert` when they take part), head and loss inside
(explicit backward) or outside (gpipe, interleaved). `make_loss` is the evaluation forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import microbatch, sharding
from jaxdist.errors import ConfigError
from jaxdist.pipeline.executors import looped_forward, looped_gradients
from jaxdist.pipeline.schedules import AXIS, Schedule, looped_forward_table
from jaxdist.pipeline.spec import schedule_for, schedule_spec
from jaxdist.pipeline.spmd import take
from jaxdist.pipeline.tick_tables import FEED_KEYS, exec_tables, feeds_in_blocks
from models import api
from models.api import Stages

_EXPERT = "expert"  # MoE experts' axis: manual in the stages' shard_map when > 1
_CONTEXT = "context"  # the sequence axis: manual in the stages' shard_map when > 1
_WEIGHTS = "pipeline_stage_weights"  # checkpoint name of a tick's selected stage weights
_SEGMENT_KEYS = ("segment_ids", "positions")  # a packed batch's (`data.packing=documents`)


def _outer_rules(per_replica_rows: int, p: int) -> sharding.Rules:
    """Compute rules for embedding and head: the batch split over the pipeline axis too, if it fits."""
    if per_replica_rows % p:
        return sharding.COMPUTE_RULES
    return tuple(
        (n, ("data", "fsdp", _EXPERT, AXIS)) if n == "batch" else (n, a)
        for n, a in sharding.COMPUTE_RULES
    )


@dataclasses.dataclass(frozen=True)
class _Pipe:
    """What the pipelined gradient functions share, fixed before tracing.

    Attributes:
      sched: the schedule tables the step runs.
      mesh: the device mesh; its `pipeline` axis is the stage axis.
      stages: the model's pipeline pieces (models/api.py).
      batch_axes: logical axes of the batch entries.
      dtype: the compute dtype.
      remat: `train.remat`.
      data_manual: called inside a shard_map that is already manual over `data`.
      manual: the manual axes of the stages' shard_map: `pipeline`, and `data` when the stages
        accumulate each replica's gradients themselves (`data` > 1 and not `data_manual`);
        `fsdp` with `fsdp_gather_once`; `context` and `expert` when > 1.
      inner_rules: compute rules inside the stages' shard_map (no manual axis named).
      outer_rules: compute rules for the embedding and head outside it (see `_outer_rules`).
      stage_shardings, layer_shardings: per stacked-layer leaf, its storage sharding as
        [p, v, Lc, ...] stage chunks and as the stored [L, ...] stack.
    """

    sched: Schedule
    mesh: Mesh
    stages: Stages
    batch_axes: dict[str, tuple]
    dtype: Any
    remat: str
    data_manual: bool
    manual: tuple[str, ...]
    inner_rules: sharding.Rules
    outer_rules: sharding.Rules
    stage_shardings: Any
    layer_shardings: Any

    @property
    def batch_manual(self) -> tuple[str, ...]:
        """The manual axes that split a microbatch's tokens: `data`, `fsdp` with
        `fsdp_gather_once`, `context` (its length)."""
        return tuple(a for a in self.manual if a != AXIS)

    @property
    def data_in_stages(self) -> bool:
        return bool(self.batch_manual)

    @property
    def n_summed(self) -> int:
        """Replicas whose losses the stages' psum adds."""
        return int(np.prod([self.mesh.shape[a] for a in self.batch_manual]))

    @property
    def x0_blocks(self) -> bool:
        """1f1b / zb with p dividing m: the embedded microbatches stay in blocks over the stages
        (`tick_loop`), also nested in the caller's shard_map over `data` (grad_sync's explicit
        paths). Not with `context` / `expert` manual (untested there): the batch is gathered."""
        explicit = not schedule_spec(self.sched.name).autodiff_backward
        split = _CONTEXT in self.manual or _EXPERT in self.manual
        return explicit and feeds_in_blocks(self.sched) and not split

    @property
    def batch_spec(self) -> PartitionSpec:
        """Microbatched inputs [m, b, T, ...] of the stages' shard_map."""
        rows = tuple(a for a in ("data", "fsdp", _EXPERT) if a in self.batch_manual)
        if _CONTEXT in self.manual:
            return PartitionSpec(None, rows or None, _CONTEXT)
        return PartitionSpec(None, rows) if rows else PartitionSpec()

    def to_stages(self, layers: Any) -> Any:
        """stored [L, ...] -> [p, v, Lc, ...]: chunk j = s·p + d (layers j·Lc ...) on device d.

        A reshape that moves nothing: with v > 1 the rows are stored in looped order already
        (`layer_order`), so each device's contiguous block is its v chunks.
        """
        p, v = self.sched.stages, self.sched.virtual_stages
        one = lambda x, sh: sharding.constrain_to(
            x.reshape(p, v, x.shape[0] // (p * v), *x.shape[1:]), sh
        )
        return jax.tree.map(one, layers, self.stage_shardings)

    def from_stages(self, chunks: Any) -> Any:
        one = lambda x, sh: sharding.constrain_to(x.reshape(-1, *x.shape[3:]), sh)
        return jax.tree.map(one, chunks, self.layer_shardings)

    def micro_split(self, x: jax.Array, axes: tuple) -> jax.Array:
        """[B, ...] -> [m, B/m, ...]; microbatch a takes rows a, a+m, ...: no row changes device."""
        return microbatch.split_rows(x, self.sched.microbatches, axes, self.mesh)

    def micro_blocks(self, x: jax.Array, axes: tuple) -> jax.Array:
        """[B, ...] -> [m, B/m, ...] for the explicit-backward executors' blocks (`tick_loop`):
        within each row block of the outer split (data × fsdp), microbatch a takes the rows
        a·b ... (a+1)·b - 1, so the m axis splits over `pipeline` in blocks of m/p microbatches
        exactly where the outer split put those rows: no row changes device."""
        n = int(np.prod([self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape]))
        n //= self.mesh.shape["data"] if self.data_manual and "data" in self.mesh.shape else 1
        m = self.sched.microbatches
        x = x.reshape(n, m, x.shape[0] // (n * m), *x.shape[1:]).swapaxes(0, 1)
        x = x.reshape(m, -1, *x.shape[3:])
        spec = sharding.logical_to_spec((None, *axes), sharding.COMPUTE_RULES, self.mesh)
        return sharding.constrain_to(x, NamedSharding(self.mesh, PartitionSpec(AXIS, *spec[1:])))

    def storage_order(self, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """inputs and targets [B, T] (and a packed batch's segment ids and positions) with the
        length axis in the blocks' order (`Stages.order`)."""
        order = self.stages.order(batch["inputs"].shape[1])
        if order is None:
            return dict(batch)
        put = lambda k: sharding.constrain(batch[k][:, order], self.batch_axes[k])
        keys = ("inputs", "targets", *(k for k in _SEGMENT_KEYS if k in batch))
        return {**batch, **{k: put(k) for k in keys}}

    def segments(self, batch: Mapping[str, jax.Array], split: Callable) -> Any:
        """A packed batch's (segment_ids, positions) cut into microbatches by `split` ([m, b,
        T] each), else None."""
        if _SEGMENT_KEYS[0] not in batch:
            return None
        return tuple(split(batch[k], self.batch_axes[k]) for k in _SEGMENT_KEYS)

    def head_scale(self, batch: Mapping[str, jax.Array]) -> jax.Array | None:
        """A packed batch's head scale: 1 / its target count (the head sums each microbatch's
        cross-entropy over its targets >= 0: the loss is then the batch's masked mean however
        it is cut, as `api.masked_token_cross_entropy` computes it without a pipeline); else
        None (the head's mean scaled by 1 / microbatches)."""
        if _SEGMENT_KEYS[0] not in batch:
            return None
        return 1.0 / jnp.maximum(jnp.sum(batch["targets"] >= 0), 1).astype(jnp.float32)

    def head_sum(self, head: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
        """A packed microbatch's summed cross-entropy over its targets >= 0 (`head_scale`)."""
        logits = self.stages.head_logits(microbatch.cast_floating(head, self.dtype), y)
        return api.summed_token_cross_entropy(logits, targets)

    def micro_merge(self, x: jax.Array, axes: tuple) -> jax.Array:
        x = x.swapaxes(0, 1).reshape(-1, *x.shape[2:])
        spec = sharding.logical_to_spec(axes, self.outer_rules, self.mesh)
        return sharding.constrain_to(x, NamedSharding(self.mesh, spec))

    def layers(self, chunk, x, remat: str = "none", segments=None):
        """One chunk's layers [Lc, ...] (float32, cast here) applied to x, inside the shard_map:
        (y, the blocks' statistics summed over the layers, {} without `Stages.aux_zero`);
        `segments`: a packed microbatch's (segment_ids, positions), or None."""
        am = jax.sharding.get_abstract_mesh()
        with sharding.activation_rules(am, self.inner_rules):
            with sharding.split_tokens(self.batch_manual):
                chunk = microbatch.cast_floating(chunk, self.dtype)
                return api.stage_layers(self.stages, chunk, x, remat=remat, segments=segments)

    def aux_term(self, stats: dict) -> jax.Array:
        """The blocks' statistics' term of the loss (`Stages.aux_loss`)."""
        return self.stages.aux_loss(stats)[0] if stats else jnp.float32(0)

    @property
    def prepass(self) -> bool:
        """The statistics' term is not linear in them (`Stages.aux_linear`): where it is added
        per microbatch and device (`_backward_inside`), it is linearized at the batch's
        statistics, found by a forward pass first (`_linearized_aux`)."""
        return self.stages.aux_zero is not None and not self.stages.aux_linear

    def aux_total(self, stats: dict) -> dict:
        """Per-device statistics summed over microbatches -> the batch's (their mean over the
        token shards and microbatches, summed over the stages), the same on every device."""
        n = self.n_summed * self.sched.microbatches
        return jax.tree.map(lambda a: jax.lax.psum(a, self.manual) / n, stats)

    def aux_metrics(self, stats: dict) -> dict:
        return self.stages.aux_loss(stats)[1] if stats else {}

    @property
    def chunk_specs(self) -> Any:
        """The stage chunks' specs in the stages' shard_map: split over `pipeline`, and the
        experts' weights over a manual `expert` (each device keeps its E/ep experts)."""
        keep = (AXIS, _EXPERT) if _EXPERT in self.manual else (AXIS,)
        return jax.tree.map(lambda sh: sharding.spec_only(sh.spec, keep), self.stage_shardings)

    def sum_chunk_grads(self, grads: Any) -> Any:
        """Chunk gradients summed over the token-splitting manual axes, except the ones a
        leaf is split over (an expert's gradient already holds every token routed to it)."""

        def one(g, spec):
            axes = tuple(a for a in self.batch_manual if a not in jax.tree.leaves(tuple(spec)))
            return jax.lax.psum(g, axes) if axes else g

        return jax.tree.map(one, grads, self.chunk_specs)

    def looped_stage_fn(self) -> Callable:
        """(this device's chunks [v, Lc, ...], virtual stage s, x) -> y for the looped ticks.

        The chunk is selected inside the function autodiff saves residuals for, so no tick keeps
        a copy of its stage's weights: with v = 1 the index is static (the weights stay a loop
        invariant); with v > 1 the selection and cast run inside a `jax.checkpoint` whose policy
        never saves them (they are recomputed, a slice, in the backward). With `train.remat` the
        policy applies to the whole stage per tick (`full` keeps only each tick's stage input).
        """
        v = self.sched.virtual_stages

        def fn(chunks, s, x, segments=None):
            chunk = jax.tree.map(lambda a: a[0] if v == 1 else take(a, s), chunks)
            chunk = microbatch.cast_floating(chunk, self.dtype)
            chunk = jax.tree.map(lambda a: checkpoint_name(a, _WEIGHTS), chunk)
            return self.layers(chunk, x, segments=segments)

        if self.remat != "none":
            return jax.checkpoint(fn, policy=api.REMAT_POLICIES[self.remat])
        if v == 1:
            return fn
        return jax.checkpoint(
            fn, policy=jax.checkpoint_policies.save_anything_except_these_names(_WEIGHTS)
        )

    def stage_fn(self) -> Callable:
        """(one chunk's layer params [Lc, ...], x, a packed microbatch's segments) -> y, each
        layer keeping what `train.remat` allows (1F1B, zb).

        Jitted, so that a step traces its stage once: the executors call it from several tick
        branches (the stash's shapes, forward, fused and last for 1f1b; zb's likewise), and a
        call with the same argument types reuses the first trace, as a call XLA inlines. On the
        1f1b step of tests/test_pipeline_context_expert.py (ring, pipeline 2 × context 4):
        tracing 6.26 -> 2.57 CPU s, lowering 1.26 -> 0.75, compiling 9.63 -> 8.00 (one run
        each), temp bytes 2,921,200 -> 2,921,008; zb: 5.36 -> 3.04, 0.96 -> 0.91, 7.29 -> 5.92,
        the same temp. The trace is keyed by the argument types alone: the contexts a caller
        sets around it (`fp8.precision`, `sharding.per_replica_loss`, `sharding.mapped_axes`)
        are the same at every call of this function object, which belongs to one engine."""
        return jax.jit(lambda chunk, x, segments=None: self.layers(chunk, x, self.remat, segments))

    def shard_map(self, body: Callable, in_specs: Any, out_specs: Any) -> Callable:
        def run(*args):
            # Nested in the caller's shard_map (data_manual) it takes the tracing mesh, where
            # `data` is already manual.
            am = jax.sharding.get_abstract_mesh()
            on = am if self.data_manual and not am.empty else self.mesh
            return jax.shard_map(
                body, mesh=on, in_specs=in_specs, out_specs=out_specs, axis_names=set(self.manual)
            )(*args)

        return run


def _pipe(
    config, mesh: Mesh, stages: Stages, param_axes: Any, batch_axes: dict, data_manual: bool
) -> _Pipe:
    shape = {k: int(s) for k, s in mesh.shape.items()}
    sched = schedule_for(config, mesh)
    if sched is None:
        raise ConfigError(f"mesh.pipeline={shape.get(AXIS, 1)}: pipelining needs mesh.pipeline > 1")
    t = config.train
    n_data = shape.get("data", 1)
    replicas = n_data * shape.get("fsdp", 1) * shape.get(_EXPERT, 1)
    rows_per_replica = t.batch_size // (replicas * t.grad_accum)
    # `data` is manual too: each replica accumulates its own gradients over the microbatches and
    # they are summed once per step, not once per tick (as XLA does for an automatic batch axis).
    # With data_manual the caller's shard_map owns `data` and sums (or compresses) the gradients.
    manual = (AXIS, "data") if n_data > 1 and not data_manual else (AXIS,)
    # fsdp_gather_once: `fsdp` is manual too, like `data` (each shard accumulates its own gradients
    # on its rows), and the stage weights enter the stages gathered over it, once per step.
    once = bool(config.pipeline.get("fsdp_gather_once", False)) and shape.get("fsdp", 1) > 1
    if once and not data_manual:
        manual = (*manual, "fsdp")
    # `context` is manual too: a block sees its device's T/c slots and its attention runs the
    # per-device ring / all-gather body directly (a shard_map nested in the stages' fails in
    # Shardy under autodiff); the loss sums over it like over `data`.
    if shape.get(_CONTEXT, 1) > 1:
        manual = (*manual, _CONTEXT)
    # `expert` likewise: it splits the batch, and the MoE layers run their all-to-alls directly.
    if shape.get(_EXPERT, 1) > 1:
        manual = (*manual, _EXPERT)
    storage = lambda names, rules=sharding.STORAGE_RULES: NamedSharding(
        mesh, sharding.logical_to_spec(names, rules, mesh)
    )
    stage_rules = sharding.rules_without(sharding.STORAGE_RULES, ("fsdp",) if once else ())
    _, layer_axes, _ = stages.split(param_axes)
    stage_axes = lambda axes: ("stage", None, None, *axes[1:])  # [p, v, Lc, ...]
    return _Pipe(
        sched=sched,
        mesh=mesh,
        stages=stages,
        batch_axes=batch_axes,
        dtype=jnp.dtype(t.compute_dtype),
        remat=t.remat,
        data_manual=data_manual,
        manual=manual,
        inner_rules=sharding.rules_without(
            sharding.COMPUTE_RULES, (*manual, "data") if data_manual else manual
        ),
        outer_rules=_outer_rules(rows_per_replica, sched.stages),
        stage_shardings=jax.tree.map(
            lambda axes: storage(stage_axes(axes), stage_rules),
            layer_axes,
            is_leaf=sharding.is_axes,
        ),
        layer_shardings=jax.tree.map(storage, layer_axes, is_leaf=sharding.is_axes),
    )


def _autodiff_outside(pipe: _Pipe) -> microbatch.GradFn:
    """gpipe / interleaved: forward ticks in the stages' shard_map, embedding and head outside it;
    the backward is the autodiff of all of it, the ticks in reverse."""
    grad_fn = jax.value_and_grad(_looped_loss(pipe), has_aux=True)

    def gradients(params, batch):
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, grads

    return gradients


def _forward_ticks(sched: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward ticks `looped_forward` runs: an autodiff schedule's own, and for a schedule
    with an explicit backward (evaluated by `make_loss` only) gpipe's over its microbatches."""
    if schedule_spec(sched.name).autodiff_backward:
        return sched.forward_ticks()
    return looped_forward_table(sched.stages, sched.microbatches, 1)


def _looped_run(pipe: _Pipe) -> Callable:
    """run(stage chunks [p, v, Lc, ...], embedded microbatches [m, B/m, ...], segments) ->
    (every stage's outputs [p, m, B/m, ...], the batch's statistics): the looped forward ticks
    of the schedule (gpipe's for an explicit-backward schedule) in the stages' shard_map."""
    p, v = pipe.sched.stages, pipe.sched.virtual_stages
    valid, micro, virtual = _forward_ticks(pipe.sched)
    stage_fn = pipe.looped_stage_fn()

    def body(chunks, x0, segments):
        chunks = jax.tree.map(lambda a: a[0], chunks)  # [v, Lc, ...]
        outs, stats = looped_forward(
            stage_fn, chunks, x0, p=p, v=v, valid=valid, micro=micro, virtual=virtual,
            segments=segments,
        )  # fmt: skip
        return outs[None], pipe.aux_total(stats)

    out_spec = PartitionSpec(AXIS, None, *pipe.batch_spec[1:])
    in_specs = (pipe.chunk_specs, pipe.batch_spec, pipe.batch_spec)
    return pipe.shard_map(body, in_specs, (out_spec, PartitionSpec()))


def _looped_loss(pipe: _Pipe) -> Callable:
    """loss(params, batch) -> (mean loss, {}): the looped forward ticks of the schedule
    in the stages' shard_map, embedding and head outside it."""
    p, act, run = pipe.sched.stages, pipe.stages.activation_axes, _looped_run(pipe)

    def loss_fn(params, batch):
        embed, layers, head = pipe.stages.split(params)
        with sharding.activation_rules(pipe.mesh, pipe.outer_rules):
            batch = pipe.storage_order(batch)
            x = pipe.stages.embed(microbatch.cast_floating(embed, pipe.dtype), batch["inputs"])
            segments = pipe.segments(batch, pipe.micro_split)
            y, stats = run(pipe.to_stages(layers), pipe.micro_split(x, act), segments)
            y = pipe.micro_merge(y[p - 1], act)  # [B, ...] (y: [p, m, B/m, ...])
            if segments is None:
                head = microbatch.cast_floating(head, pipe.dtype)
                loss = pipe.stages.head_loss(head, y, batch["targets"])
            else:  # packed: the mean over the targets >= 0
                loss = pipe.head_sum(head, y, batch["targets"]) * pipe.head_scale(batch)
            loss = loss + pipe.aux_term(stats)
            return loss, pipe.aux_metrics(stats)

    return loss_fn


def _stage_executor(pipe: _Pipe) -> Callable:
    """execute(head_loss, chunks, head, x0, targets) -> (loss, chunk grads [v, Lc, ...], head
    grads, d loss / d x0) on one stage, per device: the spec's explicit per-microbatch backward
    (`ScheduleSpec.executor`: 1f1b, zb), or the autodiff of the looped forward ticks (gpipe,
    interleaved) kept inside the stage."""
    p, v, m = pipe.sched.stages, pipe.sched.virtual_stages, pipe.sched.microbatches
    spec = schedule_spec(pipe.sched.name)
    if not spec.autodiff_backward:
        tables = exec_tables(pipe.sched)
        if not pipe.x0_blocks:  # x0 on every stage: no sends (`executors.tick_loop`)
            tables = {k: v for k, v in tables.items() if k not in FEED_KEYS}
        stage_fn = pipe.stage_fn()
        scale = 1.0 / (m * pipe.n_summed)

        def explicit(
            head_loss, chunks, head, x0, targets, segments=None, head_scale=None, aux_term=None
        ):
            chunk = jax.tree.map(lambda a: a[0], chunks)  # [Lc, ...]
            out = spec.executor(
                stage_fn, head_loss, chunk, head, x0, targets,
                scale=scale, dtype=pipe.dtype, tables=tables, aux_term=aux_term or pipe.aux_term,
                segments=segments, head_scale=head_scale,
            )  # fmt: skip
            loss, g_c, g_h, dx0, stats = out
            return loss, jax.tree.map(lambda g: g[None], g_c), g_h, dx0, stats

        return explicit
    valid, micro, virtual = pipe.sched.forward_ticks()
    stage_fn = pipe.looped_stage_fn()

    def looped(head_loss, chunks, head, x0, targets, segments=None, head_scale=None, aux_term=None):
        return looped_gradients(
            stage_fn, head_loss, aux_term or pipe.aux_term, chunks, head, x0, targets,
            p=p, v=v, scale=1.0 / pipe.n_summed, valid=valid, micro=micro, virtual=virtual,
            segments=segments, head_scale=head_scale,
        )  # fmt: skip

    return looped


def _backward_inside(pipe: _Pipe) -> microbatch.GradFn:
    """The backward inside the stages' shard_map, head and loss on the last stage (1F1B, or any
    schedule nested in the caller's shard_map over `data`: jax (0.10) types the residuals an outer
    autodiff would take out of this shard_map as varying over the outer `data` axis too, which
    Shardy rejects). Only the embedding's backward runs outside, from the returned d loss / d x0."""
    execute, stages, manual = _stage_executor(pipe), pipe.stages, pipe.manual
    psum = lambda tree, axes: jax.tree.map(lambda g: jax.lax.psum(g, axes), tree)

    def head_loss(hp, y, tgt):
        with sharding.activation_rules(jax.sharding.get_abstract_mesh(), pipe.inner_rules):
            return stages.head_loss(microbatch.cast_floating(hp, pipe.dtype), y, tgt)

    def head_sum(hp, y, tgt):
        with sharding.activation_rules(jax.sharding.get_abstract_mesh(), pipe.inner_rules):
            return pipe.head_sum(hp, y, tgt)

    def body(chunks, head, x0, targets, segments, head_scale, coef):
        chunks = jax.tree.map(lambda a: a[0], chunks)  # [v, Lc, ...]
        packed = segments is not None  # the head sums over the targets, scaled by head_scale
        term = _tree_dot(coef) if coef else None  # the linearized term (`_linearized_aux`)
        loss, g_c, g_h, dx0, stats = execute(
            head_sum if packed else head_loss,
            chunks,
            head,
            x0,
            targets,
            segments,
            head_scale,
            term,
        )
        g_c = pipe.sum_chunk_grads(g_c)
        g_c = jax.tree.map(lambda g: g[None], g_c)  # [1, v, Lc, ...]
        if not blocks:  # float32: as in looped_forward
            dx0 = psum(dx0.astype(jnp.float32), AXIS)
        return psum(loss, manual), g_c, psum(g_h, manual), dx0, pipe.aux_total(stats)

    P, spec, chunk_specs = PartitionSpec, pipe.batch_spec, pipe.chunk_specs
    # 1f1b / zb with m a multiple of p: the embedded microbatches and their gradients stay in
    # blocks over the stages, carried to / from stage 0 by the conveyors (`feed_tables`); no
    # stage holds the whole [m, b, T, D] batch and no all-reduce over `pipeline` sums d x0.
    blocks = pipe.x0_blocks
    x_spec = P(AXIS, *spec[1:]) if blocks else spec
    in_specs = (chunk_specs, P(), x_spec, spec, spec, P(), P())
    run = pipe.shard_map(body, in_specs, (P(), chunk_specs, P(), x_spec, P()))
    linearized = _linearized_aux(pipe) if pipe.prepass else None

    def gradients(params, batch):
        embed, layers, head = stages.split(params)
        with sharding.activation_rules(pipe.mesh, pipe.outer_rules):
            batch = pipe.storage_order(batch)
            split = pipe.micro_blocks if blocks else pipe.micro_split

            def embed_fn(e):
                x = stages.embed(microbatch.cast_floating(e, pipe.dtype), batch["inputs"])
                return split(x, stages.activation_axes)

            x0, embed_vjp = jax.vjp(embed_fn, embed)  # [m, B/m, ...]
            targets = split(batch["targets"], pipe.batch_axes["targets"])
            segments, head_scale = pipe.segments(batch, split), pipe.head_scale(batch)
            stacked = pipe.to_stages(layers)
            coef, rest = linearized(embed, stacked, batch) if linearized else ({}, 0.0)
            loss, g_stages, g_head, dx0, stats = run(
                stacked, head, x0, targets, segments, head_scale, coef
            )
            loss = loss + rest
            (g_embed,) = embed_vjp(dx0.astype(x0.dtype))
            grads = stages.join(g_embed, pipe.from_stages(g_stages), g_head)
        return loss, pipe.aux_metrics(stats), grads

    return gradients


def _tree_dot(coef: dict) -> Callable[[dict], jax.Array]:
    """stats -> the sum over leaves of coef · stats: a linear statistics term."""
    return lambda stats: sum(
        jnp.sum(c * s) for c, s in zip(jax.tree.leaves(coef), jax.tree.leaves(stats), strict=True)
    )


def _linearized_aux(pipe: _Pipe) -> Callable:
    """(embedding part, stage chunks, batch) -> (coef, rest): a statistics term that is not
    linear (`Stages.aux_linear` False), linearized at the batch's statistics S.

    The looped forward ticks run once, without gradient, for S (the statistics summed over the
    layers and averaged over microbatches and token shards, as `_Pipe.aux_total` gives them);
    coef = d term / d S there. Each microbatch and device then adds coef · its own statistics,
    which sums to coef · S, and the caller adds rest = term(S) - coef · S once: the loss is
    term(S), and its gradient through the statistics is coef · dS, the batch's term's own. One
    more forward pass per step (the router statistics depend on every layer below)."""
    act, run = pipe.stages.activation_axes, _looped_run(pipe)
    term = lambda stats: pipe.stages.aux_loss(stats)[0]

    def linearized(embed, stacked, batch):
        embed, stacked = jax.lax.stop_gradient((embed, stacked))
        x = pipe.stages.embed(microbatch.cast_floating(embed, pipe.dtype), batch["inputs"])
        segments = pipe.segments(batch, pipe.micro_split)
        _, stats = run(stacked, pipe.micro_split(x, act), segments)
        value, coef = jax.value_and_grad(term)(stats)
        return coef, value - _tree_dot(coef)(stats)

    return linearized


def make_gradients(
    config,
    mesh: Mesh,
    stages: Stages,
    param_axes: Any,
    batch_axes: dict[str, tuple],
    *,
    data_manual: bool = False,
) -> tuple[microbatch.GradFn, Schedule]:
    """The pipelined replacement for `train.build`'s `gradients(params, batch)`.

    Args:
      config: the run's config (`pipeline.*`, `train.grad_accum`, `train.compute_dtype`,
        `train.remat`, `model.num_layers`).
      mesh: the device mesh; its `pipeline` axis is the stage axis.
      stages: the model's embed / stacked layers / head (`models.api.Stages`); the pipeline knows
        the model only through these.
      param_axes: logical axes of every parameter (pure dict, like the params).
      batch_axes: logical axes of the batch entries (`inputs` feeds the embedding, `targets` the
        head's loss).
      data_manual: `gradients` is called inside a `jax.shard_map` that is already manual over
        `data` (the explicit gradient-sync and local SGD paths of `jaxdist.collectives`): it sees
        one replica's rows and returns that replica's own loss and gradients, unreduced over
        `data`; the stages' shard_map then nests inside, manual over `pipeline` only.
    Returns:
      (gradients, schedule): `gradients(params, batch) -> (loss, aux, grads)` with grads shaped
      and sharded like params, and the schedule tables it executes.
    Raises:
      ConfigError: layers not divisible into stages, microbatches not dividing the per-replica
        batch, interleaved with microbatches not a multiple of the stages, unknown schedule.
    """
    pipe = _pipe(config, mesh, stages, param_axes, batch_axes, data_manual)
    if schedule_spec(pipe.sched.name).autodiff_backward and not data_manual:
        chunk_gradients = _autodiff_outside(pipe)
    else:
        chunk_gradients = _backward_inside(pipe)
    # Accumulation chunk a takes rows a, a+A, ... as in train.build: no row changes device.
    gradients = microbatch.accumulated(chunk_gradients, config.train.grad_accum, batch_axes, mesh)
    return gradients, pipe.sched


def make_loss(
    config, mesh: Mesh, stages: Stages, param_axes: Any, batch_axes: dict[str, tuple]
) -> Callable:
    """The pipelined forward for evaluation: `loss(params, batch) -> (mean loss, {})`.

    Every schedule evaluates with the looped forward ticks (gpipe's, or interleaved's with its
    virtual stages) over `pipeline.microbatches`: each device keeps its own layers, so evaluating
    needs no more parameter memory than training (the plain model would gather the whole layer
    stack onto every device). Same arguments as `make_gradients`; the batch is split like a
    training batch.
    """
    return _looped_loss(_pipe(config, mesh, stages, param_axes, batch_axes, data_manual=False))
