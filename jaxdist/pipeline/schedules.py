"""The schedule tables: which stage does what at each tick, built in numpy before tracing.

A schedule over p stages (the `pipeline` mesh axis) and m microbatches is a `Schedule`: for each
tick and stage, an action (idle, forward, backward, ...) and the microbatch (and virtual stage) it
works on. The executors (`executors.py`) read their stage's row at every tick; `Schedule`'s
bubble and lock-step counts read the same tables. This module holds the looped tables (gpipe,
interleaved) and 1f1b's; zb's, searched, are in `zb_search.py`; which name builds which table is
the registry's (`spec.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

AXIS = "pipeline"  # the mesh axis the stages run over: p is its size
IDLE, FWD, BWD, WGT = 0, 1, 2, 3  # WGT: zb's deferred weight-gradient pass
FWD_BWD = 4  # 1f1b's fused tick: the backward of `micro_b` and the forward of `micro`


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which stage does what at each tick, as the executors run it.

    Attributes:
      name: the `pipeline.schedule` it was built for (a `spec.SCHEDULES` name).
      stages: p, the size of the `pipeline` mesh axis.
      microbatches: m.
      virtual_stages: v, layer chunks per device (1 unless its spec is `virtual`).
      action: int8 [ticks, p]: IDLE, FWD, BWD, (zb) WGT or (1f1b) FWD_BWD for every tick and
        stage, forward and backward ticks together (for gpipe/interleaved the backward ticks are
        the autodiff mirror of the forward; zb's BWD is the input-gradient pass and WGT the
        weight-gradient pass; FWD_BWD runs a backward and a forward in one tick).
      micro: int32 [ticks, p]: the microbatch of that action (of the forward in a FWD_BWD; 0 when
        idle).
      virtual: int32 [ticks, p]: the virtual stage (layer chunk on that device) of that action.
      micro_b: int32 [ticks, p]: the backward's microbatch in a FWD_BWD tick (None: no such ticks).
      backward_units: what a BWD entry costs in units of a stage's forward: 2 for the whole
        backward, 1 for a split backward's input-gradient pass (zb).
      stashes: the residual buffers the schedule's explicit-backward executor keeps between two
        of a microbatch's ticks: name -> (the action that writes them, the action that reads
        them, last stage only); `ScheduleSpec.build` sets them from its spec. Empty for the
        autodiff schedules.
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    action: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    micro_b: np.ndarray | None = None
    backward_units: float = 2.0
    stashes: Mapping[str, tuple[int, int, bool]] = dataclasses.field(default_factory=dict)

    @property
    def ticks(self) -> int:
        return int(self.action.shape[0])

    def forward_ticks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(valid, micro, virtual), [ticks / 2, p]: the forward ticks of a schedule whose backward
        is their autodiff (the table's first half; the second is their mirror), as
        `executors.looped_forward` runs them: one ring shift per tick carries a microbatch from
        stage s to s + 1 (from p - 1 to 0 at the next virtual stage)."""
        half = self.ticks // 2
        action = self.action[:half]
        if np.any((action != IDLE) & (action != FWD)):
            raise ValueError(f"{self.name}: its table's first half is not forward ticks")
        return action == FWD, self.micro[:half], self.virtual[:half]

    def cells(self, t: int, s: int) -> list[tuple[int, int, int]]:
        """The (action, microbatch, virtual stage) units stage s runs at tick t, in order: none
        when idle, two for a FWD_BWD tick (its backward, then its forward; on the last stage the
        forward and backward of one microbatch)."""
        a, i, c = int(self.action[t, s]), int(self.micro[t, s]), int(self.virtual[t, s])
        if a == IDLE:
            return []
        if a != FWD_BWD:
            return [(a, i, c)]
        j = int(self.micro_b[t, s])
        return [(FWD, i, c), (BWD, j, c)] if i == j else [(BWD, j, c), (FWD, i, c)]

    def unit_costs(self) -> np.ndarray:
        """float [ticks, p]: the work of each entry in units of a stage's forward: F 1, B 2 (the
        whole backward, `backward_units`), FWD_BWD 3; zb's B (input gradient) and W (weight
        gradient) 1 each, as its table assumes; an interleaved entry runs one of the v chunks
        (1/v of that)."""
        units = {IDLE: 0.0, FWD: 1.0, BWD: self.backward_units, WGT: 1.0}
        units[FWD_BWD] = 3.0
        per_chunk = np.vectorize(units.__getitem__, otypes=[float])(self.action)
        return per_chunk / self.virtual_stages  # an interleaved tick runs 1/v of the stage

    def lockstep_units(self) -> float:
        """Sum over ticks of the slowest stage's work (`unit_costs`): the time of a lock-step
        program whose ticks each last as long as their busiest stage (gpipe: 3(m + p - 1))."""
        return float(self.unit_costs().max(axis=1).sum())

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the lock-step time: 1 - work / (p · `lockstep_units`), counted from the
        tables the executors run. (p-1)/(m+p-1) for gpipe; for schedules whose ticks all cost the
        same (zb) it is the share of idle entries."""
        return float(1 - self.unit_costs().sum() / (self.stages * self.lockstep_units()))

    def max_in_flight(self) -> int:
        """Most microbatches any stage has forwarded but not yet backwarded at once (after each
        tick; a FWD_BWD tick frees its backward's microbatch before its forward's is stashed)."""
        worst = 0
        for s in range(self.stages):
            live: set[tuple[int, int]] = set()
            for t in range(self.ticks):
                for a, i, c in self.cells(t, s):
                    if a == FWD:
                        live.add((i, c))
                    elif a == BWD:
                        live.discard((i, c))
                worst = max(worst, len(live))
        return worst

    def describe(self) -> dict[str, Any]:
        return {
            "schedule": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction,
            "lockstep_units": self.lockstep_units(),
        }

    def render(self) -> str:
        """The table as text, one row per stage: `F3` forward of microbatch 3, `B3` backward (zb: its
        input gradient), `W3` zb's weight gradient, `B0F4` a fused tick (1f1b), `.` idle
        (interleaved adds the virtual stage: `F3.1`)."""
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.ticks):
                cell = "".join(f"{'FBW'[a - 1]}{i}" for a, i, _ in self.cells(t, s)) or "."
                if self.virtual_stages > 1 and cell != ".":
                    cell += f".{int(self.virtual[t, s])}"
                cells.append(cell)
            width = max(len(c) for c in cells)
            rows.append(f"stage {s}: " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(rows)


def looped_forward_table(p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward ticks of the looped schedule (gpipe when v = 1): (valid, micro, virtual), [ticks, p].

    Device d at tick t works on k = t - d: group g = k // (v·p) of p microbatches, virtual stage
    s = (k mod v·p) // p, microbatch g·p + k mod p. A microbatch leaves device p-1 at virtual
    stage s and enters device 0 at s+1 on the next tick, so one ring shift per tick carries it.
    """
    if v > 1 and m % p:  # (config checks refuse it first: `spec.microbatches_in_groups`)
        raise ValueError(f"looped table: m={m} microbatches is not a multiple of p={p} stages")
    ticks = v * m + p - 1
    t = np.arange(ticks)[:, None]
    d = np.arange(p)[None, :]
    k = t - d
    valid = (k >= 0) & (k < v * m)
    k = np.where(valid, k, 0)
    group, r = k // (v * p), k % (v * p)
    virtual = np.where(valid, r // p, 0).astype(np.int32)
    micro = np.where(valid, group * p + r % p, 0).astype(np.int32)
    if v == 1:  # no groups needed: microbatch k at tick d + k (also for m not a multiple of p)
        micro = np.where(valid, k, 0).astype(np.int32)
    return valid, micro, virtual


# 1f1b: how many more microbatches than p a stage may hold between its forward and its backward.
# In lock-step, a fused tick (one backward + one forward, 3 units) makes every hop of a round trip
# cost 3 units, so stage 0 needs more than p microbatches in flight to keep busy: with exactly p the
# best lock-step schedule of all (an exhaustive search over tick assignments with F = 1, B = 2 units)
# costs 1.28× gpipe's at p = 4, m = 32; with p + 1, 1.13× (this greedy table: 1.17×).
ONE_F_ONE_B_EXTRA_IN_FLIGHT = 1


def one_f_one_b_table(
    p: int, m: int, extra: int = ONE_F_ONE_B_EXTRA_IN_FLIGHT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1F1B for a lock-step program: (action, micro, micro_b), [ticks, p], simulated in unit time.

    Every tick lasts as long as its busiest stage, so 1F1B's alternating F and B ticks would make
    each steady-state microbatch cost two backward-long ticks (4 units against gpipe's 1 + 2).
    Here a stage runs in one tick the backward of its oldest in-flight microbatch if its gradient
    has arrived AND the forward of its next one if its input has arrived and fewer than
    `p + extra` microbatches are then in flight (FWD_BWD, 3 units), so the steady state costs
    ~3 units per microbatch, the warm-up F-only ticks 1 and the drain B-only ticks 2. The last
    stage runs a microbatch's forward and backward (with head and loss) in the same tick. A
    result sent at tick t is usable at tick t + 1.
    """
    f_done = np.full((p, m), -1)  # tick at which F(s, i) ran
    b_done = np.full((p, m), -1)
    nf, nb = [0] * p, [0] * p  # next microbatch to forward / backward, per stage
    actions, micros, micros_b = [], [], []
    t = 0
    while min(nb) < m:
        act_row, mic_row, mb_row = (
            np.zeros(p, np.int8),
            np.zeros(p, np.int32),
            np.zeros(p, np.int32),
        )
        for s in range(p):
            i = nb[s]
            if s < p - 1 and i < nf[s] and 0 <= b_done[s + 1, i] < t:
                act_row[s], mb_row[s] = BWD, i
                b_done[s, i] = t
                nb[s] += 1
            i = nf[s]
            if i < m and (s == 0 or 0 <= f_done[s - 1, i] < t) and nf[s] - nb[s] < p + extra:
                fused = act_row[s] == BWD or s == p - 1
                act_row[s], mic_row[s] = (FWD_BWD if fused else FWD), i
                f_done[s, i] = t
                nf[s] += 1
                if s == p - 1:  # the last stage: forward, loss and backward of i in one tick
                    mb_row[s], b_done[s, i] = i, t
                    nb[s] += 1
            if act_row[s] == BWD:  # a backward alone: its microbatch is the forward's too
                mic_row[s] = mb_row[s]
        actions.append(act_row)
        micros.append(mic_row)
        micros_b.append(mb_row)
        t += 1
        if t > 4 * (m + p) + 8:  # the simulation is a finite state machine; this never fires
            raise AssertionError(f"1f1b table did not finish for p={p}, m={m}")
    return np.stack(actions), np.stack(micros), np.stack(micros_b)


def looped_tables(name: str) -> Callable[[int, int, int], Schedule]:
    """gpipe (v = 1) / interleaved: the looped forward ticks, then their autodiff mirror."""

    def tables(p: int, m: int, v: int) -> Schedule:
        valid, micro, virtual = looped_forward_table(p, m, v)
        fwd = np.where(valid, FWD, IDLE).astype(np.int8)
        bwd = np.where(valid, BWD, IDLE).astype(np.int8)[::-1]  # autodiff runs the ticks in reverse
        return Schedule(
            name,
            p,
            m,
            v,
            np.concatenate([fwd, bwd]),
            np.concatenate([micro, micro[::-1]]),
            np.concatenate([virtual, virtual[::-1]]),
        )

    return tables


def one_f_one_b_tables(p: int, m: int, v: int) -> Schedule:
    """1f1b: `one_f_one_b_table`, one layer chunk per device."""
    del v  # one layer chunk per device
    action, micro, micro_b = one_f_one_b_table(p, m)
    return Schedule("1f1b", p, m, 1, action, micro, np.zeros_like(micro), micro_b)
