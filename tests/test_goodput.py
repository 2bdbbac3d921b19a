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


def test_causes_add_up_to_the_measured_wall_time(tmp_path):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    c.train.steps, c.train.log_every, c.train.eval_every = 6, 2, 3
    c.train.eval_batches = 1
    c.checkpoint.every = 3
    t0 = time.perf_counter()
    loop.run(c, str(tmp_path))
    wall = time.perf_counter() - t0
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


def test_nested_spans_are_charged_once():
    clock = goodput.Clock()
    with clock.charge("productive"):
        time.sleep(0.02)
        with clock.charge("eval"):
            time.sleep(0.03)
    rec = clock.record()
    assert rec["eval"] == pytest.approx(0.03, abs=0.01)
    assert rec["productive"] == pytest.approx(0.02, abs=0.01)
    assert sum(rec[c] for c in goodput.CAUSES) == pytest.approx(rec["total"], rel=1e-6)
    with pytest.raises(ValueError, match="unknown goodput cause 'lunch'"):
        with clock.charge("lunch"):
            pass


def test_job_record_sums_attempts_and_charges_the_uncovered_time_to_restart(tmp_path, monkeypatch):
    from jaxdist import job_goodput

    killed = {"kind": "goodput", "productive": 6.0, "compile": 2.0, "idle": 1.0, "total": 9.0}
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
    assert read == {**finished, "workdir": str(tmp_path), "final": True}
    rec = job_goodput.job_record([killed, None, read], wall_s=23.0)
    assert rec["productive"] == 11.0 and rec["recomputed"] == 1.5 and rec["compile"] == 4.0
    assert rec["restart"] == pytest.approx(0.5 + (23.0 - 19.0))  # the launcher's gap
    assert rec["total"] == pytest.approx(23.0)
    assert rec["goodput"] == pytest.approx(11.0 / 23.0)
    assert (rec["attempts"], rec["attempts_finished"]) == (3, 1)
    line = job_goodput.summary_line(rec)
    assert line.startswith("job goodput │ 47.8% of 23.0s productive over 3 attempt(s); "), line
    assert "restart 4.5s" in line and "recomputed 1.5s" in line, line
