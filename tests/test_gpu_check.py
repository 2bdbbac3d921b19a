"""`bash scripts/gpu_check.sh` on a machine without a GPU: the tiny CPU dry run of every phase.

The figures it prints are CPU timings and are never asserted; what is checked is that every phase
ran and wrote what the table is built from, that correctness checks can fail (they did, once, when
the family check ran a step at learning rate 0), and that `model.attention=cudnn` is refused with
one line before compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, proc


def test_dry_run_says_so_and_exits_zero(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no GPU" in proc.stdout and "dry run only" in proc.stdout
    assert "| point | model | batch |" in proc.stdout  # the table is printed at the end
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")


def test_env_and_correctness_checks(dry_run):
    out, _ = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["backend"] == "cpu" and env["versions"]["jax"]
    checks = {c["name"]: c for c in json.loads((out / "correct.json").read_text())}
    assert all(c["ok"] for c in checks.values()), checks
    assert "loss" in checks["default job, 20 steps"]["detail"]
    refusal = checks["attention=cudnn vs xla"]["detail"]
    assert "model.attention='cudnn' needs NVIDIA GPUs" in refusal and "\n" not in refusal
    families = [name for name in checks if name.startswith("two train steps")]
    assert len(families) >= 3  # gpt, mlp, resnet (and every family config added later)


def test_sweep_points_have_timings_and_predictions(dry_run):
    out, _ = dry_run
    points = {p.stem: json.loads(p.read_text()) for p in (out / "points").glob("*.json")}
    ok = points["tiny_b8_none_xla"]
    assert ok["ok"] and ok["framework"]["n"] == 3 and ok["framework"]["median_s"] > 0
    assert ok["hand_written"]["n"] == 3 and ok["framework_vs_hand"] > 0
    assert ok["predicted"]["hardware"] == "cpu_here" and ok["predicted"]["step_time_s"] > 0
    assert ok["compiled_bytes"]["temp"] > 0 and "mfu" not in ok  # no peak known on a CPU
    assert points["tiny_b8_full_auto"]["ok"] and points["tiny_b8_full_auto"]["remat"] == "full"
    refused = points["tiny_b8_cudnn"]
    assert not refused["ok"] and refused["error"].startswith("ConfigError: model.attention='cudnn'")
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [p["label"] for p in summary["points"]] == [
        "tiny_b8_none_xla",
        "tiny_b8_full_auto",
        "tiny_b8_cudnn",
    ]
