"""A pipeline step's lock-step cost, read from its compiled HLO (or priced from branch costs).

All stages advance together, so a tick lasts as long as the slowest stage's work in it. `LockStep`
walks a compiled program's HLO (`hlo_cost.parse_module`) and charges each tick of a switching
schedule its costliest executed branch; `cost` / `step_cost` give the layout record's numbers,
`branch_lockstep` prices a table from given branch costs (the planner's path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist import hlo_cost, microbatch
from jaxdist.pipeline.schedules import IDLE, Schedule
from jaxdist.pipeline.spec import schedule_spec
from jaxdist.pipeline.tick_tables import exec_tables
from models import api
from models.api import Stages


def executed_actions(sched: Schedule) -> np.ndarray | None:
    """int [ticks, p]: the `lax.switch` branch each stage takes at each tick of a schedule whose
    executor switches per tick (1f1b, zb), or None when every stage runs the same tick body
    (gpipe and interleaved: the forward ticks and their autodiff)."""
    if schedule_spec(sched.name).autodiff_backward:
        return None
    return exec_tables(sched)["action"]


class LockStep:
    """Dot FLOPs of one device's program, with each tick of a switching schedule charged for the
    slowest stage's branch.

    `comp(name)` totals a computation (the program: `module.entry`), loops times their trip
    counts, a conditional as its costliest branch, except the schedule's per-tick switch, whose
    ticks are charged from `actions`; after the walk `branches` holds that switch's per-branch
    totals (None if it has none).

    Args:
      module: the parsed program (`hlo_cost.parse_module`).
      actions: int [ticks, p]: the switch branch each stage takes per tick (`executed_actions`),
        None for a schedule without a per-tick switch.
      count: (instruction, its computation) -> its cost; default the dot FLOPs (e.g. a count of
        all-reduces instead).
    """

    def __init__(self, module, actions: np.ndarray | None, count: Callable | None = None):
        self.module, self.actions = module, actions
        self.count = count or (
            lambda inst, c: hlo_cost.dot_flops(inst, c) if inst.opcode == "dot" else 0
        )
        self.memo: dict[str, float] = {}
        self.branches: list[float] | None = None  # FLOPs of each switch branch, once found

    def comp(self, name: str, skip: str | None = None) -> float:
        if name in self.memo and skip is None:
            return self.memo[name]
        c = self.module.computations[name]
        total = 0.0
        for inst in c.instructions.values():
            if inst.name == skip:
                continue
            total += self.count(inst, c)
            if inst.opcode == "while":
                total += self.loop(inst, c)
            elif inst.opcode == "conditional":
                total += max(self.comp(b) for b in hlo_cost.callees(inst))
            else:
                total += sum(self.comp(b) for b in hlo_cost.callees(inst))
        if skip is None:
            self.memo[name] = total
        return total

    def loop(self, inst, parent) -> float:
        body, cond = (inst.attrs[k].lstrip("%") for k in ("body", "condition"))
        if self.comp(body) == 0 and self.comp(cond) == 0:
            return 0.0
        trips = hlo_cost.trip_count(self.module, inst, parent)
        switch = self._switch(body, trips)
        if switch is None:
            return trips * self.comp(body) + (trips + 1) * self.comp(cond)
        branches = [self.comp(b) for b in hlo_cost.callees(switch)]
        self.branches = branches
        ticks = sum(max(branches[a] for a in row) for row in self.actions)
        return trips * self.comp(body, skip=switch.name) + (trips + 1) * self.comp(cond) + ticks

    def _switch(self, body: str, trips: int):
        """The per-tick `lax.switch` of the schedule: a conditional directly in a loop body that
        runs once per tick, with one branch per action."""
        if self.actions is None or trips != self.actions.shape[0]:
            return None
        n = int(self.actions.max()) + 1
        size = lambda inst: sum(
            len(self.module.computations[b].instructions) for b in hlo_cost.callees(inst)
        )
        found = [
            inst
            for inst in self.module.computations[body].instructions.values()
            if inst.opcode == "conditional" and len(list(hlo_cost.callees(inst))) == n
        ]  # (the largest, should another conditional have as many branches)
        return max(found, key=size, default=None)


def branch_lockstep(
    sched: Schedule, fwd: float, bwd: float, b_input: float, b_weight: float, head: float
) -> tuple[float, float]:
    """(lock-step time, useful work) of one pass over the schedule, from per-branch costs (e.g.
    dot FLOPs): every tick is charged its slowest stage's executed branch, as `lockstep_flops`
    reads it from a compiled program, but with the costs given instead of read.

    Args:
      fwd, bwd: one stage's forward and whole backward of one microbatch (gpipe / interleaved:
        of all its chunks, each tick runs 1/v of them on every stage, idle ones too).
      b_input, b_weight: zb's input- and weight-gradient passes.
      head: the head and loss forward of one microbatch (their backward costs 2×), run by the
        last stage of 1f1b and zb (gpipe and interleaved run it outside the ticks).
    """
    actions = executed_actions(sched)
    if actions is None:  # every stage runs every tick: the forward ticks, then their mirror
        v, half = sched.virtual_stages, sched.ticks // 2
        busy = int(np.sum(sched.action[:half] != IDLE))
        return half * (fwd + bwd) / v, busy * (fwd + bwd) / v
    costs = schedule_spec(sched.name).branch_costs(fwd, bwd, b_input, b_weight, head)
    per_entry = np.asarray(costs)[actions]
    return float(per_entry.max(axis=1).sum()), float(per_entry.sum())


def lockstep_flops(hlo_text: str, sched: Schedule) -> dict[str, Any]:
    """What a lock-step pipeline step costs one device, from its compiled HLO.

    All stages advance together, so a tick lasts as long as the slowest stage's work in it: for a
    switching schedule (1f1b, zb) each tick is charged the largest FLOPs of the branches its stages
    take (the branch FLOPs read from the conditional's branch computations, nested loops times
    their trip counts); gpipe and interleaved run one tick body on every stage. Work outside the
    tick loop (embedding, head, optimizer) counts once. Only `dot` FLOPs are counted.

    Returns:
      `lockstep_flops` per device per step, and `branch_flops` (FLOPs of each switch branch,
      idle first) for a switching schedule.
    """
    walk = LockStep(hlo_cost.parse_module(hlo_text), executed_actions(sched))
    total = walk.comp(walk.module.entry)
    out: dict[str, Any] = {"lockstep_flops": total}
    if walk.branches is not None:
        out["branch_flops"] = walk.branches
    elif walk.actions is not None:
        raise ValueError(f"{sched.name}: no per-tick switch found in the compiled program")
    return out


def branch_counts(hlo_text: str, sched: Schedule, opcode: str) -> list[float]:
    """How many `opcode` instructions (e.g. "all-reduce") each branch of a switching schedule's
    per-tick switch executes (nested loops times their trip counts), idle branch first."""
    count = lambda inst, c: 1.0 if inst.opcode in (opcode, f"{opcode}-start") else 0.0
    walk = LockStep(hlo_cost.parse_module(hlo_text), executed_actions(sched), count)
    walk.comp(walk.module.entry)
    if walk.branches is None:
        raise ValueError(f"{sched.name}: no per-tick switch found in the compiled program")
    return walk.branches


def useful_flops(stages: Stages, params: Any, batch: Mapping[str, Any], dtype: Any = None) -> float:
    """Dot FLOPs of the same model's loss and gradient on one device without a pipeline or remat
    (embedding, the stacked layers in a scan, head and loss), from its lowered HLO: the work an
    ideal pipeline would split evenly over the devices.

    Args:
      params, batch: shapes (anything with `.shape` and `.dtype`), global.
      dtype: the compute dtype (`train.compute_dtype`), None to keep the parameters' dtypes.
    """
    plain = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)

    def loss(params, batch):
        if dtype is not None:
            params = microbatch.cast_floating(params, dtype)
        embed, layers, head = stages.split(params)
        x = stages.embed(embed, batch["inputs"])
        x, stats = api.stage_layers(stages, layers, x)
        aux = stages.aux_loss(stats)[0] if stats else 0.0
        return stages.head_loss(head, x, batch["targets"]) + aux

    text = jax.jit(jax.value_and_grad(loss)).lower(plain(params), plain(batch)).as_text("hlo")
    walk = LockStep(hlo_cost.parse_module(text), None)
    return walk.comp(walk.module.entry)


def cost(hlo_text: str, sched: Schedule, useful: float, devices: int) -> dict[str, Any]:
    """The layout record's pipeline cost: lock-step FLOPs per device per step (`lockstep_flops`),
    the ideal (`ideal_flops` = useful FLOPs / devices) and their ratio (`lockstep_vs_ideal`, 1.0
    for a pipeline without bubble, recompute or imbalance)."""
    out = lockstep_flops(hlo_text, sched)
    out["ideal_flops"] = useful / devices
    out["lockstep_vs_ideal"] = out["lockstep_flops"] / out["ideal_flops"]
    return out


def step_cost(engine, compiled) -> dict[str, Any]:
    """`cost` of a compiled train step of `engine` (a `train.Engine` with a schedule), for the
    layout record; the useful FLOPs come from the step's own argument shapes."""
    (state, batch), _ = compiled.args_info
    useful = useful_flops(engine.stages, state["params"], batch, engine.config.train.compute_dtype)
    return cost(compiled.as_text(), engine.schedule, useful, engine.mesh.size)
