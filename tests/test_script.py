"""The real entry point, end to end: the default job trains, evaluates, and rejects bad input."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess

import pytest

from tests.helpers import python, suite_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args: str, workdir: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = suite_xla_flags()
    workdir = os.path.relpath(workdir, ROOT)  # relative, as users type it (runs/default)
    return subprocess.run(
        [python(), "scripts/train.py", f"--workdir={workdir}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_default_job_lowers_loss_and_evaluates(tmp_path):
    # The default config, shortened: same model, mesh (data=2×fsdp=2×tensor=2) and data.
    proc = run_train(
        "--config.train.steps=30",
        "--config.train.log_every=10",
        "--config.train.eval_every=30",
        "--config.checkpoint.every=15",
        workdir=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    layout = records[0]
    assert layout["kind"] == "layout"
    assert layout["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    assert layout["bytes_per_device"]["temp"] > 0
    assert layout["collective_bytes_per_step"]["all-reduce"] > 0
    # The planner's prediction, added by the script's layout hook (the loop does not import it).
    predicted = layout["predicted_bytes_per_device"]
    assert predicted["params"] == pytest.approx(layout["bytes_per_device"]["params"], rel=0.05)
    steps = [r for r in records[1:] if "loss" in r]
    assert [r["step"] for r in steps] == [10, 20, 30]
    for r in steps:
        assert {"learning_rate", "grad_norm", "step_time_s", "tokens_per_s"} <= r.keys()
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    assert steps[0]["loss"] < 5.6  # below uniform over 256 bytes (ln 256 = 5.55) already
    evals = [r for r in records if "eval_loss" in r]
    assert evals and evals[-1]["eval_loss"] < 5.0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["train"]["steps"] == 30
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    # checkpoints under a relative --workdir (orbax wants absolute paths: the loop resolves it)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["15", "30"]
    # The console with no terminal (a pipe): a plain line per log_every steps, `done:` on its own
    # line, then where the outputs are; nothing from absl or orbax on stderr.
    out = proc.stdout.splitlines()
    logged = [ln for ln in out if ln.startswith("step ")]
    assert [ln.split(" │ ")[0] for ln in logged] == [f"step {s:6d}/30" for s in (10, 20, 30)]
    for ln in logged:
        assert " │ loss " in ln and " ms/step │ " in ln and " tok/s" in ln, ln
    assert " │ ETA " in logged[0] and " │ eval loss " in logged[-1], logged
    assert sum(ln.startswith("planner │ predicted params ") for ln in out) == 1, out
    done = [i for i, ln in enumerate(out) if ln.startswith("done: step 30, train loss ")]
    assert len(done) == 1 and ", eval loss " in out[done[0]], out
    tail = "\n".join(out[done[0] + 1 :])
    workdir = str(tmp_path.resolve())
    assert f"outputs │ {workdir}" in tail
    assert f"checkpoints  {workdir}/checkpoints (steps 15, 30)" in tail
    assert f"{workdir}/metrics.jsonl" in tail
    assert f"python scripts/plot.py {workdir}" in tail
    assert proc.stderr.strip() == "", proc.stderr[-2000:]


BAD_INPUTS = {
    "mesh product": (["--config.mesh.data=3"], "there are 8 devices"),
    "batch divisibility": (
        ["--config.train.batch_size=30"],
        "train.batch_size=30 must be divisible",
    ),
    "heads vs tensor": (
        ["--config.model.num_heads=1"],
        "model.num_heads=1 must be divisible by mesh.tensor=2",
    ),
    "mlp vs tensor": (
        ["--config.model.mlp_dim=251"],
        "model.mlp_dim=251 must be divisible by mesh.tensor=2",
    ),
    "vocab vs tensor": (
        ["--config.model.vocab_size=257"],
        "model.vocab_size=257 must be divisible by mesh.tensor=2",
    ),
    "unknown key": (["--config.train.stepz=3"], "unknown field 'train.stepz'"),
    "missing data": (
        ["--config.data.source=/no/such/corpus"],
        "data.source='/no/such/corpus': no such file",
    ),
    "zero steps": (["--config.train.steps=0"], "train.steps=0 must be a positive integer"),
    "negative batch": (
        ["--config.train.batch_size=-8"],
        "train.batch_size=-8 must be a positive integer",
    ),
    "unknown optimizer": (["--config.train.optimizer=adam"], "train.optimizer='adam' is not valid"),
    "gin unknown field": (["--gin_param=train.stepz=3"], "gin: unknown field train.stepz"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """All bad-input runs at once: each is a short process that should stop before compiling."""
    root = tmp_path_factory.mktemp("bad")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {
            name: pool.submit(
                run_train, *args, workdir=str(root / name.replace(" ", "_")), timeout=120
            )
            for name, (args, _) in BAD_INPUTS.items()
        }
        return root, {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_one_line(name, bad_runs):
    root, runs = bad_runs
    _, expected = BAD_INPUTS[name]
    proc = runs[name]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0], lines[0]
    assert not (
        root / name.replace(" ", "_") / "metrics.jsonl"
    ).exists()  # failed before anything was written


def test_gin_sets_the_same_fields(tmp_path):
    gin_file = tmp_path / "short.gin"
    gin_file.write_text("train.steps = 4\ntrain.log_every = 2\nmodel.num_layers = 1\n")
    proc = run_train(
        f"--gin_file={gin_file}",
        "--gin_param=train.batch_size=8",
        "--config.checkpoint.every=0",
        workdir=str(tmp_path / "w"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert (cfg["train"]["steps"], cfg["train"]["batch_size"], cfg["model"]["num_layers"]) == (
        4,
        8,
        1,
    )
