"""Pipeline parallelism for any model with `Stages`: stages over the `pipeline` mesh axis.

The pipeline knows a model only through its `models.api.Stages`: an embedding (inputs →
activations), stacked layers applied by a pure `block(layer_params, x)`, and a head with its loss;
it never imports a model family or reads a parameter name. The stacked layer parameters (leading `layers` axis, stored split over `pipeline` by the logical-axis
table) are cut into `p · v` chunks of `L / (p · v)` layers; chunk `j` runs on device `j mod p`
(`v = pipeline.virtual_stages` for `interleaved`, 1 otherwise). Activations move between
neighbouring stages with `jax.lax.ppermute` inside one `jax.shard_map` that is manual over
`pipeline` (and `data` when it is > 1, so each replica accumulates its own gradients over the
microbatches and they are all-reduced once per step, not once per tick; `context` and `expert`
when > 1, so attention and MoE layers run their per-device bodies, models/attention.py and
models/moe.py); `fsdp` and `tensor` stay automatic inside the stage body, so the same `block` code
runs with its FSDP and Megatron shardings. A block may also return statistics
(`Stages.aux_zero`, the MoE router's): the executors sum them over layers and microbatches and
add their `Stages.aux_loss` term to the loss.

Every schedule (`SCHEDULES`, the one registry of `pipeline.schedule` names) is a table, built here
in numpy before tracing: for each tick and stage, which
microbatch (and virtual stage) it works on, or nothing. The executors read the table row of their
stage at every tick, and `Schedule.bubble_fraction` counts the idle entries of the same tables.

* `gpipe`: all forwards, then all backwards; the backward is JAX's autodiff of the scanned forward
  ticks, so a stage keeps the activations of every microbatch (remat at the stage boundary with
  `train.remat` keeps only each tick's stage input). Bubble (p-1)/(m+p-1).
* `1f1b`: PipeDream-Flush for a lock-step program. Each tick is a `lax.switch` branch per stage,
  so all stages run one SPMD program while doing different work; in the steady state a tick runs
  one backward and one forward (a tick lasts as long as its busiest stage, so separate F and B
  ticks would cost two backward-long ticks per microbatch). A forward runs the stage under
  `jax.vjp` and stashes the residuals (what `train.remat` lets a layer keep) of at most p + 1
  microbatches; the backward applies the stashed vjp, so it recomputes nothing and activation
  memory does not grow with `m`. The last stage runs forward, head, loss and backward of a
  microbatch in one tick. Lock-step cost 3(m + p - 1) units at best (gpipe's).
* `interleaved`: the looped (circular) schedule over `v` chunks per device: microbatches enter in
  groups of `p`, each loops `v` times around the ring. Backward by autodiff as for gpipe. Bubble
  (p-1)/(v·m+p-1); needs `m` to be a multiple of `p`. Its stacked layers are stored in looped order
  (`layer_order`), so no layer crosses devices per step; checkpoints keep the [L] order.
* `zb`: ZB-H1 (Qi et al. 2023): 1F1B's executor with the backward cut into the input-gradient
  pass B and the weight-gradient pass W (`_SplitVjp`), the W passes deferred into what would be
  bubble ticks and run by all stages together (W ticks), at most p microbatches between a
  stage's F and W.

The embedding (all schedules) and, for gpipe/interleaved, the head and loss stay
outside the stage loop: they are computed SPMD over the whole batch, with the batch additionally
split over the `pipeline` axis when it divides, so every device does 1/(data·fsdp·pipeline) of
them and no stage carries extra work. The price is moving the activations ([B, T, D]) into the
pipeline once and out once per step. 1f1b computes head and loss inside the schedule on the last
stage instead (zb too): its backward must start as soon as a microbatch leaves, and collecting all
`m` outputs first would bring back the memory that grows with `m`. Both keep the embedded batch
in blocks of m/p microbatches over the stages (when p divides m); two conveyors of fixed-pair
permutes, run on every tick, bring each to stage 0 as it is needed and its gradient back
(`_feed_tables`).

The table bubble counts idle entries as if every tick cost the same; `cost` reads what the compiled
step executes instead: the lock-step FLOPs (per tick, the slowest stage's branch) against the ideal.
Evaluation (`make_loss`) runs the looped forward ticks, so no device gathers the layer stack.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import aligned_switch, hlo_cost, microbatch, sharding
from jaxdist.errors import ConfigError
from models import api
from models.api import Stages

AXIS = "pipeline"
_EXPERT = "expert"  # MoE experts' axis: manual in the stages' shard_map when > 1
_CONTEXT = "context"  # the sequence axis: manual in the stages' shard_map when > 1
IDLE, FWD, BWD, WGT = 0, 1, 2, 3  # WGT: zb's deferred weight-gradient pass
FWD_BWD = 4  # 1f1b's fused tick: the backward of `micro_b` and the forward of `micro`
_WEIGHTS = "pipeline_stage_weights"  # checkpoint name of a tick's selected stage weights

# --------------------------------------------------------------------------------------------------
# Schedule tables
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which stage does what at each tick, as the executors run it.

    Attributes:
      name: `gpipe`, `1f1b`, `interleaved` or `zb`.
      stages: p, the size of the `pipeline` mesh axis.
      microbatches: m.
      virtual_stages: v, layer chunks per device (1 unless interleaved).
      action: int8 [ticks, p]: IDLE, FWD, BWD, (zb) WGT or (1f1b) FWD_BWD for every tick and
        stage, forward and backward ticks together (for gpipe/interleaved the backward ticks are
        the autodiff mirror of the forward; zb's BWD is the input-gradient pass and WGT the
        weight-gradient pass; FWD_BWD runs a backward and a forward in one tick).
      micro: int32 [ticks, p]: the microbatch of that action (of the forward in a FWD_BWD; 0 when
        idle).
      virtual: int32 [ticks, p]: the virtual stage (layer chunk on that device) of that action.
      micro_b: int32 [ticks, p]: the backward's microbatch in a FWD_BWD tick (None: no such ticks).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    action: np.ndarray
    micro: np.ndarray
    virtual: np.ndarray
    micro_b: np.ndarray | None = None

    @property
    def ticks(self) -> int:
        return int(self.action.shape[0])

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
        whole backward), FWD_BWD 3; zb's B (input gradient) and W (weight gradient) 1 each, as its
        table assumes; an interleaved entry runs one of the v chunks (1/v of that)."""
        units = {IDLE: 0.0, FWD: 1.0, BWD: 1.0 if self.name == "zb" else 2.0, WGT: 1.0}
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
    if v > 1 and m % p:
        raise ConfigError(
            f"pipeline.microbatches={m} must be a multiple of mesh.pipeline={p} "
            "for the interleaved schedule"
        )
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


# zb: how many more microbatches than p a stage may hold between its forward and its weight-gradient
# pass, on every stage (one SPMD program sizes its stash buffers for the fullest stage, so what
# bounds a device's memory is the largest count on any stage; 1F1B's stage 0 holds p). With p, the
# searched table (`zero_bubble_table`) costs 0.90x gpipe's lock-step cost at p = 4, m = 8 on the
# benchmark's GPT (the greedy one alone: 0.94x; without W ticks, p - s + 1 per stage: 1.00x). With
# p + 1 the search found 0.89x, for a fifth stash slot: 1.08x 1f1b's temp at the benchmark's GPT,
# 1.32x at the tests' tiny GPT (measured with the greedy table; the issue's bound is 1.25x).
ZB_EXTRA_IN_FLIGHT = 0

# The branch costs the zb table search weighs ticks by, in units of a stage's forward: the
# benchmark GPT's compiled branches (docs/PIPELINE.md, `branch_flops` at p = 4: F 117.4 M, B 134.2 M,
# W 100.7 M dot FLOPs; the last stage's F and B add the head and loss, 8.4 M forward, twice that
# backward). They only rank candidate tables; the reported cost is read from the compiled program.
ZB_TICK_COSTS = {FWD: 1.0, BWD: 134.2 / 117.4, WGT: 100.7 / 117.4, "head": 8.4 / 117.4}
_ZB_BEAM = 256  # states kept per tick by the zb table search


def _zb_runnable(p: int, m: int, cap: int, done: tuple) -> list[dict[int, bool]]:
    """Per stage, whether it can run B, F and W at the next tick: B of its oldest forwarded
    microbatch once the gradient has arrived (the last stage: once forwarded), F of its next one
    once its input has arrived and at most `cap` microbatches are then between F and W, W of its
    oldest one past B. `done`: (forwarded, backwarded, weight-passed) counts per stage."""
    nf, nb, nw = done
    return [
        {
            BWD: nb[s] < nf[s] and (s == p - 1 or nb[s + 1] > nb[s]),
            FWD: nf[s] < m and (s == 0 or nf[s - 1] > nf[s]) and nf[s] + 1 - nw[s] <= cap,
            WGT: nw[s] < nb[s],
        }
        for s in range(p)
    ]


