"""Job-level goodput: the `goodput` records of one launched job's attempts summed into one.

`scripts/launch.py` gives every attempt a file (`JAXDIST_GOODPUT_FILE`) where the training loop of
process 0 keeps its latest goodput record: rewritten at every logged step (`final: false`) and at
the end of the run (`final: true`). An attempt killed by a failure leaves its last snapshot. The
job's record adds the attempts' seconds cause by cause, and charges to `restart` the launcher's
wall time that no attempt's record covers after a failure: a failed attempt's seconds after its
last snapshot (detecting the failure, stopping the other processes), the gap to the next attempt
and that attempt's start-up (`job_record` says which seconds go where). Its `total` is the
launcher's wall time from the first start to the last exit, so the causes add up to it.

Imports nothing heavy: the launcher reads it without JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

ENV_GOODPUT_FILE = "JAXDIST_GOODPUT_FILE"
_NOT_CAUSES = ("kind", "total", "goodput", "workdir", "final")


def write_snapshot(record: dict[str, Any], workdir: str, final: bool) -> None:
    """Writes `record` (a run's goodput so far) to `$JAXDIST_GOODPUT_FILE`, if set, atomically."""
    path = os.environ.get(ENV_GOODPUT_FILE)
    if not path:
        return
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**record, "workdir": workdir, "final": final}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the job's figure is a help, never a reason to stop training


def read_snapshot(path: str) -> dict[str, Any] | None:
    """The attempt's last record, with `written` (its file's modification time, seconds since the
    epoch), or None when it wrote none (it died before its first logged step)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        return {**record, "written": os.path.getmtime(path)}
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class Attempt:
    """One start of the job: its last goodput snapshot and when it started and ended (epoch s)."""

    record: dict[str, Any] | None
    start: float
    end: float


def job_record(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """`{"kind": "goodput_job", <cause>: seconds, "total", "goodput", "attempts", ...}`.

    Each attempt's record is added cause by cause. The attempt's seconds its record does not
    cover are charged by when they fell: before its clock started (starting Python, importing,
    joining the job) is `idle` for the first attempt and `restart` for later ones; after its last
    snapshot is `restart` when the attempt failed (work lost with it, detecting the failure,
    stopping the other processes) and `idle` when it finished. The gaps between attempts are
    `restart`. `total` is the first start to the last end.
    """
    seconds: dict[str, float] = {"idle": 0.0, "restart": 0.0}
    for i, attempt in enumerate(attempts):
        rec = attempt.record
        if rec is None:
            seconds["idle" if i == 0 else "restart"] += attempt.end - attempt.start
            continue
        for key, value in rec.items():
            if key not in _NOT_CAUSES and key != "written" and isinstance(value, int | float):
                seconds[key] = seconds.get(key, 0.0) + float(value)
        clock_start = rec["written"] - rec["total"]
        seconds["idle" if i == 0 else "restart"] += max(0.0, clock_start - attempt.start)
        tail = max(0.0, attempt.end - rec["written"])
        seconds["idle" if rec.get("final") else "restart"] += tail
        if i > 0:
            seconds["restart"] += max(0.0, attempt.start - attempts[i - 1].end)
    total = sum(seconds.values())
    return {
        "kind": "goodput_job",
        **{k: round(v, 6) for k, v in seconds.items()},
        "total": round(total, 6),
        "wall_s": round(attempts[-1].end - attempts[0].start, 6) if attempts else 0.0,
        "goodput": seconds.get("productive", 0.0) / total if total > 0 else 0.0,
        "attempts": len(attempts),
        "attempts_finished": sum(1 for a in attempts if a.record and a.record.get("final")),
    }


def summary_line(record: dict[str, Any]) -> str:
    """`job goodput │ 61.0% of 95.2s productive over 2 attempt(s); restart 20.1s, ...`."""
    rest = [
        f"{k} {record[k]:.1f}s"
        for k in record
        if k not in (*_NOT_CAUSES, "productive", "attempts", "attempts_finished", "wall_s")
        and record[k] >= 0.05
    ]
    line = (
        f"job goodput │ {100 * record['goodput']:.1f}% of {record['total']:.1f}s productive "
        f"over {record['attempts']} attempt(s)"
    )
    return line + (f"; {', '.join(rest)}" if rest else "")


def append_to_metrics(record: dict[str, Any], workdir: str) -> None:
    """Appends the job's record to `workdir/metrics.jsonl` (one line)."""
    with open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
