"""scripts/bench.py runs end to end on a tiny config (timings are reported, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import python, run_script

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
    run_script(  # docs/COMPRESSION.md's command as written, then a tiny model for 4 steps
        "scripts/bench.py",
        "--study=compression",
        "--config.mesh.data=8",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        "--max_steps=200",
        *TINY,
        f"--out={out}",
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


def test_compression_small_table_fails_the_rows_over_the_bound(tmp_path):
    """docs/COMPRESSION.md's study of each method with its own optimizer, as written, then 3 steps
    of two methods and a bound every compressed row misses: exit 1, the rows named, the JSON
    written first; the momentum-SGD row against uncompressed momentum SGD."""
    out = tmp_path / "small.json"
    proc = subprocess.run(
        [
            python(),
            "scripts/bench.py",
            "--study=compression",
            "--table=small",
            "--config.mesh.data=8",
            "--config.mesh.fsdp=1",
            "--config.mesh.tensor=1",
            "--config.model.num_layers=1",
            "--config.model.d_model=32",
            "--config.model.seq_len=16",
            "--config.train.batch_size=16",
            "--config.train.warmup_steps=10",
            "--config.data.max_bytes=400000",
            "--max_steps=150",
            "--sgd_learning_rate=0.3",
            "--max_loss_vs_baseline=0.05",
            "--out=docs/data/compression_small.json",
            "--max_steps=3",
            "--methods=bf16,ef_sign+sgd",
            "--max_loss_vs_baseline=-0.5",
            f"--out={out}",
        ],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("check failed: ")]
    assert lines == [
        "check failed: bf16, ef_sign+sgd ended more than -50.0% above their baseline's loss "
        "(--max_loss_vs_baseline)"
    ], proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert list(runs) == ["none", "none+sgd", "bf16", "ef_sign+sgd"]
    assert runs["ef_sign+sgd"]["baseline"] == "none+sgd" and runs["bf16"]["baseline"] == "none"
    assert runs["none+sgd"]["train"] == {"optimizer": "sgd", "momentum": 0.9, "learning_rate": 0.3}
    assert runs["ef_sign+sgd"]["ratio"] > 15  # one bit a value and a scale per tensor
    for r in runs.values():
        assert np.isfinite(r["final_loss"])
        expected = r["final_loss"] / runs[r["baseline"]]["final_loss"] - 1
        assert r["loss_vs_baseline"] == pytest.approx(expected)
    assert result["max_loss_vs_baseline"] == -0.5
    assert result["over_bound"] == ["bf16", "ef_sign+sgd"]


def test_aggregation_study_end_to_end(tmp_path):
    out = tmp_path / "aggregation.json"
    proc = run_bench(  # docs/AGGREGATION.md's command as written, then more parts, shorter
        "--study=aggregation",
        "--parts=algorithms",
        "--config.mesh.data=8",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        "--out=runs/bench/aggregation.json",
        f"--out={out}",
        "--steps=1",
        "--warmup=0",
        "--taus=0,1",
        "--max_steps=4",
        "--eval_every=2",
        "--parts=algorithms,staleness,per_hop",
        "--rows=1,3",
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
    assert list(hops) == ["none", "ring + bf16 per hop"]  # --rows=1,3 of the per_hop table
    assert hops["ring + bf16 per hop"] == pytest.approx(hops["none"] / 2, rel=1e-3)


def test_batch_study_tunes_once_scales_by_the_rule_and_retunes(tmp_path):
    """--study=batch's code path: the base-batch sweep picks one rate, the rule scales it (none
    for muon), --retune tries multipliers of it, and the summary names a critical batch."""
    out = tmp_path / "batch.json"
    run_bench(
        f"--out={out}",
        "--study=batch",
        "--optimizers=muon",
        "--batch_sizes=16,32",
        "--lr_grid=1,2",
        "--retune=2",
        "--max_steps=2",
        "--eval_every_examples=32",
        "--val_examples=8",
        "--target_loss=100",  # reached at the first check: the code path, not the optimizer
        "--partial",
    )
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["batch_size"], r["kind"], r["lr_multiplier"]) for r in runs] == [
        (16, "sweep", 1.0),
        (16, "sweep", 2.0),
        (32, "rule", 1.0),
        (32, "retune", 2.0),
    ]
    # The sweep: Muon's base rate (--muon_learning_rate, 0.02) times each --lr_grid multiplier.
    assert [r["learning_rate"] for r in runs[:2]] == pytest.approx([0.02, 0.04])
    chosen = [r for r in runs if r.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["batch_size"] == 16
    # Muon's rule is none: the chosen rate carries to batch 32 unchanged; eval every 32 examples.
    assert runs[2]["learning_rate"] == chosen[0]["learning_rate"]
    assert runs[3]["learning_rate"] == 2 * chosen[0]["learning_rate"]
    assert [r["steps"] for r in runs] == [2, 2, 1, 1]
    assert [r["examples"] for r in runs] == [32, 32, 32, 32]
    summary = result["summary"]["muon"]
    assert summary["critical_batch_rule"] == 32 and summary["critical_batch_retuned"] == 32
    assert summary["critical_batch_rule_lower_bound"]  # 32 is the largest batch measured
    assert result["lr_rules"] == {"muon": "none"} and len(result["load_average_start"]) == 3
    assert all(r["step_time_s"] > 0 for r in runs)


def refused(*flags: str) -> tuple[list[str], str]:
    """scripts/bench.py with `flags`, which it must refuse: exit 2 and no traceback; (the
    non-empty stderr lines, stdout)."""
    proc = subprocess.run(
        [python(), "scripts/bench.py", *flags],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ln.strip()], proc.stdout


def test_context_study_refuses_a_context_size_that_does_not_divide_the_devices(tmp_path):
    """`--contexts` (the context sizes `--study=context` runs, data = 8 / context): a size that
    does not divide the 8 devices is refused in one line naming the valid ones, before anything
    compiles, and no result is written."""
    out = tmp_path / "context.json"
    flags = ("--study=context", "--config=configs/llama_tiny.py", "--contexts=1,3", f"--out={out}")
    lines, stdout = refused(*flags)
    assert lines == [
        "error: --contexts=1,3: each must divide the study's 8 devices; valid: 1, 2, 4, 8 "
        "(e.g. --contexts=1,2,4,8)"
    ]
    assert not out.exists() and "mode" not in stdout  # no row was run


@pytest.mark.parametrize(
    "rows, line",
    [
        ("3,x", "error: --rows=3,x: row numbers are whole numbers from 1 (e.g. --rows=1,3)"),
        (
            "3,4",
            "error: --rows=3,4: --parts=per_hop_topk has rows 1 to 2, none of them picked; name "
            "at least one (e.g. --rows=1)",
        ),
    ],
)
def test_aggregation_study_refuses_rows_that_pick_nothing(tmp_path, rows, line):
    """`--rows` numbers the rows of the per-hop / compress_over / streaming tables; a number that
    is not one, or a set that picks no row of a requested table, is refused in one line before
    anything compiles, and no result is written."""
    out = tmp_path / "aggregation.json"
    parts = "--parts=per_hop,per_hop_topk"
    lines, stdout = refused(*TINY, "--study=aggregation", parts, f"--rows={rows}", f"--out={out}")
    assert lines == [line]
    assert not out.exists() and "busiest" not in stdout  # no row was run