def _zb_costs(p: int) -> np.ndarray:
    """float [4, p]: `ZB_TICK_COSTS` per action (IDLE, FWD, BWD, WGT) and stage."""
    costs = np.zeros((4, p))
    for a in (FWD, BWD, WGT):
        costs[a] = ZB_TICK_COSTS[a]
    costs[FWD, p - 1] += ZB_TICK_COSTS["head"]
    costs[BWD, p - 1] += 2 * ZB_TICK_COSTS["head"]
    return costs


def _zb_greedy(p: int, m: int, cap: int) -> list[tuple[int, ...]]:
    """The greedy zb rows (actions per stage and tick): when every stage that can run anything
    can run a W, all of them do (a W tick); otherwise each runs B, else F, else W."""
    done, rows = ((0,) * p,) * 3, []
    while min(done[2]) < m:
        can = _zb_runnable(p, m, cap, done)
        w_tick = any(c[WGT] for c in can) and all(c[WGT] or not (c[BWD] or c[FWD]) for c in can)
        order = (WGT,) if w_tick else (BWD, FWD, WGT)
        rows.append(tuple(next((a for a in order if c[a]), IDLE) for c in can))
        done = _zb_advance(done, rows[-1])
    return rows


def _zb_advance(done: tuple, row: tuple[int, ...]) -> tuple:
    """The (forwarded, backwarded, weight-passed) counts after a tick running `row`."""
    return tuple(
        tuple(n + (a == act) for n, a in zip(counts, row))
        for counts, act in zip(done, (FWD, BWD, WGT))
    )


def _zb_search(p: int, m: int, cap: int, costs: np.ndarray) -> list[tuple[int, ...]]:
    """A beam search over lock-step zb rows, each tick charged its slowest stage (`costs`).

    The rows tried from a state: for each cost ceiling and each priority order of B, F and W,
    every stage runs the first action it can whose cost is within the ceiling (so a tick of W
    passes, or of B and F passes, is not made dearer by one stage's slower pass). States are the
    per-stage counts (the table runs each stage's microbatches in order); the `_ZB_BEAM` with the
    least cost so far plus the largest work any stage has left are kept at every tick."""
    levels = sorted(set(costs[1:].ravel()))
    orders = [(BWD, FWD, WGT), (FWD, BWD, WGT), (WGT, BWD, FWD), (BWD, WGT, FWD), (WGT, FWD, BWD)]
    left = lambda done: max(
        sum((m - done[k][s]) * costs[k + 1, s] for k in range(3)) for s in range(p)
    )
    beam = {((0,) * p,) * 3: (0.0, None)}  # state -> (cost, (previous node, row))
    while any(min(done[2]) < m for done in beam):
        grown: dict = {}
        for done, node in beam.items():
            if min(done[2]) == m:
                grown.setdefault(done, node)
                continue
            can = _zb_runnable(p, m, cap, done)
            rows = {
                tuple(
                    next((a for a in o if c[a] and costs[a, s] <= lvl), IDLE)
                    for s, c in enumerate(can)
                )
                for lvl in levels
                for o in orders
            }
            for row in rows - {(IDLE,) * p}:
                key, cost = (
                    _zb_advance(done, row),
                    node[0] + max(costs[a, s] for s, a in enumerate(row)),
                )
                if key not in grown or cost < grown[key][0]:
                    grown[key] = (cost, (node, row))
        best = sorted(grown, key=lambda k: (grown[k][0] + left(k), k))[:_ZB_BEAM]
        beam = {k: grown[k] for k in best}
    node, rows = min(beam.values(), key=lambda n: n[0]), []
    while node[1] is not None:
        node, row = node[1]
        rows.append(row)
    return rows[::-1]


@functools.lru_cache(maxsize=64)  # the search takes seconds at m = 32; tables are built often
def _zb_rows(p: int, m: int, cap: int) -> tuple[tuple[int, ...], ...]:
    """Of the greedy and the searched zb rows, the cheaper under `ZB_TICK_COSTS` (greedy on a tie)."""
    costs = _zb_costs(p)
    tables = [_zb_greedy(p, m, cap), _zb_search(p, m, cap, costs)]
    price = lambda rows: float(np.take_along_axis(costs, np.asarray(rows), 0).max(1).sum())
    return tuple(min(tables, key=price))


def zero_bubble_table(
    p: int, m: int, extra: int = ZB_EXTRA_IN_FLIGHT
) -> tuple[np.ndarray, np.ndarray]:
    """ZB-H1 ticks (Qi et al. 2023): (action, micro), [ticks, p], searched in numpy.

    The backward is split into B (the input gradient, which the previous stage waits for) and W
    (the weight gradient, which nobody waits for). A stage runs its microbatches' F, B and W each
    in order, B once the gradient has arrived (on the last stage: after its forward), F once the
    input has arrived and while at most `p + extra` microbatches are between their F and their W
    on that stage (1F1B's activation bound), W any tick after B. In a lock-step program a tick
    costs its slowest stage's branch and the passes cost differently (B more than F more than W:
    attention's activation-activation matmuls are all in B), so which passes share a tick
    matters: of the greedy table (`_zb_greedy`, all stages' W passes together in W ticks) and a
    beam search over tick rows (`_zb_search`), the one cheaper under `ZB_TICK_COSTS` is taken.
    """
    rows = np.asarray(_zb_rows(p, m, p + extra), np.int8)
    micro = np.zeros(rows.shape, np.int32)
    for a in (FWD, BWD, WGT):  # each stage's passes of one kind run its microbatches in order
        hit = rows == a
        micro[hit] = (np.cumsum(hit, axis=0) - 1)[hit]
    return rows, micro


def _looped_tables(name: str) -> Callable[[int, int, int], Schedule]:
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


def _one_f_one_b_tables(p: int, m: int, v: int) -> Schedule:
    del v  # one layer chunk per device
    action, micro, micro_b = one_f_one_b_table(p, m)
    return Schedule("1f1b", p, m, 1, action, micro, np.zeros_like(micro), micro_b)


