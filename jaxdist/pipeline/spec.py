"""The `pipeline.schedule` registry: a `ScheduleSpec` per schedule, its abilities, checks, cost.

A schedule is a spec in `SCHEDULES`: its name, the numpy table builder (`schedules.py`,
`zb_search.py`), what it can do (virtual stages, an explicit backward and its executor, the stashes
that executor keeps), its config rules and its costs. `config.validate` (through `check`), the
executors (`gradients.py`), the lock-step cost reader (`cost.py`) and the planner read every
schedule fact from here; no other module lists schedule names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax.sharding import Mesh

import jaxdist.pipeline.executors as executors
import jaxdist.pipeline.tick_tables as tick_tables
from jaxdist.errors import ConfigError
from jaxdist.pipeline.schedules import (
    AXIS,
    BWD,
    FWD,
    FWD_BWD,
    WGT,
    Schedule,
    looped_tables,
    one_f_one_b_tables,
)
from jaxdist.pipeline.zb_search import zero_bubble_tables

# A branch cost hook: (fwd, bwd, b_input, b_weight, head) -> the cost of each switch branch, in
# the order the executor lists them (`tick_tables.F1B1` ...); see `cost.branch_lockstep`.
BranchCosts = Callable[[float, float, float, float, float], list[float]]


@dataclasses.dataclass(frozen=True)
class TickCost:
    """What the planner reads of a schedule at p stages, m microbatches, v virtual stages, all
    counted from the table the step executes (`ScheduleSpec.tick_cost`).

    Attributes:
      ticks: the table's ticks (gpipe / interleaved: forward and mirrored backward ticks).
      lockstep_units: `Schedule.lockstep_units`, in units of a stage's forward.
      bubble_fraction: `Schedule.bubble_fraction`.
      switch_per_tick: every tick is a `lax.switch` over the stages' branches (explicit backward).
      fused: some tick runs a backward and a forward together (1f1b's FWD_BWD).
      slots: with `switch_per_tick`, the slots of the arriving activations, the arriving
        gradients and the largest residual stash (`ScheduleSpec.residual_stashes`); else None.
    """

    ticks: int
    lockstep_units: float
    bubble_fraction: float
    switch_per_tick: bool
    fused: bool
    slots: tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """One `pipeline.schedule` choice, everything the library knows of it.

    Attributes:
      name: the `pipeline.schedule` value.
      tables: (p, m, v) -> its `Schedule` (v = 1 unless `virtual`).
      virtual: runs `pipeline.virtual_stages` layer chunks per device (else v = 1).
      executor: the per-stage executor of an explicit per-microbatch backward
        (`executors.one_f_one_b`, `executors.zero_bubble`), fed `tick_tables.exec_tables`; None:
        the backward is the autodiff of the looped forward ticks (`executors.looped_forward`).
      stashes: the executor's residual buffers: name -> (the table action that writes a
        microbatch's entry, the action that reads it, last stage only); their slots are counted
        from the table (`tick_tables.exec_tables`).
      residual_stashes: the stashes holding a forward's residuals, the activation memory that a
        schedule bounds (the planner charges the largest).
      branch_costs: the cost hook of an explicit executor's switch branches (`BranchCosts`).
      split_backward: the backward is cut into input- and weight-gradient passes (zb): the table's
        BWD is the input pass, WGT the weight pass.
      rules: extra config rules, (p, m, v) -> an error line or None, checked by `check`.
    """

    name: str
    tables: Callable[[int, int, int], Schedule]
    virtual: bool = False
    executor: Callable[..., Any] | None = None
    stashes: Mapping[str, tuple[int, int, bool]] = dataclasses.field(default_factory=dict)
    residual_stashes: tuple[str, ...] = ()
    branch_costs: BranchCosts | None = None
    split_backward: bool = False
    rules: tuple[Callable[[int, int, int], str | None], ...] = ()

    @property
    def autodiff_backward(self) -> bool:
        """The backward is JAX's autodiff of the looped forward ticks (no per-tick switch)."""
        return self.executor is None

    def build(self, p: int, m: int, v: int = 1) -> Schedule:
        """The tables over p stages, m microbatches, v virtual stages (ignored unless
        `virtual`), with the executor's stashes attached."""
        sched = self.tables(p, m, v if self.virtual else 1)
        return dataclasses.replace(sched, stashes=dict(self.stashes))

    def check(self, p: int, m: int, v: int) -> None:
        """This schedule's own config rules (`rules`), as one-line ConfigErrors."""
        for rule in self.rules:
            if (error := rule(p, m, v)) is not None:
                raise ConfigError(error)

    def tick_cost(self, p: int, m: int, v: int = 1) -> TickCost:
        """The planner's hook: ticks, lock-step units, bubble and buffer slots of the table the
        step runs at p stages, m microbatches and v virtual stages."""
        sched = self.build(p, m, v)
        slots = None
        if not self.autodiff_backward:
            n = tick_tables.exec_tables(sched)["slots"]
            slots = (n["x"], n["g"], max(n[k] for k in self.residual_stashes))
        return TickCost(
            ticks=sched.ticks,
            lockstep_units=sched.lockstep_units(),
            bubble_fraction=sched.bubble_fraction,
            switch_per_tick=not self.autodiff_backward,
            fused=bool(np.any(sched.action == FWD_BWD)),
            slots=slots,
        )


def microbatches_in_groups(p: int, m: int, v: int) -> str | None:
    """The looped schedule with v > 1 feeds microbatches in groups of p."""
    if v > 1 and m % p:
        return (
            f"pipeline.microbatches={m} must be a multiple of mesh.pipeline={p} "
            "for the interleaved schedule"
        )
    return None


def _one_f_one_b_branches(fwd, bwd, b_input, b_weight, head) -> list[float]:
    """idle, F, B, fused B + F, the last stage's F + head + loss + B (head's backward 2×)."""
    return [0.0, fwd, bwd, fwd + bwd, fwd + bwd + 3 * head]


def _zero_bubble_branches(fwd, bwd, b_input, b_weight, head) -> list[float]:
    """idle, F, B (input gradient), W (weight gradient), the last stage's F + head, B + head's B."""
    return [0.0, fwd, b_input, b_weight, fwd + head, b_input + 2 * head]


# The schedules by `pipeline.schedule`: the one list `config.validate`, the executors, the cost
# reader and the planner read. A new schedule is one entry here (docs/ARCHITECTURE.md).
SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", looped_tables("gpipe")),
        ScheduleSpec(
            "1f1b",
            one_f_one_b_tables,
            executor=executors.one_f_one_b,
            stashes={"r": (FWD, BWD, False)},
            residual_stashes=("r",),
            branch_costs=_one_f_one_b_branches,
        ),
        ScheduleSpec(
            "interleaved",
            looped_tables("interleaved"),
            virtual=True,
            rules=(microbatches_in_groups,),
        ),  # fmt: skip
        ScheduleSpec(
            "zb",
            zero_bubble_tables,
            executor=executors.zero_bubble,
            stashes={
                "b": (FWD, BWD, False),
                "w": (FWD, WGT, False),
                "r": (BWD, WGT, False),
                "h": (FWD, BWD, True),
            },  # fmt: skip
            residual_stashes=("b", "w"),
            branch_costs=_zero_bubble_branches,
            split_backward=True,
        ),
    )
}


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of `pipeline.schedule=name`; a one-line ConfigError naming the valid ones."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline.schedule={name!r} is not valid; choose one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule tables for `name` over p stages, m microbatches, v virtual stages."""
    return schedule_spec(name).build(p, m, v)


