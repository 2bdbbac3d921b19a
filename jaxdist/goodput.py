"""Goodput: where a run's wall time went, by cause, as one `kind: "goodput"` record at its end.

The clock starts when `loop.run` is entered and stops when the record is written. Every second in
between is charged to exactly one cause, so the causes add up to the wall time:

| cause | what is timed |
| --- | --- |
| `compile` | lowering and compiling the train step |
| `checkpoint` | saving (the host's share of an async save) and waiting for saves to commit |
| `restart` | reading the checkpoint a resumed run starts from |
| `recomputed` | steps trained again after a restart: their share of the step time (estimated from the steps a previous attempt logged past the resume point) |
| `eval` | evaluations (periodic and final) |
| `data` | building each step's batch on the host |
| `productive` | the train steps themselves, the rest of the step loop |
| `idle` | everything else: validation, loading data, building the mesh and the engine, writing the first records, the closing lines |

`goodput` = productive / total, the fraction of the wall time that advanced training.

    clock = goodput.Clock()
    with clock.charge("compile"):
        compiled = step.lower(...).compile()
    clock.record()  # {"kind": "goodput", "productive": ..., ..., "total": ..., "goodput": ...}
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from jaxdist.metrics import human_duration

CAUSES = ("productive", "compile", "checkpoint", "eval", "data", "restart", "recomputed", "idle")


class Clock:
    """Wall seconds by cause since construction; the loop charges spans to causes.

    Spans may nest: an inner span's seconds belong to the inner cause only (an evaluation inside
    the step loop is `eval`, not `productive`).
    """

    def __init__(self, now: float | None = None):
        self.start = time.perf_counter() if now is None else now
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self._stack: list[tuple[str, float]] = []  # (cause, seconds of inner spans)

    @contextlib.contextmanager
    def charge(self, cause: str) -> Iterator[None]:
        """Charges the wall time of the `with` body to `cause` (less any nested span's)."""
        if cause not in self.seconds:
            raise ValueError(f"unknown goodput cause {cause!r}; one of {', '.join(CAUSES)}")
        t0 = time.perf_counter()
        self._stack.append((cause, 0.0))
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            _, inner = self._stack.pop()
            self.seconds[cause] += elapsed - inner
            if self._stack:  # the parent's own time excludes this whole span
                parent, parent_inner = self._stack[-1]
                self._stack[-1] = (parent, parent_inner + elapsed)

    def move(self, seconds: float, source: str, dest: str) -> None:
        """Re-charges `seconds` (at most what `source` holds) from `source` to `dest`."""
        moved = max(0.0, min(seconds, self.seconds[source]))
        self.seconds[source] -= moved
        self.seconds[dest] += moved

    def record(self, now: float | None = None) -> dict[str, Any]:
        """`{"kind": "goodput", <cause>: seconds, "total": wall seconds, "goodput": fraction}`.

        `idle` is the wall time no span claimed, so the causes sum to `total`.
        """
        total = (time.perf_counter() if now is None else now) - self.start
        out = {c: self.seconds[c] for c in CAUSES if c != "idle"}
        out["idle"] = max(0.0, total - sum(out.values()))
        out = {c: round(out[c], 6) for c in CAUSES}
        total = sum(out.values())  # = the wall time: idle is what the spans left of it
        return {
            "kind": "goodput",
            **out,
            "total": total,
            "goodput": out["productive"] / total if total > 0 else 0.0,
        }


def summary_line(record: dict[str, Any]) -> str:
    """`goodput │ 71.3% of 2m05s productive; compile 21s, eval 9s, checkpoint 3s, data 1s, idle 2s`."""
    rest = [
        f"{c} {_seconds(record[c])}" for c in CAUSES if c != "productive" and record[c] >= 0.005
    ]
    line = (
        f"goodput │ {100 * record['goodput']:.1f}% of {human_duration(record['total'])} productive"
    )
    return line + (f"; {', '.join(rest)}" if rest else "")


def _seconds(s: float) -> str:
    """A cause's time: `1m23s`, `17s`, `0.9s`, `0.04s` (a cause the run charged, however briefly,
    is named: a short run's checkpoint takes a few hundredths of a second)."""
    return human_duration(s) if s >= 1 else f"{s:.1f}s" if s >= 0.05 else f"{s:.2f}s"
