"""A checkpoint saved on one mesh and device count continues on another, through scripts/train.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import env_without_cluster, python

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = (
    "--config.model.num_layers=1",
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.seq_len=16",
    "--config.train.batch_size=16",
    "--config.train.log_every=1",
    "--config.train.eval_batches=1",
    "--config.train.schedule=constant",
    "--config.train.warmup_steps=2",
    "--config.data.max_bytes=200000",
    "--config.checkpoint.every=2",
)


def mesh_flags(devices: int, data=1, fsdp=1, tensor=1):
    return (
        f"--config.runtime.cpu_devices={devices}",
        f"--config.mesh.data={data}",
        f"--config.mesh.fsdp={fsdp}",
        f"--config.mesh.tensor={tensor}",
    )


def train(workdir: Path, steps: int, *flags: str) -> subprocess.CompletedProcess:
    env = env_without_cluster()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            python(),
            "scripts/train.py",
            f"--workdir={workdir}",
            *TINY,
            *flags,
            f"--config.train.steps={steps}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(workdir: Path) -> dict[int, float]:
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


TWO_LAYERS = ("--config.model.num_layers=2",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Six steps on data=8 (two layers), checkpoints at 2, 4 and 6: what both tests continue from
    or compare with (one run instead of one per test)."""
    ref = tmp_path_factory.mktemp("reshard") / "ref"
    train(ref, 6, *TWO_LAYERS, *mesh_flags(8, data=8))
    return ref


def test_data8_checkpoint_continues_on_fsdp2_tensor2_with_4_devices(reference, tmp_path):
    ref = reference
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(ref / "checkpoints", part / "checkpoints")
    for step in (6,):  # keep steps 2 and 4: the resumed run starts from 4
        shutil.rmtree(part / "checkpoints" / str(step))
    proc = train(part, 6, *TWO_LAYERS, *mesh_flags(4, fsdp=2, tensor=2))
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    layout = json.loads((part / "metrics.jsonl").read_text().splitlines()[0])
    assert (
        layout["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "pipeline": 1}
        and layout["devices"] == 4
    )
    want, got = losses(ref), losses(part)
    assert sorted(got) == [5, 6]
    np.testing.assert_allclose([got[5], got[6]], [want[5], want[6]], rtol=1e-5)


PIPE = (
    "--config.mesh.pipeline=2",
    "--config.pipeline.schedule=1f1b",
    "--config.pipeline.microbatches=2",
)


def test_pipeline_checkpoint_restores_without_pipeline_and_back(reference, tmp_path):
    """pipeline=2 (1f1b) × data=4 for steps 1–2, then data=8 for 3–4, then the pipeline again."""
    pipe, flat = (*mesh_flags(8, data=4), *PIPE), mesh_flags(8, data=8)
    run = tmp_path / "run"
    train(run, 2, *TWO_LAYERS, *pipe)
    assert "at step 2" in train(run, 4, *TWO_LAYERS, *flat).stdout
    assert "at step 4" in train(run, 6, *TWO_LAYERS, *pipe).stdout
    want, got = losses(reference), losses(run)
    np.testing.assert_allclose(
        [got[s] for s in range(1, 7)], [want[s] for s in range(1, 7)], rtol=1e-5
    )
