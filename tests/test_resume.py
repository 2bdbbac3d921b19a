"""Checkpoints that survive anything: kill -9, SIGTERM/SIGINT, NaN, a foreign model, corruption.

Every run here is the real `scripts/train.py` in a subprocess on one CPU device (fp32, a 1-layer
GPT with d_model=32), logging every step. Interrupted runs are restarted with the very same command
and must end BIT-identical to an uninterrupted reference: the loss of every step (metrics.jsonl; a
resumed run appends, the last line for a step wins) and every array of the final checkpoint.

The runs share a persistent XLA compilation cache (a temporary folder for this module), so only
the first run pays for compiling; a resumed run starts in a few seconds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from jaxdist import checkpoint
from tests.helpers import (
    ONE_DEVICE_GPT_FLAGS,
    ORBAX_ABANDONED_READS,
    env_without_cluster,
    python,
    suite_xla_flags,
)

ROOT = Path(__file__).resolve().parents[1]
# Verifying the corrupted checkpoint below (in this process) leaves orbax reads in flight.
pytestmark = [pytest.mark.slow, *ORBAX_ABANDONED_READS]

STEPS = 24
EVERY = 2  # checkpoint cadence: saves are nearly always in flight, so kills land inside them
TINY = (
    *ONE_DEVICE_GPT_FLAGS,
    "--config.train.eval_batches=1",
    "--config.train.schedule=constant",
    "--config.train.warmup_steps=2",
    "--config.train.compute_dtype=float32",
    "--config.data.max_bytes=200000",
    "--config.checkpoint.keep=3",
)
# The command every interrupted run is restarted with, and the reference runs once.
COMMON = (*TINY, f"--config.train.steps={STEPS}", f"--config.checkpoint.every={EVERY}")
RUN_TIMEOUT_S = 240
TMP_MARK = ".orbax-checkpoint-tmp"
# ---------------------------------------------------------------------------------------------
# Running train.py.


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    env = env_without_cluster()
    env["XLA_FLAGS"] = suite_xla_flags()
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        PYTHONUNBUFFERED="1",
    )
    return env


class Run:
    """One `train.py` process with its output in files (so a killed one's output survives)."""

    count = 0

    def __init__(self, workdir: Path, env: dict[str, str], *flags: str):
        Run.count += 1
        self.workdir = workdir
        logs = workdir.parent / f"{workdir.name}.logs"
        logs.mkdir(exist_ok=True)
        self.out_path = logs / f"{Run.count}.stdout"
        self.err_path = logs / f"{Run.count}.stderr"
        cmd = [python(), "scripts/train.py", f"--workdir={workdir}", *flags]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def until(self, predicate, what: str, poll_s: float = 0.002):
        """Polls `predicate()` until it returns something truthy; None if the run ended first."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            found = predicate()
            if found:
                return found
            if self.proc.poll() is not None:
                return None
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"timed out waiting for {what}\n{self.stderr[-3000:]}")
            time.sleep(poll_s)

    def describe(self) -> str:
        return f"rc={self.proc.returncode}\n{self.stdout[-2000:]}\n{self.stderr[-3000:]}"


def run_ok(workdir: Path, env: dict[str, str], *flags: str) -> Run:
    run = Run(workdir, env, *flags)
    rc = run.wait()
    assert rc == 0, run.describe()
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    return run


# ---------------------------------------------------------------------------------------------
# Reading what the runs wrote.


def records(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(workdir: Path) -> dict[int, float]:
    """step -> loss of every logged training step; a step logged again (after a resume) wins."""
    return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


def last_logged_step(workdir: Path) -> int:
    try:  # the file grows while we read it: a torn last line means "not yet"
        steps = [r["step"] for r in records(workdir) if "loss" in r]
    except json.JSONDecodeError:
        return 0
    return max(steps, default=0)


def tmp_folders(ckpt_dir: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(ckpt_dir) if TMP_MARK in n)
    except FileNotFoundError:
        return []


def resumed_step(run: Run) -> int | None:
    found = re.findall(r"resumed from .* at step (\d+)", run.stdout)
    assert len(found) <= 1, run.stdout
    return int(found[0]) if found else None


def state_arrays(ckpt_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of the saved train state (params, optimizer state, step, rng, skipped)."""
    return checkpoint.read_arrays(ckpt_dir, step)


def assert_bit_identical(workdir: Path, reference: Path) -> None:
    """Every step's loss and every array of the final checkpoint equal the reference, bit for bit."""
    got, want = losses(workdir), losses(reference)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert sorted(got) == sorted(want), f"logged steps {sorted(got)}"
    differ = [f"step {s}: {got[s]!r} vs {want[s]!r}" for s in want if got[s] != want[s]]
    assert not differ, "losses differ from the uninterrupted run: " + "; ".join(differ)
    a = state_arrays(workdir / "checkpoints", STEPS)
    b = state_arrays(reference / "checkpoints", STEPS)
    assert sorted(a) == sorted(b)
    differ = [p for p in b if a[p].dtype != b[p].dtype or a[p].tobytes() != b[p].tobytes()]
    assert not differ, f"final checkpoint arrays differ from the uninterrupted run: {differ}"


def verify_ok(ckpt_dir: Path, step: int | None = None) -> None:
    report = checkpoint.verify_checkpoint(ckpt_dir, step)
    assert not report.problems, report.problems
    assert report.arrays > 0


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """relative path -> (size, mtime_ns, sha256) of every file; folders as (0, 0, "dir")."""
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if path.is_dir():
            out[rel] = (0, 0, "dir")
        else:
            st = path.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def one_error_line(run: Run) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{run.stderr[-3000:]}"
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The uninterrupted run every interrupted one is compared with.


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env) -> Path:
    workdir = tmp_path_factory.mktemp("reference") / "w"
    run = run_ok(workdir, env, *COMMON)
    assert resumed_step(run) is None
    loss = losses(workdir)
    assert sorted(loss) == list(range(1, STEPS + 1))
    values = [loss[s] for s in sorted(loss)]  # the comparisons are not vacuous: losses move
    assert all(a != b for a, b in zip(values, values[1:])) and values[-1] < values[0] - 0.5
    assert checkpoint.committed_steps(workdir / "checkpoints") == [STEPS - 4, STEPS - 2, STEPS]
    return workdir


