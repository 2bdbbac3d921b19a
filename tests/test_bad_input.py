"""Bad input a user can type, run through the real `scripts/train.py`: one line, no traceback.

Each refused input gets exit code 2 and a single `error: ...` line on stderr naming the field or
file and what would be valid, before anything compiles, with nothing written. Two inputs are not
errors and say so in one line instead: rerunning a finished run (exit 0, nothing appended) and
resuming with another `train.steps` (the learning-rate schedule is recomputed). Noise given as
text data trains, with a warning. tests/test_script.py holds the config-field cases.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import python

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "scripts" / "train.py")

# The default job's model, shrunk: each run that trains compiles in a few seconds.
TINY = (
    "--config.train.steps=2",
    "--config.model.d_model=32",
    "--config.model.seq_len=16",
    "--config.train.batch_size=8",
    "--config.data.max_bytes=200000",
    "--config.train.log_every=1",
    "--config.train.warmup_steps=1",
    "--config.train.eval_batches=1",
    "--config.checkpoint.every=1",
)


def run_train(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if not any(a.startswith("--config=") for a in args):  # the default, from any folder
        args = (f"--config={ROOT / 'configs' / 'default.py'}", *args)
    return subprocess.run(
        [python(), TRAIN, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refused run (exit code 2, no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------------
# Refused before compiling, nothing written: all started at once (each is a short process).


def _files(root: Path) -> dict[str, Path]:
    """Inputs the refused runs point at."""
    odd = root / "odd.bin"
    odd.write_bytes(np.arange(500, dtype=np.uint16).tobytes() + b"\x01")  # 1001 bytes
    a_file = root / "a_file"
    a_file.write_text("not a folder\n")
    return {"odd": odd, "a_file": a_file}


REFUSED = {
    # name: (arguments, with {root} and {new} filled in; what the line must say)
    "odd-length token file": (
        ("--workdir={new}", "--config.data.source={root}/odd.bin"),
        "data.source='{root}/odd.bin' is 1001 bytes, not a whole number of uint16 tokens",
    ),
    "workdir is a file": (
        ("--workdir={root}/a_file",),
        "--workdir={root}/a_file is an existing file; name a folder",
    ),
    "empty workdir": (("--workdir=",), "--workdir is empty; name the run's folder"),
    "vocab far over device memory": (
        ("--workdir={new}", "--config.model.vocab_size=100000000"),
        "over the 1.5× limit; make the model smaller (model.vocab_size=100000000",
    ),
    "learning rate inf": (
        ("--workdir={new}", "--config.train.learning_rate=inf"),
        "train.learning_rate=inf must be a finite number > 0",
    ),
    "learning rate nan": (
        ("--workdir={new}", "--config.train.learning_rate=nan"),
        "train.learning_rate=nan must be a finite number > 0",
    ),
    "max_skipped zero": (
        ("--workdir={new}", "--config.train.max_skipped=0"),
        "train.max_skipped=0 must be a positive integer",
    ),
    "learning rate negative": (
        ("--workdir={new}", "--config.train.learning_rate=-0.1"),
        "train.learning_rate=-0.1 must be a finite number > 0",
    ),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    _files(root)
    runs = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for name, (args, _) in REFUSED.items():
            cwd = root / name.replace(" ", "_")  # the run's own folder: `--workdir=` used cwd
            cwd.mkdir()
            new = cwd / "run"
            filled = [a.format(root=root, new=new) for a in args]
            runs[name] = (cwd, pool.submit(run_train, *TINY, *filled, cwd=cwd, timeout=120))
        return root, {name: (cwd, f.result()) for name, (cwd, f) in runs.items()}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_with_one_line_and_nothing_written(name, refused):
    root, runs = refused
    cwd, proc = runs[name]
    line = error_line(proc)
    assert REFUSED[name][1].format(root=root) in line, line
    assert "jaxdist │" not in proc.stdout  # stopped before the compiled step's summary
    assert sorted(os.listdir(cwd)) == [], os.listdir(cwd)  # no workdir, nothing in cwd


def test_predicted_memory_refusal_gives_the_figures(refused):
    _, runs = refused
    line = error_line(runs["vocab far over device memory"][1])
    # e.g. "predicted memory per device 29.8 GiB (params 6.0, optimizer 11.9, temp 11.9 GiB; ...)
    # is 10.1× the 2.9 GiB of one device (host memory 23.5 GiB / 8 CPU devices)"
    assert "predicted memory per device " in line and "GiB of one device (host memory" in line


def test_odd_length_validation_file_names_it(tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    np.arange(4000, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "val.bin").write_bytes(b"\x00" * 301)
    proc = run_train(*TINY, f"--workdir={tmp_path / 'run'}", f"--config.data.source={folder}")
    line = error_line(proc)
    assert f"data.source='{folder}': {folder}/val.bin is 301 bytes" in line, line
    assert not (tmp_path / "run").exists()


def _read_only_folders(tmp_path: Path) -> list[tuple[str, Path]]:
    """Folders no file can be created in, for this user: root ignores permission bits."""
    found = []
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        found.append(("no write permission", locked))
    sys_kernel = Path("/sys/kernel")  # sysfs: read-only for files a user creates, root included
    if sys_kernel.is_dir():
        try:
            (sys_kernel / "jaxdist-probe").touch()
        except OSError:
            found.append(("read-only file system", sys_kernel))
    return found


def test_read_only_workdir_is_refused_before_anything_runs(tmp_path):
    folders = _read_only_folders(tmp_path)
    if not folders:
        pytest.skip("no folder here refuses writes to this user")
    for what, folder in folders:
        for workdir in (folder, folder / "new_run"):  # the folder itself, and a run inside it
            line = error_line(run_train(*TINY, f"--workdir={workdir}", timeout=120))
            assert f"--workdir={workdir}: cannot write in {folder} (" in line, (what, line)
            assert "choose a writable folder" in line, line
            assert not workdir.exists() or workdir == folder


# ------------------------------------------------------------------------------------------------
# A finished tiny GPT run, copied for each case that reruns or resumes it.


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finished") / "run"
    proc = run_train(*TINY, f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: step 2," in proc.stdout
    return workdir, proc


@pytest.fixture
def finished_copy(finished, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished[0], workdir)
    return workdir


def test_rerunning_a_finished_run_says_so_and_appends_nothing(finished_copy):
    before = snapshot(finished_copy)
    proc = run_train(*TINY, f"--workdir={finished_copy}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "nan" not in proc.stdout, proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines == [
        f"already finished: step 2 of 2 (train.steps) in {finished_copy / 'checkpoints'}; "
        "raise train.steps to train on, or use a new --workdir"
    ], proc.stdout
    assert snapshot(finished_copy) == before  # no duplicate eval record, no new checkpoint
    evals = [r for r in map(json.loads, (finished_copy / "metrics.jsonl").open()) if "kind" in r]
    assert [r["kind"] for r in evals] == ["layout", "eval", "goodput"]


def test_resuming_with_other_train_steps_says_the_schedule_is_recomputed(finished_copy):
    proc = run_train(*TINY, "--config.train.steps=3", f"--workdir={finished_copy}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("train.steps changed")]
    assert len(notes) == 1, proc.stdout
    assert notes[0].startswith(
        "train.steps changed from 2 to 3: the learning-rate schedule is recomputed for 3 steps"
    ), notes[0]
    assert "done: step 3," in proc.stdout


def test_resuming_with_the_same_steps_prints_no_schedule_note(finished):
    _, proc = finished
    assert "train.steps changed" not in proc.stdout and "warning" not in proc.stderr


def test_another_model_family_in_a_gpt_workdir_names_model_name(finished_copy):
    before = snapshot(finished_copy)
    proc = run_train("--config=configs/mlp.py", f"--workdir={finished_copy}", timeout=120)
    line = error_line(proc)
    assert "config field model.name differs from the checkpoint: saved 'gpt', now 'mlp'" in line
    assert snapshot(finished_copy) == before


@pytest.mark.parametrize(
    "flag, field, why",
    [
        ("--config.train.batch_size=16", "train.batch_size", "data position counts batches"),
        ("--config.train.seed=1", "train.seed", "data position is in that seed's order"),
        ("--config.data.max_bytes=100000", "data.max_bytes", "data position indexes that data"),
        ("--config.train.optimizer=lamb", "train.optimizer", "optimizer state is that optimizer's"),
    ],
)
def test_resuming_with_other_data_order_or_optimizer_is_refused(finished_copy, flag, field, why):
    before = snapshot(finished_copy)
    line = error_line(
        run_train(*TINY, "--config.train.steps=3", flag, f"--workdir={finished_copy}")
    )
    assert f"config field {field} differs from the checkpoint" in line, line
    assert why in line and "use the saved value or a new workdir" in line, line
    assert snapshot(finished_copy) == before


def test_resuming_with_other_hyperparameters_and_mesh_is_accepted(finished_copy):
    proc = run_train(
        *TINY,
        "--config.train.steps=3",
        "--config.train.learning_rate=1e-3",
        "--config.train.b2=0.99",
        "--config.train.weight_decay=0.1",
        "--config.mesh.data=8",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        f"--workdir={finished_copy}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {finished_copy / 'checkpoints'} at step 2" in proc.stdout
    assert "done: step 3," in proc.stdout


def test_skipped_updates_are_printed_and_stop_at_max_skipped(tmp_path):
    # A learning rate of 1e30 makes every step after the 2 warmup steps non-finite.
    workdir = tmp_path / "run"
    proc = run_train(
        *TINY,
        "--config.train.steps=8",
        "--config.train.warmup_steps=2",
        "--config.train.learning_rate=1e30",
        "--config.train.on_nonfinite=skip",
        "--config.train.max_skipped=3",
        f"--workdir={workdir}",
    )
    line = error_line(proc)
    skips = [ln for ln in proc.stdout.splitlines() if "update skipped" in ln]
    assert len(skips) == 3, proc.stdout
    first = int(skips[0].split(":")[0].removeprefix("step "))
    for n, skip in enumerate(skips, 1):
        assert skip == (
            f"step {first + n - 1}: non-finite loss or gradient, update skipped ({n} in a row; "
            "stopping at train.max_skipped=3)"
        ), skip
    assert line.startswith(
        f"error: 3 non-finite steps in a row ({first} to {first + 2}), each update skipped: "
        "stopped at train.max_skipped=3; last good checkpoint: step "
    ), line
    assert "done:" not in proc.stdout


# ------------------------------------------------------------------------------------------------
# Not an error, but worth a line.


def test_random_bytes_as_text_train_with_a_noise_warning(tmp_path):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(np.random.default_rng(0).bytes(300_000))
    proc = run_train(
        *TINY,
        "--config.train.steps=1",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.source={noise}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert f"data.source='{noise}' looks like noise, not text" in warnings[0], warnings[0]
    assert "Traceback" not in proc.stderr


def test_noise_warning_spares_text_and_small_samples():
    from jaxdist import data

    text = np.frombuffer(Path(data.__file__).read_bytes() * 4, dtype=np.uint8)
    assert data.byte_entropy(text) < 6 and data.noise_warning("x", text) is None
    noise = np.frombuffer(np.random.default_rng(1).bytes(1 << 16), dtype=np.uint8)
    assert data.byte_entropy(noise) > 7.9 and data.noise_warning("x", noise)
    assert data.noise_warning("x", noise[:1000]) is None  # too little to judge
