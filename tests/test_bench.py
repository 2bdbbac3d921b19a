"""scripts/bench.py runs end to end on a tiny config (timings are reported, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_study_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/bench.py",
            "--config.model.num_layers=1",
            "--config.model.d_model=32",
            "--config.model.seq_len=16",
            "--config.train.batch_size=16",
            "--config.data.max_bytes=200000",
            "--steps=3",
            "--warmup=1",
            "--repeats=1",
            f"--out={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["study"] == "overhead" and result["framework"]["n"] == 3
    assert result["ratio"] == result["framework"]["median_s"] / result["hand_written"]["median_s"]
    assert result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    assert "mfu" not in result  # no peak FLOP/s for a CPU
    assert "ratio framework / hand-written" in proc.stdout
