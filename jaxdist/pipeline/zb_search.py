"""zb's table: ZB-H1's tick rows, the cheaper of a greedy table and a beam search (numpy).

The backward is split into the input-gradient pass B and the weight-gradient pass W (Qi et al.
2023); W passes, which no stage waits for, fill what would be bubble ticks. In a lock-step program
a tick costs its slowest stage's branch, so which passes share a tick matters: `zero_bubble_table`
takes the cheaper of a greedy table and a beam search under `ZB_TICK_COSTS`.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from jaxdist.pipeline.schedules import BWD, FWD, IDLE, WGT, Schedule

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
    least cost so far plus the largest work any stage has left are kept at every tick. The rows
    tried depend only on what each stage can run, and a row's cost and what it adds to the counts
    only on the row: both are worked out once per search (the same table, 4-5x faster: p = 4,
    m = 32 in 1.1-1.4 CPU s instead of 4.9-5.9; p = 8, m = 8 in 1.2-1.4 instead of 3.9-4.6)."""
    levels = sorted(set(costs[1:].ravel()))
    orders = [(BWD, FWD, WGT), (FWD, BWD, WGT), (WGT, BWD, FWD), (BWD, WGT, FWD), (WGT, FWD, BWD)]
    work_f, work_b, work_w = (costs[a].tolist() for a in (FWD, BWD, WGT))  # per stage, as floats
    left = lambda done: max(
        (m - f) * cf + (m - b) * cb + (m - w) * cw
        for f, b, w, cf, cb, cw in zip(*done, work_f, work_b, work_w)
    )
    idle = (IDLE,) * p
    tried: dict = {}  # what each stage can run -> the rows tried

    def rows_from(can: list[dict[int, bool]]) -> tuple[tuple[int, ...], ...]:
        key = tuple((c[BWD], c[FWD], c[WGT]) for c in can)
        if key not in tried:
            rows = {
                tuple(
                    next((a for a in o if c[a] and costs[a, s] <= lvl), IDLE)
                    for s, c in enumerate(can)
                )
                for lvl in levels
                for o in orders
            }
            tried[key] = tuple(rows - {idle})
        return tried[key]

    moves: dict = {}  # row -> (its cost, what it adds to each count)

    def move(row: tuple[int, ...]) -> tuple[float, tuple]:
        if row not in moves:
            adds = tuple(tuple(int(a == act) for a in row) for act in (FWD, BWD, WGT))
            moves[row] = (max(costs[a, s] for s, a in enumerate(row)), adds)
        return moves[row]

    beam = {((0,) * p,) * 3: (0.0, None)}  # state -> (cost, (previous node, row))
    while any(min(done[2]) < m for done in beam):
        grown: dict = {}
        for done, node in beam.items():
            if min(done[2]) == m:
                grown.setdefault(done, node)
                continue
            for row in rows_from(_zb_runnable(p, m, cap, done)):
                tick, adds = move(row)
                key = tuple(tuple(map(operator.add, n, d)) for n, d in zip(done, adds))
                cost = node[0] + tick
                if key not in grown or cost < grown[key][0]:
                    grown[key] = (cost, (node, row))
        best = sorted(grown, key=lambda k: (grown[k][0] + left(k), k))[:_ZB_BEAM]
        beam = {k: grown[k] for k in best}
    node, rows = min(beam.values(), key=lambda n: n[0]), []
    while node[1] is not None:
        node, row = node[1]
        rows.append(row)
    return rows[::-1]


@functools.lru_cache(maxsize=64)  # the search takes a second at m = 32; tables are built often
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


def zero_bubble_tables(p: int, m: int, v: int) -> Schedule:
    """zb: `zero_bubble_table`, one layer chunk per device; B and W cost one unit each."""
    del v  # one layer chunk per device
    action, micro = zero_bubble_table(p, m)
    return Schedule("zb", p, m, 1, action, micro, np.zeros_like(micro), backward_units=1.0)
