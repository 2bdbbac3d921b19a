"""Job-level goodput: the `goodput` records of one launched job's attempts summed into one.

`scripts/launch.py` gives every attempt a file (`JAXDIST_GOODPUT_FILE`) where the training loop of
process 0 keeps its latest goodput record: rewritten at every logged step (`final: false`) and at
the end of the run (`final: true`). An attempt killed by a failure leaves its last snapshot. The
job's record adds the attempts' seconds cause by cause, and charges to `restart` the launcher's
wall time that no attempt's record covers: detecting the failure, stopping the other processes,
starting the next attempt, and a failed attempt's seconds after its last snapshot. Its `total` is
the launcher's wall time from the first start to the last exit, so the causes add up to it.

Imports nothing heavy: the launcher reads it without JAX.
"""

from __future__ import annotations

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
    """The attempt's last record, or None when it wrote none (it died before its first step)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def job_record(attempts: Sequence[dict[str, Any] | None], wall_s: float) -> dict[str, Any]:
    """`{"kind": "goodput_job", <cause>: seconds, "total", "goodput", "attempts", ...}`.

    Args:
      attempts: each attempt's last record (None for one that wrote none), in order.
      wall_s: the launcher's wall seconds from the first start to the last exit.
    """
    seconds: dict[str, float] = {}
    for rec in attempts:
        for key, value in (rec or {}).items():
            if key not in _NOT_CAUSES and isinstance(value, int | float):
                seconds[key] = seconds.get(key, 0.0) + float(value)
    covered = sum(seconds.values())
    seconds["restart"] = seconds.get("restart", 0.0) + max(0.0, wall_s - covered)
    total = sum(seconds.values())
    return {
        "kind": "goodput_job",
        **{k: round(v, 6) for k, v in seconds.items()},
        "total": round(total, 6),
        "goodput": seconds.get("productive", 0.0) / total if total > 0 else 0.0,
        "attempts": len(attempts),
        "attempts_finished": sum(1 for r in attempts if r and r.get("final")),
    }


def summary_line(record: dict[str, Any]) -> str:
    """`job goodput │ 61.0% of 95.2s productive over 2 attempt(s); restart 20.1s, ...`."""
    rest = [
        f"{k} {record[k]:.1f}s"
        for k in record
        if k not in (*_NOT_CAUSES, "productive", "attempts", "attempts_finished")
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
