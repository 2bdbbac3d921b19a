"""One training run per workdir (issue 31, item 2): a second run is refused in one line naming
the holder, a dead run's lock is taken over with a line saying so, and the lock goes on every way
out. The last test drives real `scripts/train.py` processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxdist import workdir_lock
from jaxdist.errors import ConfigError
from tests.helpers import python, suite_xla_flags

REPO = Path(__file__).resolve().parents[1]
SINCE = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_acquire_is_refused_naming_the_holder_then_release_frees(tmp_path):
    lock = workdir_lock.acquire(str(tmp_path))
    path = tmp_path / workdir_lock.LOCK_NAME
    holder = json.loads(path.read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(ConfigError) as err:
        workdir_lock.acquire(str(tmp_path))  # another open file: flock says no, even in-process
    assert re.fullmatch(
        rf"--workdir={re.escape(str(tmp_path))} is in use by another training run: pid "
        rf"{os.getpid()} on host {re.escape(socket.gethostname())} since {SINCE} \(lock file "
        rf"{re.escape(str(path))}\); wait for it to finish, stop it, or use another --workdir",
        str(err.value),
    ), str(err.value)
    lock.release()
    lock.release()  # twice is fine
    assert not path.exists()
    with workdir_lock.acquire(str(tmp_path)) as again:
        assert again.held and again.note is None
    assert not path.exists()


def test_a_dead_runs_lock_is_taken_over_with_a_note(tmp_path):
    pid = _dead_pid()
    path = tmp_path / workdir_lock.LOCK_NAME
    left = {"pid": pid, "host": socket.gethostname(), "since": "2026-01-01T00:00:00+00:00"}
    path.write_text(json.dumps(left))
    with workdir_lock.acquire(str(tmp_path)) as lock:
        assert lock.note == (
            f"took over the lock of --workdir={tmp_path} from pid {pid} on host "
            f"{socket.gethostname()} since 2026-01-01T00:00:00+00:00, which is no longer running"
        )
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path):
    path = tmp_path / workdir_lock.LOCK_NAME
    # The parent process is alive, but it started at another time than the recorded holder.
    left = {"pid": os.getppid(), "host": socket.gethostname(), "since": "x", "start": 1}
    path.write_text(json.dumps(left))
    with workdir_lock.acquire(str(tmp_path)) as lock:
        assert lock.note and f"from pid {os.getppid()} " in lock.note


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
    path = tmp_path / workdir_lock.LOCK_NAME
    path.write_text(json.dumps({"pid": 12, "host": "node-7", "since": "2026-01-01T00:00:00+00:00"}))
    with pytest.raises(ConfigError, match=r"pid 12 on host node-7 .* if that run is gone, delete"):
        workdir_lock.acquire(str(tmp_path))
    assert json.loads(path.read_text())["host"] == "node-7"  # left as it was


def test_a_lock_left_by_the_launchers_earlier_attempt_is_taken_over_on_any_host(
    tmp_path, monkeypatch
):
    """After `launch.py --elastic` leaves out process 0's host, process 0 runs on another host;
    the launcher names the pids of its ended attempt, so their lock is taken over, and only
    theirs."""
    pid = _dead_pid()
    path = tmp_path / workdir_lock.LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": "host0", "since": "2026-01-01T00:00:00+00:00"}))
    monkeypatch.setenv(workdir_lock.ENV_ENDED_PIDS, f"{pid + 1},{pid + 2}")
    with pytest.raises(ConfigError, match=rf"pid {pid} on host host0 .* if that run is gone"):
        workdir_lock.acquire(str(tmp_path))
    monkeypatch.setenv(workdir_lock.ENV_ENDED_PIDS, f"{pid + 1},{pid}")
    with workdir_lock.acquire(str(tmp_path)) as lock:
        assert lock.note == (
            f"took over the lock of --workdir={tmp_path} from pid {pid} on host host0 since "
            "2026-01-01T00:00:00+00:00, a process of this job's earlier attempt (ended)"
        )
        assert json.loads(path.read_text())["pid"] == os.getpid()


def _train(workdir: Path, *extra: str, interpreter: str | None = None) -> subprocess.Popen:
    """`scripts/train.py` on configs/mlp.py; forked from the suite's preloaded interpreter unless
    `interpreter` is given (the holder, whose pid the lock must name, runs as itself)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env["XLA_FLAGS"] = suite_xla_flags()
    script = ["scripts/train.py", "--config=configs/mlp.py", f"--workdir={workdir}"]
    return subprocess.Popen(
        [interpreter or python(), *script, "--config.train.log_every=1", *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_train_processes_on_one_workdir(tmp_path):
    pytest.importorskip("sklearn", reason="configs/mlp.py trains on scikit-learn's digits")
    workdir = tmp_path / "w"
    path = workdir / workdir_lock.LOCK_NAME
    first = _train(
        workdir,
        "--config.train.steps=100000",
        "--config.checkpoint.every=0",
        interpreter=sys.executable,
    )
    try:
        deadline = time.monotonic() + 300
        while not path.exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.2)
        second = _train(workdir, "--config.train.steps=2")
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, stderr[-3000:]
        assert re.fullmatch(
            rf"error: --workdir={re.escape(str(workdir))} is in use by another training run: pid "
            rf"{first.pid} on host {re.escape(socket.gethostname())} since {SINCE} .*",
            errors[0],
        ), errors[0]
        assert first.poll() is None  # the holder runs on, untouched
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: the file stays
        first.communicate(timeout=60)
    assert json.loads(path.read_text())["pid"] == first.pid

    third = _train(workdir, "--config.train.steps=2", "--config.checkpoint.every=2")
    stdout, stderr = third.communicate(timeout=300)
    assert third.returncode == 0, stderr[-3000:]
    assert (
        f"note: took over the lock of --workdir={workdir} from pid {first.pid} on host "
        f"{socket.gethostname()} since "
    ) in stderr, stderr[-3000:]
    assert "which is no longer running" in stderr
    assert not path.exists()  # released at the end

    # Released on a refusal after the lock too: a resume with another model.
    fourth = _train(workdir, "--config.train.steps=4", "--config.model.hidden_dims=(128,)")
    _, stderr = fourth.communicate(timeout=300)
    assert fourth.returncode == 2 and "differs from the checkpoint" in stderr, stderr[-3000:]
    assert not path.exists()
