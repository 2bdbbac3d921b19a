"""Multi-host acceptance: `launch.py` + the real `train.py`, compared with one process.

Every run here is a real subprocess on CPU (JAX_PLATFORMS=cpu): either one process simulating 8
devices, or `scripts/launch.py --num_processes=2 --devices_per_process=4`, i.e. two JAX processes
that form one job over gloo. Both get the very same `train.py` flags (JAXDIST_CPU_DEVICES=4 from
the launcher overrides `runtime.cpu_devices=8` in each child), so the only difference is where the
8 devices live. Losses are read from `metrics.jsonl` (log_every=1) and must agree to 1e-6 relative.

What the non-zero process writes is recorded with a Python audit hook (a `sitecustomize.py` put
on PYTHONPATH for these runs only): every open-for-write, mkdir, rename and remove under the
workdir, per rank. Process 1 may write only under `checkpoints/` (its shards); process 0's log
must show metrics.jsonl, which proves the hook sees such writes at all.

Runs that do not depend on each other are started together to keep the wall time down.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import env_without_cluster, python

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch.py"
TRAIN = "scripts/train.py"
RTOL = 1e-6
RUN_TIMEOUT_S = 420  # a single short run takes ~45 s on a loaded 2-core machine

# A small GPT with a schedule that does not depend on train.steps (2 warmup steps, then constant),
# so a run of 4 steps resumed to 6 follows the same learning rates as an uninterrupted 6-step run.
SMALL = (
    "--config.model.num_layers=1",
    "--config.model.d_model=64",
    "--config.model.num_heads=4",
    "--config.model.seq_len=32",
    "--config.train.batch_size=16",
    "--config.train.log_every=1",
    "--config.train.eval_batches=1",
    "--config.train.schedule=constant",
    "--config.train.warmup_steps=2",
    "--config.data.max_bytes=1000000",
    "--config.runtime.cpu_devices=8",
)
DATA_TENSOR = ("--config.mesh.data=4", "--config.mesh.fsdp=1", "--config.mesh.tensor=2")
FSDP = ("--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1")

AUDIT_ENV = "JAXDIST_TEST_AUDIT_PREFIX"  # set after the JAXDIST_* clean-up in _env()
SITECUSTOMIZE = r'''
"""Test-only audit hook: logs writes under a workdir, one file per JAX process (rank)."""
import os, sys, threading

_prefix = os.environ.get("JAXDIST_TEST_AUDIT_PREFIX")
_rank = os.environ.get("JAXDIST_PROCESS_ID")
if _prefix and _rank is not None:
    _log = open(f"{_prefix}.rank{_rank}", "a", buffering=1, encoding="utf-8")
    _lock = threading.Lock()
    _busy = threading.local()
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def _note(kind, path):
        if isinstance(path, int) or path is None:
            return
        try:
            path = os.path.abspath(os.fsdecode(path))
        except Exception:
            return
        with _lock:
            _log.write(f"{kind}\t{path}\n")

    def _hook(event, args):
        if getattr(_busy, "on", False):
            return
        _busy.on = True
        try:
            if event == "open":
                path, mode, flags = args
                if (mode is not None and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
                ):
                    _note("open", path)
            elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree"):
                _note(event, args[0])
            elif event in ("os.rename", "os.replace", "os.link", "os.symlink"):
                _note(event, args[1])
        finally:
            _busy.on = False

    sys.addaudithook(_hook)
'''


# ---------------------------------------------------------------------------------------------
# Running things.


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("audit")
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return d


def _env(audit_dir: pathlib.Path | None, tag: str | None) -> dict[str, str]:
    env = env_without_cluster()
    env["JAX_PLATFORMS"] = "cpu"
    paths = [str(ROOT), env.get("PYTHONPATH")]
    if audit_dir is not None and tag is not None:
        paths.insert(0, str(audit_dir))
        env[AUDIT_ENV] = str(audit_dir / tag)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def train_cmd(
    workdir: pathlib.Path, *flags: str, processes: int = 1, interpreter: str = sys.executable
) -> list[str]:
    """scripts/train.py on `processes` processes (scripts/launch.py's, for more than one).
    `interpreter` runs the training processes: helpers.python() forks them from the suite's server
    (tests/prefork.py); a test that signals or finds a training process by its pid or command
    line keeps this interpreter's, so the process is the script itself."""
    train = [interpreter, TRAIN, f"--workdir={workdir}", *SMALL, *flags]
    if processes == 1:
        return train
    launch = [sys.executable, str(LAUNCH), f"--num_processes={processes}"]
    return [*launch, f"--devices_per_process={8 // processes}", "--grace_s=2", "--", *train]


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def run_ok(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    out = run(cmd, env)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def in_parallel(*jobs):
    """Runs (cmd, env) pairs concurrently; returns their CompletedProcesses in order."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_ok, cmd, env) for cmd, env in jobs]
        return [f.result() for f in futures]


# ---------------------------------------------------------------------------------------------
# Reading what the runs wrote.


def records(workdir: pathlib.Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(workdir: pathlib.Path) -> dict[int, float]:
    """step -> loss of every logged training step (a resumed run's lines come after the first's)."""
    return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    assert sorted(got) == steps, f"logged steps {sorted(got)}, expected {steps}"
    bad = [
        f"step {s}: {got[s]!r} vs {want[s]!r} (rel {abs(got[s] - want[s]) / abs(want[s]):.2e})"
        for s in steps
        if not abs(got[s] - want[s]) <= RTOL * abs(want[s])
    ]
    assert not bad, "losses differ beyond 1e-6 relative: " + "; ".join(bad)


def assert_training_moves(loss_by_step: dict[int, float]) -> None:
    """The comparison is not vacuous: losses change from step to step by far more than RTOL."""
    values = [loss_by_step[s] for s in sorted(loss_by_step)]
    assert all(abs(a - b) > 1e-4 * abs(a) for a, b in zip(values, values[1:])), values


def audit_log(audit_dir: pathlib.Path, tag: str, rank: int) -> list[tuple[str, str]]:
    path = audit_dir / f"{tag}.rank{rank}"
    assert path.exists(), f"no audit log for rank {rank} of {tag}: is the hook installed?"
    return [tuple(line.split("\t", 1)) for line in path.read_text().splitlines()]


def assert_written_by_process_zero_only(
    workdir: pathlib.Path,
    audit_dir: pathlib.Path,
    tag: str,
    mesh: dict[str, int],
    *,
    records_: list[dict] | None = None,
    files: list[str] | None = None,
) -> None:
    """One layout record for the 2-process job; process 1 wrote at most checkpoint files.

    `records_` and `files` are snapshots of metrics.jsonl and the workdir's listing, taken before a
    later run in the same workdir added to them; default: read now.
    """
    recs = records(workdir) if records_ is None else records_
    layouts = [r for r in recs if r.get("kind") == "layout"]
    assert len(layouts) == 1, f"{len(layouts)} layout records"
    assert recs[0] is layouts[0]
    assert layouts[0]["processes"] == 2 and layouts[0]["devices"] == 8
    assert layouts[0]["mesh"] == {**mesh, "pipeline": 1}, layouts[0]["mesh"]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == sorted(set(steps)), f"a step was logged twice: {steps}"

    top = sorted(p.name for p in workdir.iterdir()) if files is None else files
    events = [n for n in top if n.startswith("events.out.tfevents")]
    assert len(events) == 1, f"TensorBoard files: {events}"
    assert sorted(set(top) - set(events)) == ["checkpoints", "config.json", "metrics.jsonl"], top

    roots = {os.path.abspath(workdir), os.path.realpath(workdir)}

    def inside(path: str) -> str | None:
        for root in roots:
            if path.startswith(root + os.sep):
                return os.path.relpath(path, root)
        return None

    zero = {inside(p) for _, p in audit_log(audit_dir, tag, 0)}
    assert {"metrics.jsonl", "config.json"} <= zero, "the audit hook saw no writes of process 0"
    one = [(kind, inside(p)) for kind, p in audit_log(audit_dir, tag, 1) if inside(p)]
    stray = [(k, rel) for k, rel in one if rel.split(os.sep)[0] != "checkpoints"]
    assert not stray, f"process 1 wrote into the workdir outside checkpoints/: {stray}"


# ---------------------------------------------------------------------------------------------
# 1 and 2: equal losses on two meshes; checkpoints written by one layout, resumed by the other.

DATA_TENSOR_MESH = {"data": 4, "fsdp": 1, "tensor": 2}
FSDP_MESH = {"data": 1, "fsdp": 8, "tensor": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, audit_dir):
    """Six runs, in two waves of three concurrent ones.

    data=4 × tensor=2, checkpoints every 2 steps:
      ref:        1 process × 8 devices, 6 steps (checkpoints 2, 4, 6): the uninterrupted reference.
      two:        2 processes × 4 devices, 4 steps (checkpoints 2, 4).
      two_to_one: then `two`'s workdir resumed in 1 process up to step 6.
      one_to_two: then a fresh workdir holding `ref`'s checkpoints 2 and 4, resumed in 2 processes.
    fsdp=8, no checkpoints, 3 steps:
      fsdp_two (wave 1) and fsdp_one (wave 2): 2 processes × 4 devices, and 1 process × 8 devices.
    """
    root = tmp_path_factory.mktemp("runs")
    w = {
        name: root / name for name in ("ref", "two", "one_to_two", "fsdp_one", "fsdp_two", "hybrid")
    }
    dt = (*DATA_TENSOR, "--config.checkpoint.every=2")
    fsdp = (*FSDP, "--config.checkpoint.every=0", "--config.train.steps=3")
    res: dict = {}
    res["out_ref"], res["out_two"], res["out_fsdp_two"] = in_parallel(
        (
            train_cmd(w["ref"], *dt, "--config.train.steps=6", interpreter=python()),
            _env(None, None),
        ),
        (train_cmd(w["two"], *dt, "--config.train.steps=4", processes=2), _env(audit_dir, "two")),
        (train_cmd(w["fsdp_two"], *fsdp, processes=2), _env(audit_dir, "fsdp_two")),
    )
    # What the 2-process job wrote, before the 1-process resume appends to it.
    res["two"] = losses(w["two"])
    res["two_records"] = records(w["two"])
    res["two_files"] = sorted(p.name for p in w["two"].iterdir())

    (w["one_to_two"] / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(
            w["ref"] / "checkpoints" / str(step), w["one_to_two"] / "checkpoints" / str(step)
        )
    res["out_two_to_one"], res["out_one_to_two"], _, res["out_hybrid"] = in_parallel(
        (
            train_cmd(w["two"], *dt, "--config.train.steps=6", interpreter=python()),
            _env(None, None),
        ),
        (
            train_cmd(w["one_to_two"], *dt, "--config.train.steps=6", processes=2),
            _env(audit_dir, "one_to_two"),
        ),
        (train_cmd(w["fsdp_one"], *fsdp, interpreter=python()), _env(None, None)),
        # The hybrid host × device mesh: data=4 with 2 of it across the 2 processes (slow links).
        (
            train_cmd(
                w["hybrid"],
                *DATA_TENSOR,
                "--config.mesh.dcn_data=2",
                "--config.checkpoint.every=0",
                "--config.train.steps=4",
                processes=2,
                interpreter=python(),
            ),
            _env(None, None),
        ),
    )
    res["ref"] = losses(w["ref"])
    res["two_to_one"] = losses(w["two"])
    res["one_to_two"] = losses(w["one_to_two"])
    res["fsdp_one"] = losses(w["fsdp_one"])
    res["fsdp_two"] = losses(w["fsdp_two"])
    res["hybrid"] = losses(w["hybrid"])
    res["dirs"] = w
    return res


def test_two_processes_match_one_process_data_tensor(runs, audit_dir):
    assert sorted(runs["ref"]) == [1, 2, 3, 4, 5, 6]
    assert_training_moves(runs["ref"])
    assert_losses_match(runs["two"], runs["ref"], [1, 2, 3, 4])
    # Only process 0 prints the step lines (the launcher prefixes each process's output).
    assert "[0] step      4" in runs["out_two"].stdout
    assert "[1] step" not in runs["out_two"].stdout
    assert_written_by_process_zero_only(
        runs["dirs"]["two"],
        audit_dir,
        "two",
        DATA_TENSOR_MESH,
        records_=runs["two_records"],
        files=runs["two_files"],
    )


def test_hybrid_dcn_mesh_matches_one_process(runs):
    assert_losses_match(runs["hybrid"], runs["ref"], [1, 2, 3, 4])
    layout = records(runs["dirs"]["hybrid"])[0]
    assert layout["processes"] == 2 and layout["mesh"] == {**DATA_TENSOR_MESH, "pipeline": 1}


def test_two_processes_match_one_process_fsdp(runs, audit_dir):
    ref = runs["fsdp_one"]
    assert sorted(ref) == [1, 2, 3]
    assert_training_moves(ref)
    assert_losses_match(runs["fsdp_two"], ref, [1, 2, 3])
    assert_written_by_process_zero_only(runs["dirs"]["fsdp_two"], audit_dir, "fsdp_two", FSDP_MESH)


def written_by(step_dir: pathlib.Path) -> tuple[int, list[str]]:
    """(process_count in our metadata, the processes with data files in the OCDBT store)."""
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    writers = sorted(
        d.name
        for d in (step_dir / "state").glob("ocdbt.process_*")
        if any(f.is_file() for f in d.rglob("*"))
    )
    return meta["process_count"], writers


def test_checkpoint_from_two_processes_resumes_in_one(runs):
    ckpts = runs["dirs"]["two"] / "checkpoints"
    # The saves at 2 and 4 were cooperative: each process wrote its own shards, one commit.
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "4", "6"]
    both = (2, ["ocdbt.process_0", "ocdbt.process_1"])
    assert written_by(ckpts / "2") == both and written_by(ckpts / "4") == both
    assert written_by(ckpts / "6") == (1, ["ocdbt.process_0"])  # the 1-process resume's
    out = runs["out_two_to_one"].stdout
    assert "resumed from" in out and "at step 4" in out, out[-2000:]
    resumed = {s: v for s, v in runs["two_to_one"].items() if s > 4}
    assert_losses_match(resumed, runs["ref"], [5, 6])
    # The first 4 steps are still the 2-process job's, not rewritten.
    assert {s: runs["two_to_one"][s] for s in range(1, 5)} == runs["two"]


def test_checkpoint_from_one_process_resumes_in_two(runs, audit_dir):
    out = runs["out_one_to_two"].stdout
    assert "[0] resumed from" in out and "at step 4" in out, out[-2000:]
    assert_losses_match(runs["one_to_two"], runs["ref"], [5, 6])
    w = runs["dirs"]["one_to_two"]
    assert_written_by_process_zero_only(w, audit_dir, "one_to_two", DATA_TENSOR_MESH)
    assert sorted(p.name for p in (w / "checkpoints").iterdir()) == ["2", "4", "6"]
    assert written_by(w / "checkpoints" / "4") == (1, ["ocdbt.process_0"])  # copied from `ref`
    assert written_by(w / "checkpoints" / "6") == (2, ["ocdbt.process_0", "ocdbt.process_1"])


# ---------------------------------------------------------------------------------------------
# 3: a worker killed mid-run takes the job down, and the launcher says which one.


def _pids_with(marker: str, env_entry: str | None = None) -> list[int]:
    """Our processes whose command line contains `marker` (and whose environment has an entry)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(marker.encode() in arg for arg in cmdline):
                continue
            if env_entry is not None:
                if env_entry.encode() not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
        except OSError:  # gone, or not ours
            continue
        pids.append(int(entry.name))
    return pids


def test_killing_a_worker_stops_the_job(tmp_path):
    workdir = tmp_path / f"killed-{os.getpid()}-{time.monotonic_ns()}"  # unique in /proc
    cmd = train_cmd(workdir, *DATA_TENSOR, "--config.train.steps=100000", processes=2)
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(None, None), stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        metrics = workdir / "metrics.jsonl"
        while not (metrics.exists() and '"step"' in metrics.read_text()):  # training under way
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step logged"
            time.sleep(0.2)
        victims = _pids_with(str(workdir), "JAXDIST_PROCESS_ID=1")
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        killed_at = time.monotonic()
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()  # its children follow (PR_SET_PDEATHSIG)
            proc.wait()
    stderr = err_path.read_text()
    assert rc == 128 + signal.SIGKILL, stderr[-3000:]
    assert elapsed < 60
    assert "launch.py: process 1 was killed by SIGKILL" in stderr, stderr[-3000:]
    assert _pids_with(str(workdir)) == [], "a worker outlived the launcher"