def _zero_bubble_tables(p: int, m: int, v: int) -> Schedule:
    del v  # one layer chunk per device
    action, micro = zero_bubble_table(p, m)
    return Schedule("zb", p, m, 1, action, micro, np.zeros_like(micro))


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One `pipeline.schedule` choice.

    Attributes:
      tables: (p, m, v) -> its `Schedule`.
      virtual: whether it runs `pipeline.virtual_stages` layer chunks per device (else v = 1).
      autodiff_backward: its backward is the autodiff of the looped forward ticks (`_looped_forward`);
        otherwise the table interleaves explicit per-microbatch backwards (`_one_f_one_b`).
      split_backward: the explicit backward is split into input- and weight-gradient passes
        (`_zero_bubble`).
    """

    tables: Callable[[int, int, int], Schedule]
    virtual: bool
    autodiff_backward: bool
    split_backward: bool = False


# The schedules by `pipeline.schedule`: the one list `config.validate` and the executors read.
SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(_looped_tables("gpipe"), virtual=False, autodiff_backward=True),
    "1f1b": ScheduleKind(_one_f_one_b_tables, virtual=False, autodiff_backward=False),
    "interleaved": ScheduleKind(
        _looped_tables("interleaved"), virtual=True, autodiff_backward=True
    ),
    "zb": ScheduleKind(
        _zero_bubble_tables, virtual=False, autodiff_backward=False, split_backward=True
    ),
}


def schedule_kind(name: str) -> ScheduleKind:
    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline.schedule={name!r} is not valid; choose one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule tables for `name` over p stages, m microbatches, v virtual stages."""
    kind = schedule_kind(name)
    return kind.tables(p, m, v if kind.virtual else 1)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble: (p-1)/(m+p-1), or (p-1)/(v·m+p-1) for interleaved."""
    v = v if schedule_kind(name).virtual else 1
    return (p - 1) / (v * m + p - 1)


# --------------------------------------------------------------------------------------------------
# Config checks
# --------------------------------------------------------------------------------------------------


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
    kind = schedule_kind(pc.schedule)
    _positive("pipeline.microbatches", pc.microbatches)
    _positive("pipeline.virtual_stages", pc.virtual_stages)
    p = int(mesh_shape.get(AXIS, 1))
    if p <= 1:
        return None
    v = pc.virtual_stages if kind.virtual else 1
    m = pc.microbatches
    if mc.num_layers % (p * v):
        raise ConfigError(
            f"model.num_layers={mc.num_layers} must be divisible by "
            f"mesh.pipeline×pipeline.virtual_stages = {p}×{v} = {p * v}"
        )
    # `expert` splits the batch too (the stages' shard_map is manual over it).
    replicas = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) * mesh_shape.get(_EXPERT, 1)
    per_replica, rem = divmod(t.batch_size, replicas * t.grad_accum)
    if rem or per_replica % m:
        raise ConfigError(
            f"pipeline.microbatches={m} must divide the per-replica batch "
            f"{t.batch_size}/(data×fsdp×expert×grad_accum = {replicas * t.grad_accum}) = "
            f"{t.batch_size / (replicas * t.grad_accum):g}"
        )
    return build_schedule(pc.schedule, p, m, v)  # (the tables check what only they know)


def schedule_for(config, mesh: Mesh) -> Schedule | None:
    """The schedule a build with this config and mesh runs, or None without pipelining."""
    return check(config, {k: int(s) for k, s in mesh.shape.items()})


def bubble_fraction(config, mesh: Mesh) -> float | None:
    """Bubble fraction of the schedule that `train.build` runs for this config, None if p = 1."""
    sched = schedule_for(config, mesh)
    return None if sched is None else sched.bubble_fraction


def layer_order(config, mesh_shape: Mapping[str, int]) -> np.ndarray | None:
    """Which layer each stored row of the stacked layers holds, or None for the identity.

    The stacked layers are stored split over `pipeline` in contiguous blocks. For the looped
    (interleaved) schedule device d runs chunks d, p + d, 2p + d, ...; storing the rows in that
    order (like MaxText's `circular_repeats`: [p, v, Lc] = device, lap, layer within the chunk)
    gives each device its own chunks with no per-step exchange. Row r of the store holds layer
    `order[r]`; checkpoints, exports and `train.init_from` keep the user's [L] order (the engine
    reorders at init, save and restore: `reorder_layers`).
    """
    p = int(mesh_shape.get(AXIS, 1))
    kind = schedule_kind(config.pipeline.schedule)
    v = int(config.pipeline.virtual_stages) if kind.virtual else 1
    if p <= 1 or v <= 1:
        return None
    lc = int(config.model.num_layers) // (p * v)
    chunks = np.arange(p * v).reshape(v, p).T  # [p, v]: chunk s·p + d on device d, lap s
    return (chunks[..., None] * lc + np.arange(lc)).reshape(-1)


def reorder_layers(tree: Any, shardings: Any, order: np.ndarray | None, *, to_user: bool) -> Any:
    """Stacked-layer leaves of `tree` (any state tree: params, optimizer moments, per-replica
    copies) between the stored order and the user's [L] order (`layer_order`).

    A leaf is a stacked-layer leaf when its storage sharding puts `pipeline` on an axis of length
    `len(order)` (the logical `layers` axis, see sharding.STORAGE_RULES); that axis is permuted.
    """
    if order is None:
        return tree
    index = np.argsort(order) if to_user else order  # user[l] = stored[r] where order[r] = l

    def one(x, sh):
        spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
        for axis, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if AXIS in names and x.shape[axis] == len(order):
                return sharding.constrain_to(jnp.take(x, jnp.asarray(index), axis=axis), sh)
        return x

    return jax.tree.map(one, tree, shardings)


# --------------------------------------------------------------------------------------------------
# Helpers for the SPMD program
# --------------------------------------------------------------------------------------------------


def _varying(x: jax.Array) -> jax.Array:
    """Marks `x` as different on every device of the manual axes (shard_map's vma typing).

    Values made inside the shard_map or passed in replicated start out invariant; mixing them with
    per-stage values needs this cast, and doing it once up front (rather than implicitly inside the
    tick loop) makes autodiff transpose it into one psum after the loop instead of one per tick.
    """
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    aval = jax.typeof(x)
    if hasattr(aval, "manual_axis_type"):  # jax >= 0.10
        varying = aval.manual_axis_type.varying
    else:
        varying = getattr(aval, "vma", frozenset())
    missing = tuple(a for a in manual if a not in varying)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # jax releases before pcast


def _outer_rules(per_replica_rows: int, p: int) -> sharding.Rules:
    """Compute rules for embedding and head: the batch split over the pipeline axis too, if it fits."""
    if per_replica_rows % p:
        return sharding.COMPUTE_RULES
    return tuple(
        (n, ("data", "fsdp", _EXPERT, AXIS)) if n == "batch" else (n, a)
        for n, a in sharding.COMPUTE_RULES
    )


def _take(x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(buf: jax.Array, i: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """buf[i] = value where `when`, else unchanged (one dynamic-update-slice)."""
    value = jnp.where(when, value, _take(buf, i))
    return jax.lax.dynamic_update_index_in_dim(buf, value, i, 0)


# --------------------------------------------------------------------------------------------------
# Executors (run inside shard_map, manual over `pipeline` and, when it is > 1, `data`)
# --------------------------------------------------------------------------------------------------


def _looped_forward(stage_fn, chunks, x0, *, p: int, v: int, valid, micro, virtual):
    """Forward ticks of gpipe / interleaved on one stage; returns [m, ...] final activations.

    Args:
      stage_fn: (chunks [v, Lc, ...], virtual stage, x [b, T, D]) -> (y, the blocks'
        statistics) (`looped_stage_fn`).
      chunks: this device's chunks, every leaf [v, Lc, ...] (float32: cast per tick, so autodiff
        accumulates their gradients over the ticks in float32).
      x0: [m, b, T, D] embedded microbatches (the same on every stage; stage 0 reads them).
      valid, micro, virtual: the [ticks, p] tables of `looped_forward_table`.
    Returns:
      ([m, b, T, D]: on the last stage the outputs of the last layer chunk, zeros elsewhere;
      this device's statistics summed over its layers and microbatches).
    """
    d = jax.lax.axis_index(AXIS)
    ring = [(s, (s + 1) % p) for s in range(p)]
    dtype = x0.dtype
    chunks = jax.tree.map(_varying, chunks)  # gradients summed over `data` once, after the loop
    # x0's gradient is summed over the stages once, after the loop, in float32 (XLA:CPU's
    # all-reduce promotion aborts on this bfloat16 psum).
    x0 = _varying(x0.astype(jnp.float32))
    zero = _varying(jnp.zeros(x0.shape[1:], dtype))
    outs = _varying(jnp.zeros(x0.shape, dtype))
    # The statistics' zeros, shaped like a stage call's (traced for its shapes only).
    shapes = jax.eval_shape(lambda: stage_fn(chunks, 0, zero)[1])
    stats = jax.tree.map(lambda a: _varying(jnp.zeros(a.shape, a.dtype)), shapes)

    def tick(carry, row):
        recv, outs, stats = carry
        ok, i, s = row[0][d], row[1][d], row[2][d]
        x = jnp.where((d == 0) & (s == 0), _take(x0, i).astype(dtype), recv)  # [b, T, D]
        y, new = stage_fn(chunks, s, x)
        outs = _put(outs, i, y, ok & (d == p - 1) & (s == v - 1))
        stats = jax.tree.map(lambda a, b: a + jnp.where(ok, b, 0), stats, new)
        return (jax.lax.ppermute(y, AXIS, ring), outs, stats), None

    rows = (jnp.asarray(valid), jnp.asarray(micro), jnp.asarray(virtual))
    (_, outs, stats), _ = jax.lax.scan(tick, (zero, outs, stats), rows)
    return outs, stats


class _StashedVjp:
    """`jax.vjp` split across ticks: the forward tick keeps the residuals, a later tick applies
    the backward to them, without running the forward again.

    The residuals are the leaves of the vjp function (`jax.vjp` returns a pytree). Those that are
    one of the `fixed` arrays (the stage weights, which every tick has anyway) are not stashed but
    passed again to the backward; those computed from the `fixed` arrays alone (the per-layer
    weight slices a scan over the layers stacks back, the causal mask) are the same for every
    microbatch, so they are kept once (`invariant`), not per microbatch. What else a residual
    holds is decided by the remat policy of the function (`train.remat`): activations for
    `none`, the layer inputs for `full`.
    """

    def __init__(self):
        self.tree = None
        # per vjp leaf: index into `fixed` + `invariant`, or -1 = stashed per microbatch
        self.where: list[int] | None = None

    def forward(self, fn, fixed: list, *args):
        """(fn(*args), residual leaves stashed per microbatch, invariant residual leaves)."""
        out, vjp = jax.vjp(fn, *args)
        leaves, tree = jax.tree.flatten(vjp)
        ids = {id(f): k for k, f in enumerate(fixed)}
        if self.where is None:
            invariant = _fixed_only(fn, fixed, args)
        else:
            invariant = [w >= len(fixed) for w in self.where]
        where, n_inv = [], len(fixed)
        for leaf, inv in zip(leaves, invariant):
            if id(leaf) in ids:
                where.append(ids[id(leaf)])
            elif inv:
                where.append(n_inv)
                n_inv += 1
            else:
                where.append(-1)
        if self.where is not None and where != self.where:
            raise AssertionError("stashed vjp: residual layout differs between traces")
        self.tree, self.where = tree, where
        # Varying over every manual axis, as the stash buffers: a residual such as the context
        # shard's index varies over `context` only.
        pick = lambda keep: [_varying(leaf) for leaf, w in zip(leaves, where) if keep(w)]
        return out, pick(lambda w: w < 0), pick(lambda w: w >= len(fixed))

    def backward(self, fixed: list, stashed: list, cotangent):
        """The input cotangents of `forward`'s args, from its stashed residuals; `fixed`: the
        forward's `fixed` followed by its invariant residuals."""
        rest = iter(stashed)
        leaves = [fixed[w] if w >= 0 else next(rest) for w in self.where]
        return jax.tree.unflatten(self.tree, leaves)(cotangent)


def _fixed_only(fn, fixed: list, args: tuple) -> list[bool]:
    """Per leaf of `jax.vjp(fn, *args)`'s residuals: whether it is computed from the `fixed`
    leaves of `args` alone (JAX's partial evaluation with the other leaves unknown: a scan's
    outputs are told apart per output)."""
    from jax._src.interpreters import partial_eval as pe

    flat, in_tree = jax.tree.flatten(args)
    residuals = lambda *flat: jax.tree.leaves(jax.vjp(fn, *jax.tree.unflatten(in_tree, flat))[1])
    closed = jax.make_jaxpr(residuals)(*flat)
    ids = {id(f) for f in fixed}
    _, _, unknown, _ = pe.partial_eval_jaxpr_nounits(
        closed, [id(a) not in ids for a in flat], False
    )
    return [not u for u in unknown]


class _SplitVjp(_StashedVjp):
    """A stashed vjp whose backward is cut in two (zb): `backward_input` computes the input
    cotangent and what the weight gradient needs from the cotangent path (the cotangents at the
    outputs of the weight-using ops); `backward_weight`, on any later tick, the weight gradient.

    The cut is made on the backward's jaxpr, traced once: the residuals that the input cotangent
    does not need (the inputs of the weight matmuls) are marked unknown, and JAX's partial
    evaluation moves the equations that depend on them, and only those, into the second part
    (scans, the stacked layers, are split per iteration). Nothing is computed twice. With a remat
    policy that keeps only the layer inputs (`full`) no residual is weight-only: the weight
    gradient then stays in the first part and the second is empty.
    """

    def __init__(self):
        super().__init__()
        self.cut: dict[str, Any] | None = None

    def forward(self, fn, fixed: list, *args):
        """(fn(*args), residuals for the input pass, residuals only the weight pass reads,
        invariant residuals (`_StashedVjp`; the passes take `fixed` followed by them))."""
        out, stashed, invariant = super().forward(fn, fixed, *args)
        if self.cut is None:
            self._make_cut(fixed + invariant, stashed, out)
        only = self.cut["weight_only"][len(fixed) + len(invariant) :]
        return (
            out,
            [r for r, w in zip(stashed, only) if not w],
            [r for r, w in zip(stashed, only) if w],
            invariant,
        )

    def _make_cut(self, fixed: list, stashed: list, out) -> None:
        from jax._src.interpreters import partial_eval as pe

        def bwd(fixed, stashed, dy):
            return _StashedVjp.backward(self, fixed, stashed, dy)

        closed, shape = jax.make_jaxpr(bwd, return_shape=True)(fixed, stashed, out)
        n_in, n_dy = len(fixed) + len(stashed), len(jax.tree.leaves(out))
        assert len(closed.jaxpr.invars) == n_in + n_dy, "split vjp: unexpected backward inputs"
        n_out = len(closed.jaxpr.outvars)
        n_dx = len(jax.tree.leaves(shape[1:]))
        used_for_dx = [False] * (n_out - n_dx) + [True] * n_dx
        _, used_in = pe.dce_jaxpr(closed.jaxpr, used_for_dx)
        weight_only = [not u for u in used_in[:n_in]]
        known, unknown, out_unknown, res = pe.partial_eval_jaxpr_nounits(
            closed, weight_only + [False] * n_dy, False
        )
        assert not any(out_unknown[n_out - n_dx :]), "split vjp: the input cotangent was cut"
        self.cut = dict(
            known=known,
            unknown=unknown,
            weight_only=weight_only,
            out_unknown=out_unknown[: n_out - n_dx],
            dx_tree=jax.tree.structure(shape[1:]),
            n_res=len(res),
        )

    def backward_input(self, fixed: list, for_input: list, cotangent):
        """(the input cotangents (a tuple, one per `forward` arg after the first), the weight
        gradient's leaves computed here (None where the weight pass computes them), residuals
        for the weight pass)."""
        cut = self.cut
        known_fixed = [f for f, w in zip(fixed, cut["weight_only"]) if not w]
        outs = jax.extend.core.jaxpr_as_fun(cut["known"])(
            *known_fixed, *for_input, *jax.tree.leaves(cotangent)
        )
        outs, res = outs[: len(outs) - cut["n_res"]], outs[len(outs) - cut["n_res"] :]
        n_dw = len(cut["out_unknown"])
        n_known_dw = n_dw - sum(cut["out_unknown"])
        it = iter(outs[:n_known_dw])
        dw = [None if u else next(it) for u in cut["out_unknown"]]
        dx = jax.tree.unflatten(cut["dx_tree"], outs[n_known_dw:])
        return dx, dw, list(res)

    def backward_weight(self, fixed: list, weight_only: list, res: list) -> list:
        """The weight gradient's leaves that `backward_input` left out (None for the others)."""
        cut = self.cut
        only_fixed = [f for f, w in zip(fixed, cut["weight_only"]) if w]
        outs = iter(jax.extend.core.jaxpr_as_fun(cut["unknown"])(*res, *only_fixed, *weight_only))
        return [next(outs) if u else None for u in cut["out_unknown"]]


# Branches of the 1f1b tick switch (FB: a backward and a forward in one tick; LAST: the last
# stage's forward, head, loss and backward of one microbatch) and of zb's (the last stage's F and
# B carry head and loss; its W is the others').
F1B1, F1B1_LAST = 3, 4
ZB_F_LAST, ZB_B_LAST = 4, 5


def _accumulate(acc: Any, grads: Any) -> Any:
    """acc + grads in float32; `grads` is a tree like `acc` or a list of its leaves with None
    where nothing was computed (zb's split backward)."""
    flat, tree = jax.tree.flatten(acc)
    new = grads if isinstance(grads, list) else jax.tree.leaves(grads)
    out = [a if g is None else a + g.astype(jnp.float32) for a, g in zip(flat, new, strict=True)]
    return jax.tree.unflatten(tree, out)


def _convey(buf: jax.Array, recv: jax.Array, value: jax.Array, step: int) -> jax.Array:
    """One conveyor step (`_feed_tables`): every stage sends `value` to stage + `step` with one
    collective-permute of fixed pairs, run on every tick by every stage (never in a branch: a
    `lax.switch` whose branches permute over different pairs computed wrong values when XLA:CPU
    loaded the program from the persistent compilation cache); buf[recv] = the arrival where
    `recv` >= 0, the other arrivals (nothing was sent for them) dropped."""
    p = jax.lax.axis_size(AXIS)
    pairs = [(k, k + step) for k in range(p) if 0 <= k + step < p]
    got = jax.lax.ppermute(value, AXIS, pairs)
    return _put(buf, jnp.maximum(recv, 0), got, recv >= 0)


def _tick_loop(branches, tables, x0, targets, stash, acc):
    """The ticks of an explicit-backward schedule (1f1b, zb) on one stage.

    Every tick each stage takes its `lax.switch` branch from its row of `tables`, given the
    activation it forwards (stage 0: from the embedded input), the gradient it backwards, the
    targets of its forward's microbatch and the stashed residuals the tick reads; then two
    `ppermute`s carry activations up and gradients down, and arrivals go into their slots.

    Args:
      branches: per branch, (x, dy, targets, reads, acc) -> (y, dx, writes, acc); `reads` and
        `writes`: stash name -> one microbatch's residual leaves.
      tables: the executor tables (`exec_tables`) as [ticks, p] arrays.
      x0: the embedded microbatches: [m, b, T, D] on every stage, or, when `tables` has
        `feed_read`, this stage's block [m/p, b, T, D] of them (microbatch i on stage i // (m/p)),
        each carried down to stage 0 by the time it forwards it (`_feed_tables`: fixed-pair
        permutes on every tick, no all-gather).
      targets: [m, b, T].
      stash: stash name -> residual buffers [slots, ...]; acc: the accumulated (chunk gradients,
        head gradients, loss).
    Returns:
      (d loss / d x0, shaped like x0: with `feed_read` each block on its owner, carried up
      from stage 0; else [m, ...] nonzero on stage 0 only; acc).
    """
    p, ticks = tables["action"].shape[1], tables["action"].shape[0]
    d = jax.lax.axis_index(AXIS)
    first = d == 0
    fwd_pairs = [(s, s + 1) for s in range(p - 1)]
    bwd_pairs = [(s + 1, s) for s in range(p - 1)]
    shape, act_dtype = x0.shape[1:], x0.dtype
    zeros = lambda *lead: _varying(jnp.zeros((*lead, *shape), act_dtype))
    slots = tables["slots"]
    blocks = "feed_read" in tables  # x0 / d x0 held in blocks over the stages
    at = lambda k: jnp.maximum(k, 0)
    # With blocks, one buffer holds this stage's block of x0, the conveyors' two transit slots and,
    # as they come back, the block's input gradients, each in the slot its input left
    # (`_feed_tables`). d x0 goes up the conveyor: stage 0 sends the fresh gradient, the others
    # their gradient transit slot.
    per, up = x0.shape[0], x0.shape[0] + 1  # the activations' and the gradients' transit slots
    dx_up = lambda feed, r, dx: _convey(feed, r["dx_recv"], jnp.where(first, dx, feed[up]), 1)

    def tick(carry, row):
        xin, gbuf, stash, feed, dx0, acc = carry
        r = {k: v[d] for k, v in row.items()}
        if blocks:  # feed: x0's block and the transit slot
            x_first = _take(feed, at(r["feed_read"]))
        else:
            x_first = _take(x0, r["mf"])
        x = jnp.where(first, x_first, _take(xin, r["x"]))
        dy, tgt = _take(gbuf, r["g"]), _take(targets, r["mf"])
        # A stash without tables in `r` holds one value (invariant residuals, `_StashedVjp`): slot
        # 0, which every branch returns (the forward computes it, the others pass it on).
        reads = {k: [_take(b, r.get("read_" + k, 0)) for b in bufs] for k, bufs in stash.items()}
        y, dx, writes, acc = aligned_switch.switch(r["action"], branches, x, dy, tgt, reads, acc)
        put = lambda b, v, k: _put(b, at(k), v, k >= 0)
        keep = lambda b, v, k: put(b, v, r["write_" + k]) if "write_" + k in r else v[None]
        stash = {k: [keep(b, v, k) for b, v in zip(bufs, writes[k])] for k, bufs in stash.items()}
        if blocks:  # stage 0's next inputs one stage down, its input gradients one stage up
            down = _take(feed, at(r["feed_send"]))
            feed = _convey(feed, r["feed_recv"], down, -1)
            feed = dx_up(put(feed, dx, r["dx_keep"]), r, dx)
        else:
            dx0 = _put(dx0, r["mb"], dx, first & r["dx0"])
        # Every stage sends every tick (all must join a collective); receivers keep only arrivals.
        xin = put(xin, jax.lax.ppermute(y, AXIS, fwd_pairs), r["recv_f"])
        gbuf = put(gbuf, jax.lax.ppermute(dx, AXIS, bwd_pairs), r["recv_b"])
        return (xin, gbuf, stash, feed, dx0, acc), None

    rows = {k: jnp.asarray(v[:ticks]) for k, v in tables.items() if k != "slots"}
    feed, dx0 = None, zeros(x0.shape[0])
    if blocks:
        feed, dx0 = jnp.concatenate([x0, zeros(2)]), None
    carry = (zeros(slots["x"]), zeros(slots["g"]), stash, feed, dx0, acc)
    (*_, feed, dx0, acc), _ = jax.lax.scan(tick, carry, rows)
    if blocks and len(tables["dx_recv"]) > ticks:  # drain: the last gradients up to their owners
        step = lambda feed, row: (dx_up(feed, {"dx_recv": row[d]}, feed[up]), None)
        feed, _ = jax.lax.scan(step, feed, jnp.asarray(tables["dx_recv"][ticks:]))
    return (feed[:per] if blocks else dx0), acc


def _stage_inputs(chunk, head, x0, dtype):
    """Per-device copies of the stage weights and head in the compute dtype (differentiating with
    respect to them, no vjp inside a tick sums over the manual axes: a collective inside one
    stage's branch would deadlock the others; the sums come once, at the end), the float32
    accumulators, and a zero activation."""
    chunk, head = jax.tree.map(_varying, microbatch.cast_floating((chunk, head), dtype))
    f32_zeros = lambda tree: jax.tree.map(lambda a: _varying(jnp.zeros(a.shape, jnp.float32)), tree)
    acc = (f32_zeros(chunk), f32_zeros(head), _varying(jnp.zeros((), jnp.float32)))
    zero = lambda: _varying(jnp.zeros(x0.shape[1:], x0.dtype))
    return chunk, head, acc, zero


def _buffers(slots: int, leaves: list) -> list:
    """Zero stash buffers [slots, ...] shaped like one microbatch's residual `leaves`."""
    return [_varying(jnp.zeros((slots, *a.shape), a.dtype)) for a in leaves]


def _one_f_one_b(stage_fn, head_loss, chunk, head, x0, targets, *, scale, dtype, tables, aux_term):
    """The 1f1b ticks on one stage: loss, gradients and the gradient of the stage-0 input.

    A forward runs the stage under `jax.vjp` and stashes its residuals (at most p + 1 microbatches
    in flight, `one_f_one_b_table`); a backward applies the stashed vjp to the arriving gradient,
    so it costs about two forwards and recomputes nothing (unless `train.remat` says so). A fused
    tick (F1B1) runs one backward and one forward. The last stage runs forward, head, loss and
    backward of a microbatch in one tick (F1B1_LAST), so it stashes nothing.

    Args:
      stage_fn: (layer params [Lc, ...] in the compute dtype, x [b, T, D]) -> (y, the blocks'
        statistics); their `aux_term` (linear) joins the loss, its gradient the backward.
      head_loss: (head params, y, targets [b, T]) -> mean cross-entropy of the microbatch.
      chunk: this stage's layer params, every leaf [Lc, ...], float32.
      head: the head's params (final norm, projection), float32, the same on every stage.
      x0: [m, b, T, D] embedded microbatches; targets: [m, b, T].
      scale: d loss / d (one microbatch's head_loss) = 1 / (m · data replicas).
      dtype: the compute dtype.
      tables: `exec_tables(schedule)`.
    Returns:
      (loss, chunk gradients, head gradients, d loss / d x0, statistics summed over microbatches),
      not yet summed over the manual axes: head gradients are nonzero on the last stage only,
      d x0 on stage 0 only; float32 gradients.
    """
    chunk, head, acc, zero = _stage_inputs(chunk, head, x0, dtype)
    leaves, stage_vjp = jax.tree.leaves, _StashedVjp()
    # The stash's shapes come from tracing one forward on zeros, which compiles to nothing.
    (_, stats0), r0, c0 = stage_vjp.forward(stage_fn, leaves(chunk), chunk, zero())
    stash = {"r": _buffers(tables["slots"]["r"], r0), "c": _buffers(1, c0)}
    stats0 = jax.tree.map(lambda a: _varying(jnp.zeros_like(a, jnp.float32)), stats0)
    # d loss / d statistics: constant, the aux term being linear in them.
    d_stats = jax.tree.map(_varying, jax.grad(lambda st: scale * aux_term(st))(stats0))
    acc = (acc[0], acc[1], (acc[2], stats0))
    add = lambda loss, stats: (
        (loss[0] + scale * aux_term(stats), jax.tree.map(jnp.add, loss[1], stats))
    )

    def idle(x, dy, tgt, reads, acc):
        return zero(), zero(), reads, acc

    def forward(x, dy, tgt, reads, acc):
        (y, stats), r, c = stage_vjp.forward(stage_fn, leaves(chunk), chunk, x)
        return y, zero(), {"r": r, "c": c}, (acc[0], acc[1], add(acc[2], stats))

    def backward(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        dc, dx = stage_vjp.backward(leaves(chunk) + reads["c"], reads["r"], (dy, d_stats))
        return zero(), dx.astype(x0.dtype), reads, (_accumulate(g_c, dc), g_h, loss)

    def fused(x, dy, tgt, reads, acc):
        _, dx, _, acc = backward(x, dy, tgt, reads, acc)
        y, _, writes, acc = forward(x, dy, tgt, reads, acc)
        return y, dx, writes, acc

    def last(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc

        def fn(ck, hp, x):
            y, stats = stage_fn(ck, x)
            return head_loss(hp, y, tgt), stats

        (mb_loss, stats), vjp = jax.vjp(fn, chunk, head, x)
        dc, dh, dx = vjp((_varying(jnp.float32(scale)), d_stats))
        loss = add((loss[0] + mb_loss * scale, loss[1]), stats)
        acc = (_accumulate(g_c, dc), _accumulate(g_h, dh), loss)
        return zero(), dx.astype(x0.dtype), reads, acc

    dx0, (g_c, g_h, (loss, stats)) = _tick_loop(
        (idle, forward, backward, fused, last), tables, x0, targets, stash, acc
    )
    return loss, g_c, g_h, dx0, stats


def _zero_bubble(stage_fn, head_loss, chunk, head, x0, targets, *, scale, dtype, tables, aux_term):
    """The zb ticks on one stage: the 1f1b executor with the backward cut in two (`_SplitVjp`).

    A forward tick stashes the residuals of the stage's vjp in two stashes: those the input pass
    reads (`b`, freed at B) and those only the weight pass reads (`w`, kept until W). The B tick
    computes the input gradient (sent to the previous stage at once) and stashes what the weight
    gradient needs from the cotangent path (`r`); the W tick, which no other stage waits for,
    computes the weight gradient. The head and loss run on the last stage's F, their residuals
    (`h`) stashed for its B on the next tick. The blocks' statistics (MoE router statistics)
    join the loss at F; their constant cotangent joins B's, as in 1f1b. Args and returns: as
    `_one_f_one_b`.
    """
    chunk, head, acc, zero = _stage_inputs(chunk, head, x0, dtype)
    leaves, stage_vjp, head_vjp = jax.tree.leaves, _SplitVjp(), _StashedVjp()
    head_fn = lambda hp, y, tgt: head_loss(hp, y, tgt)
    out0, rb0, rw0, c0 = stage_vjp.forward(stage_fn, leaves(chunk), chunk, zero())
    _, _, rr0 = stage_vjp.backward_input(leaves(chunk) + c0, rb0, out0)
    _, rh0, hc0 = head_vjp.forward(head_fn, leaves(head), head, zero(), targets[0])
    n = {**tables["slots"], "c": 1, "hc": 1}
    stashes = dict(b=rb0, w=rw0, r=rr0, h=rh0, c=c0, hc=hc0)
    stash = {k: _buffers(n[k], r) for k, r in stashes.items()}
    stats0 = jax.tree.map(lambda a: _varying(jnp.zeros_like(a, jnp.float32)), out0[1])
    # d loss / d statistics: constant, the aux term being linear in them.
    d_stats = jax.tree.map(_varying, jax.grad(lambda st: scale * aux_term(st))(stats0))
    acc = (acc[0], acc[1], (acc[2], stats0))
    add = lambda loss, stats: (
        (loss[0] + scale * aux_term(stats), jax.tree.map(jnp.add, loss[1], stats))
    )

    def idle(x, dy, tgt, reads, acc):
        return zero(), zero(), reads, acc

    def forward(x, dy, tgt, reads, acc):
        (y, stats), rb, rw, c = stage_vjp.forward(stage_fn, leaves(chunk), chunk, x)
        writes = {**reads, "b": rb, "w": rw, "c": c}
        return y, zero(), writes, (acc[0], acc[1], add(acc[2], stats))

    def backward(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        fixed = leaves(chunk) + reads["c"]
        (dx,), dw, rr = stage_vjp.backward_input(fixed, reads["b"], (dy, d_stats))
        return zero(), dx.astype(x0.dtype), {**reads, "r": rr}, (_accumulate(g_c, dw), g_h, loss)

    def weight(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        dw = stage_vjp.backward_weight(leaves(chunk) + reads["c"], reads["w"], reads["r"])
        return zero(), zero(), reads, (_accumulate(g_c, dw), g_h, loss)

    def forward_last(x, dy, tgt, reads, acc):
        y, _, writes, (g_c, g_h, loss) = forward(x, dy, tgt, reads, acc)
        mb_loss, rh, hc = head_vjp.forward(head_fn, leaves(head), head, y, tgt)
        loss = (loss[0] + mb_loss * scale, loss[1])
        return zero(), zero(), {**writes, "h": rh, "hc": hc}, (g_c, g_h, loss)

    def backward_last(x, dy, tgt, reads, acc):
        g_c, g_h, loss = acc
        fixed = leaves(head) + reads["hc"]
        dh, dy, _ = head_vjp.backward(fixed, reads["h"], _varying(jnp.float32(scale)))
        acc = (g_c, _accumulate(g_h, dh), loss)
        return backward(x, dy.astype(x0.dtype), tgt, reads, acc)

    branches = (idle, forward, backward, weight, forward_last, backward_last)
    dx0, (g_c, g_h, (loss, stats)) = _tick_loop(branches, tables, x0, targets, stash, acc)
    return loss, g_c, g_h, dx0, stats


def _looped_gradients(
    stage_fn,
    head_loss,
    aux_term,
    chunks,
    head,
    x0,
    targets,
    *,
    p: int,
    v: int,
    scale: float,
    valid,
    micro,
    virtual,
):
    """gpipe / interleaved with the backward inside the stages' shard_map (see `make_gradients`).

    The forward ticks of `_looped_forward`, the head and mean loss on the last stage, and their
    autodiff (the ticks in reverse), all on one stage. Same contract as `_one_f_one_b`: returns
    (loss, chunk gradients [v, Lc, ...], head gradients, d loss / d x0, statistics), per device
    and not yet summed over the manual axes; `chunks` is this device's [v, Lc, ...], float32.
    The loss is the mean over this replica's rows times `scale` (1 / the replicas the caller
    sums over), plus `aux_term` of this device's statistics averaged over the microbatches.
    """
    d = jax.lax.axis_index(AXIS)
    # Differentiate with respect to per-device copies: the sums over the stages come after.
    chunks, head = jax.tree.map(_varying, (chunks, head))
    x0 = _varying(x0.astype(jnp.float32))
    tgt = targets.reshape(-1, *targets.shape[2:])  # [m·b, T]: microbatch-major, as outs

    def loss_fn(chunks, head, x0):
        outs, stats = _looped_forward(
            stage_fn, chunks, x0, p=p, v=v, valid=valid, micro=micro, virtual=virtual
        )
        y = outs.reshape(-1, *outs.shape[2:])  # [m·b, T, D]
        zero = lambda: _varying(jnp.zeros((), jnp.float32))
        loss = jax.lax.cond(d == p - 1, lambda: scale * head_loss(head, y, tgt), zero)
        return loss + scale * aux_term(stats) / x0.shape[0], stats

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)
    (loss, stats), (g_c, g_h, dx0) = grad_fn(chunks, head, x0)
    return loss, g_c, g_h, dx0, stats


def _slot_counts(spans: Mapping[str, Callable], p: int, m: int, ticks: int) -> dict[str, int]:
    """Per buffer, its number of slots: the widest range of microbatches live in it at once on any
    stage (microbatch i then uses slot i mod that number); checked that microbatches sharing a
    slot are never live together. `spans[name](s, i)`: (the tick whose end writes microbatch i on
    stage s, the tick that reads it), or None when it never enters the buffer."""
    slots = {}
    for name, span in spans.items():
        live = [[span(s, i) for i in range(m)] for s in range(p)]
        live = [[iv if iv is not None and iv[0] < iv[1] else None for iv in row] for row in live]
        need = 1
        for row in live:
            for t in range(ticks):
                now = [i for i, iv in enumerate(row) if iv is not None and iv[0] <= t < iv[1]]
                if now:
                    need = max(need, max(now) - min(now) + 1)
        for s, row in enumerate(live):
            for i in range(m - need):
                a, b = row[i], row[i + need]
                if a is not None and b is not None and b[0] < a[1]:
                    raise AssertionError(f"{name} slot collision on stage {s}: {i}, {i + need}")
        slots[name] = need
    return slots


# The stashes of the explicit-backward schedules: name -> (the action that writes a microbatch's
# residuals, the action that reads them, last stage only).
_STASHES = {
    "1f1b": {"r": (FWD, BWD, False)},
    "zb": {"b": (FWD, BWD, False), "w": (FWD, WGT, False), "r": (BWD, WGT, False),
           "h": (FWD, BWD, True)},
}  # fmt: skip


def _branch(sched: Schedule, a: int, s: int) -> int:
    """The executor's switch branch for table action `a` on stage s: the last stage has its own
    forward and backward (head and loss) branches."""
    last = s == sched.stages - 1
    if a == FWD_BWD:  # 1f1b
        return F1B1_LAST if last else F1B1
    if not last or a in (IDLE, WGT):
        return a
    return ZB_F_LAST if a == FWD else ZB_B_LAST


def exec_tables(sched: Schedule) -> dict[str, Any]:
    """What the 1f1b / zb executor (`_tick_loop`) reads, per tick and stage ([ticks, p] each): the
    switch branch (`action`), the forward's and the backward's microbatch (`mf`, `mb`), whether
    stage 0 writes d x0 (`dx0`), the slots the arriving activation / gradient is read from (`x`,
    `g`) and arrivals go to (`recv_f`, `recv_b`, -1: none), per stash the slot read and the slot
    written (`read_NAME`, `write_NAME`, -1: none); and `slots`, each buffer's number of slots,
    checked to never overwrite a live one."""
    p, m, ticks = sched.stages, sched.microbatches, sched.ticks
    when = {}  # (action, stage, microbatch) -> tick
    for t in range(ticks):
        for s in range(p):
            for a, i, _ in sched.cells(t, s):
                when[a, s, i] = t
    stashes = _STASHES[sched.name]
    spans = {
        "x": lambda s, i: None if s == 0 else (when[FWD, s - 1, i], when[FWD, s, i]),
        "g": lambda s, i: None if s == p - 1 else (when[BWD, s + 1, i], when[BWD, s, i]),
    }
    for k, (w, r, last) in stashes.items():
        spans[k] = lambda s, i, w=w, r=r, last=last: (
            None if last and s < p - 1 else (when[w, s, i], when[r, s, i])
        )
    slots = _slot_counts(spans, p, m, ticks)
    shape = sched.action.shape
    out = {k: np.zeros(shape, np.int32) for k in ("action", "mf", "mb", "x", "g")}
    out["dx0"] = np.zeros(shape, bool)
    for k in ("recv_f", "recv_b", *(f"write_{k}" for k in stashes)):
        out[k] = np.full(shape, -1, np.int32)
    for k in stashes:
        out[f"read_{k}"] = np.zeros(shape, np.int32)
    for t in range(ticks):
        for s in range(p):
            cells = sched.cells(t, s)
            out["action"][t, s] = _branch(sched, int(sched.action[t, s]), s)
            for a, i, _ in cells:
                out["mf" if a == FWD else "mb"][t, s] = i
                if a == FWD:
                    out["x"][t, s] = i % slots["x"]
                    if s < p - 1:
                        out["recv_f"][t, s + 1] = i % slots["x"]
                if a == BWD:
                    out["g"][t, s] = i % slots["g"]
                    out["dx0"][t, s] = s == 0
                    if s > 0:
                        out["recv_b"][t, s - 1] = i % slots["g"]
            for k, (w, r, _) in stashes.items():
                for a, i, _ in cells:
                    span = spans[k](s, i)
                    if span is None or span[0] == span[1]:  # never stashed (1f1b's last stage)
                        continue
                    if a == r:
                        out[f"read_{k}"][t, s] = i % slots[k]
                    if a == w:
                        out[f"write_{k}"][t, s] = i % slots[k]
    out["slots"] = slots
    if _blocks(sched):
        out.update(_feed_tables(sched, p, m))
    return out


def _blocks(sched: Schedule) -> bool:
    """Whether the explicit-backward executor holds the embedded microbatches in blocks of m/p
    over the stages (`_tick_loop`): when p divides m."""
    return sched.microbatches % sched.stages == 0


_FEED_KEYS = ("feed_read", "feed_send", "feed_recv", "dx_keep", "dx_recv")


def _feed_tables(sched: Schedule, p: int, m: int) -> dict[str, np.ndarray]:
    """The conveyors that bring stage 0 its inputs and take its input gradients back
    (`_tick_loop`) when the embedded microbatches are held in blocks over the stages: microbatch
    i in slot i % (m/p) of stage i // (m/p), slot m/p a one-microbatch transit slot for inputs and
    m/p + 1 one for gradients; a gradient lands in the slot its input left (one buffer for both).

    Every tick, one collective-permute with fixed pairs (k -> k-1) moves at most one microbatch
    down each link and one with pairs (k -> k+1) one gradient up: no stage picks a peer at run
    time. Microbatch i leaves stage h at tick F(i) - h (F(i): stage 0 forwards it), so it waits
    one tick in each transit slot and arrives as stage 0 needs it; its gradient leaves stage 0 at
    tick B(i) and goes up one stage per tick to its owner, the last ones in drain ticks after
    the schedule's. Per stage and tick ([ticks, p], -1: none): the slot stage 0 reads its input
    from (`feed_read`), the slot sent down (`feed_send`), the slot an arrival goes to
    (`feed_recv`); the slot stage 0 keeps its own gradient in (`dx_keep`) and the slot an arriving
    gradient goes to (`dx_recv`, which has ticks + drain rows). Every stage sends a gradient up
    every tick (stage 0 the fresh one, the others their transit slot); `dx_recv` keeps arrivals."""
    per, ticks = m // p, sched.ticks
    when = {}  # (action, microbatch) -> tick on stage 0
    for t in range(ticks):
        for a, i, _ in sched.cells(t, 0):
            when[a, i] = t
    owner, slot = (lambda i: i // per), (lambda i: i % per)
    drain = max(when[BWD, i] + owner(i) for i in range(m)) - ticks
    out = {k: np.full((ticks, p), -1, np.int32) for k in ("feed_read", "feed_send", "feed_recv")}
    out.update({k: np.full((ticks + max(drain, 0), p), -1, np.int32) for k in _FEED_KEYS[3:]})

    def mark(table, t, s, value):
        assert out[table][t, s] == -1, (table, t, s)  # one transfer per link and tick
        out[table][t, s] = value

    for i in range(m):
        f, b, o = when[FWD, i], when[BWD, i], owner(i)
        assert f >= o, (f, o)  # stage 0 forwards microbatch i no earlier than tick i
        assert b + max(o - 1, 0) > f - o, (b, f, o)  # the input has left when its gradient lands
        out["feed_read"][f, 0] = slot(i) if o == 0 else per
        for h in range(o, 0, -1):  # from stage h to h - 1 at tick f - h
            mark("feed_send", f - h, h, slot(i) if h == o else per)
            mark("feed_recv", f - h, h - 1, per)
        if o == 0:
            out["dx_keep"][b, 0] = slot(i)
        for h in range(o):  # from stage h to h + 1 at tick b + h
            mark("dx_recv", b + h, h + 1, slot(i) if h + 1 == o else per + 1)
    return out


# --------------------------------------------------------------------------------------------------
# The gradient function the train step calls
# --------------------------------------------------------------------------------------------------


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
        (`_tick_loop`), also nested in the caller's shard_map over `data` (grad_sync's explicit
        paths). Not with `context` / `expert` manual (untested there): the batch is gathered."""
        explicit = not SCHEDULES[self.sched.name].autodiff_backward
        split = _CONTEXT in self.manual or _EXPERT in self.manual
        return explicit and _blocks(self.sched) and not split

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
        """[B, ...] -> [m, B/m, ...] for the explicit-backward executors' blocks (`_tick_loop`):
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
        """inputs and targets [B, T] with the length axis in the blocks' order (`Stages.order`)."""
        order = self.stages.order(batch["inputs"].shape[1])
        if order is None:
            return dict(batch)
        put = lambda k: sharding.constrain(batch[k][:, order], self.batch_axes[k])
        return {**batch, "inputs": put("inputs"), "targets": put("targets")}

    def micro_merge(self, x: jax.Array, axes: tuple) -> jax.Array:
        x = x.swapaxes(0, 1).reshape(-1, *x.shape[2:])
        spec = sharding.logical_to_spec(axes, self.outer_rules, self.mesh)
        return sharding.constrain_to(x, NamedSharding(self.mesh, spec))

    def layers(self, chunk, x, remat: str = "none"):
        """One chunk's layers [Lc, ...] (float32, cast here) applied to x, inside the shard_map:
        (y, the blocks' statistics summed over the layers, {} without `Stages.aux_zero`)."""
        am = jax.sharding.get_abstract_mesh()
        with sharding.activation_rules(am, self.inner_rules):
            with sharding.split_tokens(self.batch_manual):
                chunk = microbatch.cast_floating(chunk, self.dtype)
                return api.stage_layers(self.stages, chunk, x, remat=remat)

    def aux_term(self, stats: dict) -> jax.Array:
        """The blocks' statistics' term of the loss (`Stages.aux_loss`, linear in them)."""
        return self.stages.aux_loss(stats)[0] if stats else jnp.float32(0)

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

        def fn(chunks, s, x):
            chunk = jax.tree.map(lambda a: a[0] if v == 1 else _take(a, s), chunks)
            chunk = microbatch.cast_floating(chunk, self.dtype)
            chunk = jax.tree.map(lambda a: checkpoint_name(a, _WEIGHTS), chunk)
            return self.layers(chunk, x)

        if self.remat != "none":
            return jax.checkpoint(fn, policy=api.REMAT_POLICIES[self.remat])
        if v == 1:
            return fn
        return jax.checkpoint(
            fn, policy=jax.checkpoint_policies.save_anything_except_these_names(_WEIGHTS)
        )

    def stage_fn(self) -> Callable:
        """(one chunk's layer params [Lc, ...], x) -> y, each layer keeping what `train.remat`
        allows (1F1B)."""
        return lambda chunk, x: self.layers(chunk, x, self.remat)

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


def _looped_loss(pipe: _Pipe) -> Callable:
    """loss(params, batch) -> (mean loss, {}): the looped forward ticks (v = 1 unless interleaved)
    in the stages' shard_map, embedding and head outside it."""
    p, v, m = pipe.sched.stages, pipe.sched.virtual_stages, pipe.sched.microbatches
    valid, micro, virtual = looped_forward_table(p, m, v)
    stage_fn = pipe.looped_stage_fn()
    act = pipe.stages.activation_axes

    def body(chunks, x0):
        chunks = jax.tree.map(lambda a: a[0], chunks)  # [v, Lc, ...]
        outs, stats = _looped_forward(
            stage_fn, chunks, x0, p=p, v=v, valid=valid, micro=micro, virtual=virtual
        )
        return outs[None], pipe.aux_total(stats)

    out_spec = PartitionSpec(AXIS, None, *pipe.batch_spec[1:])
    run = pipe.shard_map(body, (pipe.chunk_specs, pipe.batch_spec), (out_spec, PartitionSpec()))

    def loss_fn(params, batch):
        embed, layers, head = pipe.stages.split(params)
        with sharding.activation_rules(pipe.mesh, pipe.outer_rules):
            batch = pipe.storage_order(batch)
            x = pipe.stages.embed(microbatch.cast_floating(embed, pipe.dtype), batch["inputs"])
            y, stats = run(pipe.to_stages(layers), pipe.micro_split(x, act))  # [p, m, B/m, ...]
            y = pipe.micro_merge(y[p - 1], act)  # [B, ...]
            head = microbatch.cast_floating(head, pipe.dtype)
            loss = pipe.stages.head_loss(head, y, batch["targets"]) + pipe.aux_term(stats)
            return loss, pipe.aux_metrics(stats)

    return loss_fn


def _stage_executor(pipe: _Pipe) -> Callable:
    """execute(head_loss, chunks, head, x0, targets) -> (loss, chunk grads [v, Lc, ...], head
    grads, d loss / d x0) on one stage, per device: 1F1B's explicit per-microbatch backward, or
    the autodiff of gpipe / interleaved's forward ticks kept inside the stage."""
    p, v, m = pipe.sched.stages, pipe.sched.virtual_stages, pipe.sched.microbatches
    kind = SCHEDULES[pipe.sched.name]
    if not kind.autodiff_backward:
        tables = exec_tables(pipe.sched)
        if not pipe.x0_blocks:  # x0 on every stage: no sends (`_tick_loop`)
            tables = {k: v for k, v in tables.items() if k not in _FEED_KEYS}
        stage_fn = pipe.stage_fn()
        scale = 1.0 / (m * pipe.n_summed)

        def one_f_one_b(head_loss, chunks, head, x0, targets):
            chunk = jax.tree.map(lambda a: a[0], chunks)  # [Lc, ...]
            executor = _zero_bubble if kind.split_backward else _one_f_one_b
            out = executor(
                stage_fn, head_loss, chunk, head, x0, targets,
                scale=scale, dtype=pipe.dtype, tables=tables, aux_term=pipe.aux_term,
            )  # fmt: skip
            loss, g_c, g_h, dx0, stats = out
            return loss, jax.tree.map(lambda g: g[None], g_c), g_h, dx0, stats

        return one_f_one_b
    valid, micro, virtual = looped_forward_table(p, m, v)
    stage_fn = pipe.looped_stage_fn()

    def looped(head_loss, chunks, head, x0, targets):
        return _looped_gradients(
            stage_fn, head_loss, pipe.aux_term, chunks, head, x0, targets,
            p=p, v=v, scale=1.0 / pipe.n_summed, valid=valid, micro=micro, virtual=virtual,
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

    def body(chunks, head, x0, targets):
        chunks = jax.tree.map(lambda a: a[0], chunks)  # [v, Lc, ...]
        loss, g_c, g_h, dx0, stats = execute(head_loss, chunks, head, x0, targets)
        g_c = pipe.sum_chunk_grads(g_c)
        g_c = jax.tree.map(lambda g: g[None], g_c)  # [1, v, Lc, ...]
        if not blocks:  # float32: as in _looped_forward
            dx0 = psum(dx0.astype(jnp.float32), AXIS)
        return psum(loss, manual), g_c, psum(g_h, manual), dx0, pipe.aux_total(stats)

    P, spec, chunk_specs = PartitionSpec, pipe.batch_spec, pipe.chunk_specs
    # 1f1b / zb with m a multiple of p: the embedded microbatches and their gradients stay in
    # blocks over the stages, carried to / from stage 0 by the conveyors (`_feed_tables`); no
    # stage holds the whole [m, b, T, D] batch and no all-reduce over `pipeline` sums d x0.
    blocks = pipe.x0_blocks
    x_spec = P(AXIS, *spec[1:]) if blocks else spec
    in_specs = (chunk_specs, P(), x_spec, spec)
    run = pipe.shard_map(body, in_specs, (P(), chunk_specs, P(), x_spec, P()))

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
            loss, g_stages, g_head, dx0, stats = run(pipe.to_stages(layers), head, x0, targets)
            (g_embed,) = embed_vjp(dx0.astype(x0.dtype))
            grads = stages.join(g_embed, pipe.from_stages(g_stages), g_head)
        return loss, pipe.aux_metrics(stats), grads

    return gradients


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
    if SCHEDULES[pipe.sched.name].autodiff_backward and not data_manual:
        chunk_gradients = _autodiff_outside(pipe)
    else:
        chunk_gradients = _backward_inside(pipe)
    # Accumulation chunk a takes rows a, a+A, ... as in train.build: no row changes device.
    gradients = microbatch.accumulated(chunk_gradients, config.train.grad_accum, batch_axes, mesh)
    return gradients, pipe.sched


# --------------------------------------------------------------------------------------------------
# Lock-step cost, read from the compiled program
# --------------------------------------------------------------------------------------------------


def executed_actions(sched: Schedule) -> np.ndarray | None:
    """int [ticks, p]: the `lax.switch` branch each stage takes at each tick of a schedule whose
    executor switches per tick (1f1b, zb), or None when every stage runs the same tick body
    (gpipe and interleaved: the forward ticks and their autodiff)."""
    if SCHEDULES[sched.name].autodiff_backward:
        return None
    return exec_tables(sched)["action"]


class _LockStep:
    """Dot FLOPs of one device's program, with each tick of a switching schedule charged for the
    slowest stage's branch (`actions`: the branch per tick and stage, None for none). `count`
    replaces the dot FLOPs by another per-instruction count (e.g. all-reduces)."""

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
    if sched.name == "zb":
        costs = [0, fwd, b_input, b_weight, fwd + head, b_input + 2 * head]
    else:
        costs = [0, fwd, bwd, fwd + bwd, fwd + bwd + 3 * head]
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
    walk = _LockStep(hlo_cost.parse_module(hlo_text), executed_actions(sched))
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
    walk = _LockStep(hlo_cost.parse_module(hlo_text), executed_actions(sched), count)
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
    walk = _LockStep(hlo_cost.parse_module(text), None)
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