def _positive(path: str, value: Any) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}={value!r} must be a positive integer")


def check(config, mesh_shape: Mapping[str, int]) -> Schedule | None:
    """The pipeline's constraints, raised as one-line ConfigErrors before anything compiles.

    A pipelined model stacks `model.num_layers` layers (models/api.py); whether the model can be
    pipelined at all is the model registry's rule (`models.stages_for`).

    Returns:
      The schedule a build with this config runs on this mesh, or None when mesh.pipeline = 1.
    """
    pc, mc, t = config.pipeline, config.model, config.train
    spec = schedule_spec(pc.schedule)
    _positive("pipeline.microbatches", pc.microbatches)
    _positive("pipeline.virtual_stages", pc.virtual_stages)
    p = int(mesh_shape.get(AXIS, 1))
    if p <= 1:
        return None
    v = pc.virtual_stages if spec.virtual else 1
    m = pc.microbatches
    if mc.num_layers % (p * v):
        raise ConfigError(
            f"model.num_layers={mc.num_layers} must be divisible by "
            f"mesh.pipeline×pipeline.virtual_stages = {p}×{v} = {p * v}"
        )
    # `expert` splits the batch too (the stages' shard_map is manual over it).
    replicas = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) * mesh_shape.get("expert", 1)
    per_replica, rem = divmod(t.batch_size, replicas * t.grad_accum)
    if rem or per_replica % m:
        raise ConfigError(
            f"pipeline.microbatches={m} must divide the per-replica batch "
            f"{t.batch_size}/(data×fsdp×expert×grad_accum = {replicas * t.grad_accum}) = "
            f"{t.batch_size / (replicas * t.grad_accum):g}"
        )
    spec.check(p, m, v)
    return spec.build(p, m, v)  # (the tables check what only they know)


def schedule_for(config, mesh: Mesh) -> Schedule | None:
    """The schedule a build with this config and mesh runs, or None without pipelining."""
    return check(config, {k: int(s) for k, s in mesh.shape.items()})


def bubble_fraction(config, mesh: Mesh) -> float | None:
    """Bubble fraction of the schedule that `train.build` runs for this config, None if p = 1."""
    sched = schedule_for(config, mesh)
    return None if sched is None else sched.bubble_fraction
