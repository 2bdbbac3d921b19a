"""What the README says stays out of the console does: Gloo's banner in pieces, absl's INFO lines."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_script():
    spec = importlib.util.spec_from_file_location("train_script", f"{ROOT}/scripts/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drop_blank", [False, True])
def test_gloo_banner_and_its_pieces_are_dropped(drop_blank):
    keep = _train_script().filter_native_line
    banner = b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    assert keep(banner, drop_blank=drop_blank) is None
    # The pieces another thread's writes cut it into, as launch.py showed them: `[1] 1`,
    # `[1]  is connected to `, `[1] 3`, `[1]  peer ranks. `.
    for piece in (b"1\n", b" is connected to \n", b"3\n", b" peer ranks. \n", b"[Gloo] Rank \n"):
        assert keep(piece, drop_blank=drop_blank) is None, piece
    # The run's own lines pass whole, with the banner cut out of them.
    line = "step      2/2 │ loss 5.5481 │ 382.9 ms/step\n".encode()
    assert keep(line, drop_blank=drop_blank) == line
    assert keep(
        b"[Gloo] Rank 0 is connected to 1 peer ranks. done: step 2\n", drop_blank=False
    ) == (b"done: step 2\n")
    assert keep(b"\n", drop_blank=drop_blank) == (None if drop_blank else b"\n")


def test_plan_and_plot_print_no_absl_info_lines(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": ""}  # JAX probes every backend (the TPU INFO line)
    plan = subprocess.run(
        [sys.executable, "scripts/plan.py", "--config=configs/default.py", "--devices=8"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plan.returncode == 0, plan.stderr[-3000:]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    plot = subprocess.run(
        [sys.executable, "scripts/plot.py", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plot.returncode == 0, plot.stderr[-3000:]
    for proc in (plan, plot):
        info = re.findall(r"^I\d{4} .*$", proc.stdout + proc.stderr, re.M)
        assert not info, info