# ---------------------------------------------------------------------------------------------
# 1. kill -9 anywhere, including in the middle of an asynchronous save.


def in_flight(ckpt_dir: Path) -> dict[str, tuple[int, int]]:
    """tmp folder -> (files in it, array data files among them); the folder may change as we look."""
    out = {}
    for name in tmp_folders(ckpt_dir):
        files = [os.path.join(d, f) for d, _, fs in os.walk(ckpt_dir / name) for f in fs]
        data = [f for f in files if os.sep + "ocdbt.process_" in f and f"{os.sep}d{os.sep}" in f]
        out[name] = (len(files), len(data))
    return out


def landing(left: dict[str, tuple[int, int]]) -> str:
    """Where a kill landed, from the tmp folders it left behind."""
    if not left:
        return "between saves"
    return "mid-save, data written" if any(d for _, d in left.values()) else "mid-save"


KILL_ATTEMPTS = 8  # bounded: each attempt is one short process start
WANT = {"between saves": 2, "mid-save": 1, "mid-save, data written": 1}


def kill_point(workdir: Path, aim: str, resume_at: int, own_commit: bool) -> int | None:
    """The logged step if the run is now at a point to kill it as `aim`ed, else None.

    Once a step past the resume point is logged, the stale tmp folders of an earlier kill are gone
    (the Checkpointer removes them at start), so a tmp folder is this run's save in flight. With
    `own_commit`, the run must first have committed a checkpoint of its own.
    """
    ckpt_dir = workdir / "checkpoints"
    step = last_logged_step(workdir)
    newest = max(checkpoint.committed_steps(ckpt_dir), default=0)
    if step <= max(resume_at, newest) or (own_commit and newest <= resume_at):
        return None
    return step if landing(in_flight(ckpt_dir)) == aim else None


