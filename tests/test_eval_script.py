"""`scripts/eval.py` with no window flags agrees with the run's own final evaluation."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from jaxdist import loop
from tests.helpers import python, tiny_gpt_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [python(), "scripts/eval.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_script_reads_the_windows_of_the_final_evaluation(tmp_path):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    c.train.steps, c.train.eval_batches, c.checkpoint.every = 2, 3, 2
    loop.run(c, str(tmp_path))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r.get("kind") == "eval"][-1]["eval_loss"]
    proc = _eval(f"--checkpoint={tmp_path}", "--data=stdlib", f"--out={tmp_path / 'e.json'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "e.json").read_text())
    # One device here, eight (data × fsdp × tensor) in training: float32 sums in another order.
    assert result["loss"] == pytest.approx(final, rel=1e-5), (result, final)
    assert result["windows"] == {"batches": 3, "batch_size": 16, "seq_len": 16, "seed": 0}
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path} (step 2) on stdlib: loss {result['loss']:.4f}")
    assert lines[0].endswith("(3 batches × 16 × 16 of the validation split, seed 0)"), lines
    assert lines[1] == "the same windows as the run's final evaluation", lines
    # Other windows: both figures stay explainable.
    proc = _eval(f"--checkpoint={tmp_path}", "--data=stdlib", "--batches=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[1] == (
        "the run's final evaluation read other windows: 3 batches × 16 × 16 of "
        "data.source=stdlib, seed 0"
    ), proc.stdout
