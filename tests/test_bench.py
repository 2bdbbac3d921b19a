"""scripts/bench.py runs end to end on a tiny config (timings are reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--config.model.num_layers=1",
    "--config.model.d_model=32",
    "--config.model.seq_len=16",
    "--config.train.batch_size=16",
    "--config.data.max_bytes=200000",
]


def run_bench(*flags: str) -> subprocess.CompletedProcess:
    """scripts/bench.py on the tiny GPT with `flags`; fails the test unless it exits 0."""
    return run_script("scripts/bench.py", *TINY, *flags)


def test_overhead_study_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(f"--out={out}", "--steps=3", "--warmup=1", "--repeats=1")
    result = json.loads(out.read_text())
    assert result["study"] == "overhead" and result["framework"]["n"] == 3
    assert result["ratio"] == result["framework"]["median_s"] / result["hand_written"]["median_s"]
    assert result["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    assert "mfu" not in result  # no peak FLOP/s for a CPU
    assert "ratio framework / hand-written" in proc.stdout


def test_compression_study_end_to_end(tmp_path):
    out = tmp_path / "compression.json"
    run_bench(
        f"--out={out}",
        "--study=compression",
        "--config.mesh.data=8",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        "--max_steps=4",
        "--methods=local_sgd(H=4),topk(DGC)+sgd,ef_sign+sgd,onebit_adam",
    )
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["none"]["ratio"] == 1.0 and runs["none"]["loss_vs_baseline"] == 0.0
    assert runs["ef_sign+sgd"]["ratio"] > 15 and runs["onebit_adam"]["ratio"] > 15
    assert runs["local_sgd(H=4)"]["ratio"] > 3.5  # one parameter all-reduce every 4 steps
    # Warm-ups are compiled out of the bytes: the steady state is what the table reports (the
    # 1/4-density warm-up stage would cost more than `none`).
    assert runs["topk(DGC)+sgd"]["ratio"] > 5
    assert set(runs) == {"none", "local_sgd(H=4)", "topk(DGC)+sgd", "ef_sign+sgd", "onebit_adam"}
    for r in runs.values():
        assert np.isfinite(r["final_loss"]) and r["step_time_s"] > 0
    # Every row against the best uncompressed run a user has: AdamW, not momentum SGD.
    assert {r["baseline"] for r in runs.values()} == {"none"}


def test_aggregation_study_end_to_end(tmp_path):
    out = tmp_path / "aggregation.json"
    proc = run_bench(
        f"--out={out}",
        "--study=aggregation",
        "--config.mesh.data=8",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        "--steps=1",
        "--warmup=0",
        "--taus=0,1",
        "--max_steps=4",
        "--eval_every=2",
        "--parts=algorithms,staleness,per_hop",
    )
    result = json.loads(out.read_text())
    rows = {r["algorithm"]: r for r in result["measured"]}
    assert "skipped" in rows["hierarchical"]  # one process: no hosts to be hierarchical over
    s = rows["ring"]["grad_bytes"]
    assert rows["ring"]["data_steps"] == 14 and rows["ps"]["data_steps"] == 14
    assert rows["ps"]["data_busiest_bytes"] == 4 * rows["ring"]["data_busiest_bytes"]
    assert rows["tree"]["data_busiest_bytes"] == 6 * s
    assert {r["hardware"] for r in result["predicted"]["rows"]} == {
        "h100_nvlink_ib",
        "cloud_ethernet",
    }
    runs = result["staleness"]["runs"]
    assert [r["staleness"] for r in runs] == [0, 1] and all(len(r["curve"]) == 2 for r in runs)
    assert "planner: one all-reduce" in proc.stdout
    hops = {r["method"]: r["busiest_device_bytes_per_step"] for r in result["per_hop"]["runs"]}
    assert hops["ring + bf16 per hop"] == pytest.approx(hops["none"] / 2, rel=1e-3)