def test_kill_9_anywhere_then_rerun_is_bit_identical(tmp_path, env, reference, nonfinite_runs):
    workdir = tmp_path / "w"
    ckpt_dir = workdir / "checkpoints"
    kills = []  # (aimed at, landed, step logged, committed after the kill, tmp folders left)
    for attempt in range(KILL_ATTEMPTS):
        landed = [k[1] for k in kills]
        short = [aim for aim, n in WANT.items() if landed.count(aim) < n]
        if not short:
            break
        aim = short[attempt % len(short)]  # the first kill, before any checkpoint, is between saves
        resume_at = max(checkpoint.committed_steps(ckpt_dir), default=0)
        run = Run(workdir, env, *COMMON)
        point = functools.partial(kill_point, workdir, aim, resume_at, own_commit=attempt > 0)
        if not run.until(point, f"a step {aim}"):  # the run finished first: nothing to kill
            assert run.proc.returncode == 0, run.describe()
            break
        run.signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        # It had restarted from the newest committed step, never from a half-written one.
        assert resumed_step(run) == (resume_at or None), run.stdout[-2000:]
        # A tmp folder left behind means the process died inside a save.
        left = in_flight(ckpt_dir)
        after = checkpoint.committed_steps(ckpt_dir)
        kills.append((aim, landing(left), last_logged_step(workdir), after, left))
        assert not {int(name.split(".")[0]) for name in left} & set(after), (left, after)
        assert max(after, default=0) >= resume_at
        if after:
            verify_ok(ckpt_dir, after[-1])

    resume_at = max(checkpoint.committed_steps(ckpt_dir), default=0)
    final = run_ok(workdir, env, *COMMON)
    assert resumed_step(final) == (resume_at or None), final.stdout[-2000:]
    assert "done: step" in final.stdout
    assert not tmp_folders(ckpt_dir), os.listdir(ckpt_dir)
    verify_ok(ckpt_dir, STEPS)
    assert_bit_identical(workdir, reference)

    landed = [k[1] for k in kills]
    counts = ", ".join(f"{landed.count(where)} {where}" for where in WANT)
    summary = (
        f"kill -9: {len(kills)} kills: {counts}; (aimed, landed, step, committed after, "
        f"tmp folder -> (files, data files)): {kills}"
    )
    print("\n" + summary)
    assert landed.count("mid-save") + landed.count("mid-save, data written") >= 1, summary
    assert landed.count("between saves") >= 1, summary


# ---------------------------------------------------------------------------------------------
# 2. SIGTERM, then SIGINT: a checkpoint at the next step boundary, exit 0, and a clean continue.


def stop_with(run: Run, signum: int, after_step: int) -> int:
    """Sends `signum` once a step past `after_step` is logged; returns the step it stopped at."""
    assert run.until(lambda: last_logged_step(run.workdir) > after_step, "training under way")
    run.signal(signum)
    assert run.wait() == 0, run.describe()
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    ckpt_dir = run.workdir / "checkpoints"
    found = re.findall(r"preempted at step (\d+): checkpoint saved in (\S+)", run.stdout)
    assert len(found) == 1, run.stdout[-2000:]
    step, where = int(found[0][0]), found[0][1]
    assert where == str(ckpt_dir)
    assert after_step < step < STEPS, step
    # It stopped at a step boundary: the step it names is the last one it ran, and it is committed.
    assert last_logged_step(run.workdir) == step
    assert checkpoint.committed_steps(ckpt_dir)[-1] == step
    assert not tmp_folders(ckpt_dir)
    assert checkpoint.read_metadata(ckpt_dir, step)["data_position"] == step
    verify_ok(ckpt_dir, step)
    return step


def test_sigterm_then_sigint_checkpoint_and_continue_bit_identical(tmp_path, env, reference):
    workdir = tmp_path / "w"
    first = Run(workdir, env, *COMMON)
    at_term = stop_with(first, signal.SIGTERM, after_step=2)

    second = Run(workdir, env, *COMMON)
    at_int = stop_with(second, signal.SIGINT, after_step=at_term + 2)
    assert resumed_step(second) == at_term

    final = run_ok(workdir, env, *COMMON)
    assert resumed_step(final) == at_int
    # Each run continued at the very next step: no step ran twice, none was skipped.
    steps = [r["step"] for r in records(workdir) if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps
    assert_bit_identical(workdir, reference)
    print(f"\nSIGTERM stopped at step {at_term}, SIGINT at step {at_int}")


# ---------------------------------------------------------------------------------------------
# 3. train.on_nonfinite: stop names the step and the last good checkpoint; skip drops updates.


def override(base: tuple[str, ...], *flags: str) -> tuple[str, ...]:
    """`base` with the fields in `flags` replaced (a flag given twice is ambiguous)."""
    keys = {f.split("=", 1)[0] for f in flags}
    return (*(f for f in base if f.split("=", 1)[0] not in keys), *flags)


# A learning rate of 1e30 (after 2 warmup steps at 0 and 5e29) makes the gradients non-finite a
# couple of steps in. Checkpoints every step, all kept (keep=10); the stop run logs only every 4th step, so
# its finiteness check of a step can lag behind that step's checkpoint save.
NAN = override(
    TINY,
    "--config.train.learning_rate=1e30",
    "--config.train.steps=8",
    "--config.checkpoint.every=1",
    "--config.checkpoint.keep=10",
)


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory, env, reference):  # after `reference`: a warm compile cache
    """Starts both runs and returns at once; the kill test asks for it so they run alongside."""
    root = tmp_path_factory.mktemp("nonfinite")
    skip = Run(root / "skip", env, *NAN, "--config.train.on_nonfinite=skip")
    stop = Run(
        root / "stop",
        env,
        *override(NAN, "--config.train.log_every=4"),
        "--config.train.on_nonfinite=stop",
    )
    yield skip, stop
    skip.kill(), stop.kill()


