"""What the explicit-backward executor reads per tick: switch branch, buffer slots, conveyors.

`exec_tables` turns a `Schedule` whose backward is explicit (1f1b, zb) into the [ticks, p] integer
tables `executors.tick_loop` indexes at every tick: the `lax.switch` branch, which microbatch,
which slot of each buffer and stash is read or written, and the conveyors that bring stage 0 its
inputs (`feed_tables`). All numpy, before tracing; slot counts are checked never to overwrite a
live microbatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxdist.pipeline.schedules import BWD, FWD, FWD_BWD, IDLE, WGT, Schedule

# Branches of the explicit-backward tick switch beyond the table's actions (`executors.one_f_one_b`
# and `executors.zero_bubble` list their branches in this order): 1f1b's FB (a backward and a
# forward in one tick) and LAST (the last stage's forward, head, loss and backward of one
# microbatch); zb's last-stage F and B, which carry head and loss (its W is the others').
F1B1, F1B1_LAST = 3, 4
ZB_F_LAST, ZB_B_LAST = 4, 5


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
    """What the 1f1b / zb executor (`tick_loop`) reads, per tick and stage ([ticks, p] each): the
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
    stashes = sched.stashes
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
    if feeds_in_blocks(sched):
        out.update(feed_tables(sched, p, m))
    return out


def feeds_in_blocks(sched: Schedule) -> bool:
    """Whether the explicit-backward executor holds the embedded microbatches in blocks of m/p
    over the stages (`executors.tick_loop`): when p divides m."""
    return sched.microbatches % sched.stages == 0


FEED_KEYS = ("feed_read", "feed_send", "feed_recv", "dx_keep", "dx_recv")


def feed_tables(sched: Schedule, p: int, m: int) -> dict[str, np.ndarray]:
    """The conveyors that bring stage 0 its inputs and take its input gradients back
    (`tick_loop`) when the embedded microbatches are held in blocks over the stages: microbatch
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
    out.update({k: np.full((ticks + max(drain, 0), p), -1, np.int32) for k in FEED_KEYS[3:]})

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
