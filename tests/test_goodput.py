"""The run's `goodput` record: wall seconds by cause that add up to the wall time of the run."""

from __future__ import annotations

import json
import time

import pytest

from jaxdist import goodput, loop
from tests.helpers import tiny_gpt_config


def _goodput_records(workdir) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "goodput"]


def test_causes_add_up_to_the_measured_wall_time(tmp_path, monkeypatch):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    c.train.steps, c.train.log_every, c.train.eval_every = 6, 2, 3
    c.train.eval_batches = 1
    c.checkpoint.every = 3
    # The wall time the record covers: from the call to the moment the record is written. What
    # follows it (the console's last lines, the lock's release, Python freeing the run's arrays
    # and executables as `run` returns) no record can contain; it is checked to be small apart.
    written = []
    write = loop._RunEnd.write

    def timed_write(self):
        record = write(self)
        written.append(time.perf_counter())
        return record

    monkeypatch.setattr(loop._RunEnd, "write", timed_write)
    t0 = time.perf_counter()
    loop.run(c, str(tmp_path))
    end = time.perf_counter()
    wall = written[0] - t0
    assert end - written[0] < 0.5, end - written[0]
    (rec,) = _goodput_records(tmp_path)
    assert set(goodput.CAUSES) | {"kind", "total", "goodput"} == set(rec)
    assert all(rec[c] >= 0 for c in goodput.CAUSES), rec
    assert sum(rec[c] for c in goodput.CAUSES) == pytest.approx(rec["total"], rel=1e-5)
    assert rec["total"] == pytest.approx(wall, rel=0.02), (rec, wall)
    assert rec["goodput"] == pytest.approx(rec["productive"] / rec["total"])
    # Each cause this run had was timed: a compile, saves, evaluations, batches, steps.
    for cause in ("productive", "compile", "checkpoint", "eval", "data"):
        assert rec[cause] > 0, (cause, rec)
    assert rec["restart"] == 0 and rec["recomputed"] == 0  # one attempt, nothing restored


def test_a_resume_charges_its_restore_and_the_steps_it_trains_again(tmp_path):
    c = tiny_gpt_config(data=8)
    c.train.steps, c.train.log_every = 4, 1
    c.checkpoint.every = 2
    loop.run(c, str(tmp_path))
    # A crash after step 4 that lost the step-4 checkpoint: the rerun restores step 2 and trains
    # steps 3 and 4 again, which the first attempt had logged.
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "4")
    loop.run(c, str(tmp_path))
    first, second = _goodput_records(tmp_path)
    assert first["restart"] == 0 and first["recomputed"] == 0
    assert second["restart"] > 0 and second["recomputed"] > 0, second
    # Both resumed steps were trained before: none of the steps counts as productive time.
    assert second["productive"] == pytest.approx(0, abs=1e-6), second
    assert sum(second[c] for c in goodput.CAUSES) == pytest.approx(second["total"], rel=1e-5)


def test_nested_spans_are_charged_once(monkeypatch):
    now = [100.0]  # a clock the test advances, so a busy machine cannot stretch a span
    monkeypatch.setattr(goodput.time, "perf_counter", lambda: now[0])
    clock = goodput.Clock()
    with clock.charge("productive"):
        now[0] += 0.02
        with clock.charge("eval"):
            now[0] += 0.03
        now[0] += 0.01
    now[0] += 0.5
    rec = clock.record()
    assert rec["eval"] == pytest.approx(0.03, abs=1e-9)
    assert rec["productive"] == pytest.approx(0.03, abs=1e-9)  # its own 0.02 + 0.01, not eval's
    assert rec["idle"] == pytest.approx(0.5, abs=1e-9)
    assert rec["total"] == pytest.approx(0.56, abs=1e-9)
    assert sum(rec[c] for c in goodput.CAUSES) == pytest.approx(rec["total"], rel=1e-6)
    with pytest.raises(ValueError, match="unknown goodput cause 'lunch'"):
        with clock.charge("lunch"):
            pass


def test_job_record_sums_attempts_and_charges_the_rest_by_when_it_fell(tmp_path, monkeypatch):
    from jaxdist import job_goodput

    # Attempt 1: started at t=100, clock from 102, last snapshot at 111 (9 s), killed; ended 113.
    killed = {"productive": 6.0, "compile": 2.0, "idle": 1.0, "total": 9.0, "written": 111.0}
    finished = {
        "kind": "goodput",
        "productive": 5.0,
        "compile": 2.0,
        "restart": 0.5,
        "recomputed": 1.5,
        "idle": 1.0,
        "total": 10.0,
        "goodput": 0.5,
    }
    monkeypatch.setenv(job_goodput.ENV_GOODPUT_FILE, str(tmp_path / "attempt.json"))
    job_goodput.write_snapshot(finished, str(tmp_path), final=True)
    read = job_goodput.read_snapshot(str(tmp_path / "attempt.json"))
    assert read["final"] is True and read["workdir"] == str(tmp_path)
    assert read["written"] == pytest.approx(time.time(), abs=60)
    # Attempt 2: started at 114 (1 s after), clock from 117, finished record at 127, ended 128.
    read["written"] = 127.0
    rec = job_goodput.job_record(
        [job_goodput.Attempt(killed, 100.0, 113.0), job_goodput.Attempt(read, 114.0, 128.0)]
    )
    assert rec["productive"] == 11.0 and rec["recomputed"] == 1.5 and rec["compile"] == 4.0
    # restart: attempt 2's 0.5 s restore, attempt 1's 2 s after its snapshot, the 1 s gap and
    # attempt 2's 3 s start-up; idle: 2 s of attempt 1's start-up, 1 + 1 s in records, 1 s end.
    assert rec["restart"] == pytest.approx(0.5 + 2 + 1 + 3)
    assert rec["idle"] == pytest.approx(2 + 1 + 1 + 1)
    assert rec["total"] == pytest.approx(28.0) and rec["wall_s"] == pytest.approx(28.0)
    assert rec["goodput"] == pytest.approx(11.0 / 28.0)
    assert (rec["attempts"], rec["attempts_finished"]) == (2, 1)
    line = job_goodput.summary_line(rec)
    assert line.startswith("job goodput │ 39.3% of 28.0s productive over 2 attempt(s); "), line
    assert "restart 6.5s" in line and "recomputed 1.5s" in line, line