def first_nonfinite_step(workdir: Path) -> tuple[int, list[dict]]:
    steps = [r for r in records(workdir) if "loss" in r]
    bad = [r["step"] for r in steps if r["loss"] is None or r["grad_norm"] is None]
    assert bad, f"no non-finite step: {steps}"
    return bad[0], steps


def test_nonfinite_skip_drops_the_updates_and_finishes(nonfinite_runs):
    skip, _ = nonfinite_runs
    assert skip.wait() == 0, skip.describe()
    first_bad, steps = first_nonfinite_step(skip.workdir)
    assert first_bad > 1
    bad = [r["step"] for r in steps if r["loss"] is None or r["grad_norm"] is None]
    assert [r["skipped"] for r in steps] == [sum(b <= r["step"] for b in bad) for r in steps]
    assert steps[-1]["skipped"] == len(bad) > 0
    ckpt_dir = skip.workdir / "checkpoints"
    assert checkpoint.committed_steps(ckpt_dir) == list(range(1, 9))
    verify_ok(ckpt_dir, 8)  # every array finite
    # Every update from the first non-finite step on was dropped (all later ones were too).
    assert bad == list(range(first_bad, 9))
    good = state_arrays(ckpt_dir, first_bad - 1)
    final = state_arrays(ckpt_dir, 8)
    for path in good:
        if path.startswith(("params/", "opt_state/")):
            assert good[path].tobytes() == final[path].tobytes(), path
    assert int(final["skipped"]) == len(bad)


def test_nonfinite_stop_names_the_step_and_the_last_good_checkpoint(nonfinite_runs):
    skip, stop = nonfinite_runs
    assert skip.wait() == 0, skip.describe()
    first_bad, _ = first_nonfinite_step(skip.workdir)  # the same run, but dropping updates
    assert stop.wait() == 2, stop.describe()
    line = one_error_line(stop)
    ckpt_dir = stop.workdir / "checkpoints"
    assert f"non-finite loss or gradient at step {first_bad};" in line, line
    assert f"last good checkpoint: step {first_bad - 1} in {ckpt_dir}" in line, line
    # No checkpoint holds the non-finite state; the one it names reads back, all finite.
    assert checkpoint.committed_steps(ckpt_dir) == list(range(1, first_bad))
    verify_ok(ckpt_dir, first_bad - 1)


# ---------------------------------------------------------------------------------------------
# 4. A workdir whose checkpoints belong to a different model.


def test_checkpoints_of_another_model_are_refused_untouched(tmp_path, env, reference):
    workdir = tmp_path / "w"
    shutil.copytree(reference, workdir)
    before = snapshot(workdir)
    run = Run(workdir, env, *override(COMMON, "--config.model.d_model=64"))
    assert run.wait() == 2, run.describe()
    line = one_error_line(run)
    assert "model.d_model" in line and "saved 32, now 64" in line, line
    assert snapshot(workdir) == before  # nothing written, renamed or removed


# ---------------------------------------------------------------------------------------------
# 5. A corrupted newest checkpoint: fall back to the previous step, say so, finish identically.


def test_corrupted_newest_checkpoint_falls_back_and_finishes(tmp_path, env, reference):
    workdir = tmp_path / "w"
    shutil.copytree(reference, workdir)
    ckpt_dir = workdir / "checkpoints"
    data_files = [p for p in (ckpt_dir / str(STEPS) / "state").rglob("*") if p.parent.name == "d"]
    victim = max(data_files, key=lambda p: p.stat().st_size)
    victim.write_bytes(b"\xff" * victim.stat().st_size)
    assert checkpoint.verify_checkpoint(ckpt_dir, STEPS).problems  # really damaged

    run = run_ok(workdir, env, *COMMON)
    previous = STEPS - EVERY
    assert resumed_step(run) == previous, run.stdout[-2000:]
    assert f"checkpoint step {STEPS} in {ckpt_dir} unreadable" in run.stderr, run.stderr[-3000:]
    assert f"fell back to step {previous}" in run.stderr, run.stderr[-3000:]
    # The damaged step was moved aside, not deleted and never read again; the new one is good.
    assert [p.name for p in ckpt_dir.iterdir() if p.name.startswith(f"{STEPS}.unreadable-")]
    verify_ok(ckpt_dir, STEPS)
    assert_bit_identical(workdir, reference)
