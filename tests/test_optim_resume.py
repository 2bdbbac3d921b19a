"""Muon's state (a partitioned optax state: Muon's momentum, AdamW's two moments) and bf16 moments
(rounded to nearest or stochastically) survive a checkpoint: a run stopped at step 3 and resumed by
the same command to step 6 ends bit-identical to an uninterrupted 6-step run (every loss, every
array of the final checkpoint)."""

from __future__ import annotations

import json

import pytest

from jaxdist import checkpoint
from tests.helpers import ONE_DEVICE_GPT_FLAGS, run_script

pytestmark = pytest.mark.slow

FLAGS = (
    *ONE_DEVICE_GPT_FLAGS,
    "--config.train.optimizer=muon",
    "--config.train.schedule=constant",  # the stopped run's shorter train.steps: same schedule
    "--config.train.warmup_steps=0",
    "--config.checkpoint.every=3",
    "--config.data.max_bytes=400000",
)


def _losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.parametrize(
    "dtype, rounding",
    [("float32", "nearest"), ("bfloat16", "nearest"), ("bfloat16", "stochastic")],
)
def test_muon_resume_is_bit_identical(tmp_path, dtype, rounding):
    """With stochastic rounding the state also keeps the update count its random bits come from."""
    flags = (
        *FLAGS,
        f"--config.train.opt_state_dtype={dtype}",
        f"--config.train.opt_state_rounding={rounding}",
    )
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_script("scripts/train.py", *flags, "--config.train.steps=6", f"--workdir={ref}")
    run_script("scripts/train.py", *flags, "--config.train.steps=3", f"--workdir={run}")
    resumed = run_script("scripts/train.py", *flags, "--config.train.steps=6", f"--workdir={run}")
    assert "resumed from" in resumed.stdout
    got, want = _losses(run), _losses(ref)
    assert sorted(want) == list(range(1, 7)) and got == want
    a = checkpoint.read_arrays(run / "checkpoints", 6)
    b = checkpoint.read_arrays(ref / "checkpoints", 6)
    assert sorted(a) == sorted(b)
    moments = [p for p in b if "opt_state" in p and b[p].ndim >= 1]
    assert moments and all(str(b[p].dtype) == dtype for p in moments)
    differ = [p for p in b if a[p].dtype != b[p].dtype or a[p].tobytes() != b[p].tobytes()]
    assert not differ, differ
