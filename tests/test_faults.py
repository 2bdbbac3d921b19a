"""Faults: preemption, a killed worker, a stopped (hung) worker, a full disk.

One workdir goes through them in order, with `scripts/launch.py --num_processes=2
--devices_per_process=4` and the real `train.py` (test_multihost's small GPT, one step ~0.3 s):

1. SIGTERM to worker 1 only (one host's preemption notice): JAX's preemption service tells
   worker 0, both save one checkpoint at the same step and exit 143; nothing else is saved.
2. The same command again with `--max_restarts=2 --hang_s=15`, resuming from that checkpoint:
   SIGKILL of worker 1 → the launcher restarts the job, which resumes from the last checkpoint;
   then SIGSTOP of worker 1 → the watchdog names process 1 (not the healthy 0) and restarts
   again; the third attempt reaches the final step and exits 0.

Then an elastic restart of the real train.py on the process that remains (8 → 4 devices), the
launcher's restart logic with a stand-in worker, and a one-process run whose disk
fills up (a small tmpfs in a user namespace). Every wait has a deadline; the launcher runs in its own session and is killed with its children
if a test gives up.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.test_multihost import ROOT, _env, _pids_with, records, train_cmd

pytestmark = pytest.mark.slow

STEP_DEADLINE_S = 240  # from start to a logged step, on a loaded 2-core machine
EXIT_DEADLINE_S = 90  # from a fault to the launcher's exit or restart


class Job:
    """A launcher running in the background, its output in files."""

    def __init__(self, cmd: list[str], out_dir: pathlib.Path, name: str):
        self.out_path, self.err_path = out_dir / f"{name}.out", out_dir / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=_env(None, None), stdout=out, stderr=err
            )

    def text(self) -> str:
        return self.out_path.read_text() + "\n--- stderr ---\n" + self.err_path.read_text()

    def wait_until(self, what: str, ok, deadline_s: float = STEP_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while not ok():
            assert self.proc.poll() is None, f"exited before {what}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, (
                f"no {what} in {deadline_s} s:\n{self.text()[-4000:]}"
            )
            time.sleep(0.2)

    def wait(self, deadline_s: float) -> int:
        try:
            return self.proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"launcher still running after {deadline_s} s:\n{self.text()[-4000:]}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # the workers follow (PR_SET_PDEATHSIG)
            self.proc.wait()


def last_step(workdir: pathlib.Path) -> int:
    try:
        return max((r["step"] for r in records(workdir) if "loss" in r), default=0)
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half-written
        return 0


def worker(workdir: pathlib.Path, rank: int) -> int:
    pids = _pids_with(str(workdir), f"JAXDIST_PROCESS_ID={rank}")
    assert len(pids) == 1, pids
    return pids[0]


def committed(workdir: pathlib.Path) -> list[int]:
    from jaxdist import checkpoint

    return checkpoint.committed_steps(workdir / "checkpoints")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    workdir = root / f"w-{os.getpid()}-{time.monotonic_ns()}"  # unique in /proc
    res: dict = {"workdir": workdir}

    # 1. Preemption: SIGTERM to worker 1 only; no periodic checkpoints, so any is the preemption's.
    first = Job(
        train_cmd(workdir, "--config.train.steps=1000", "--config.checkpoint.every=0", processes=2),
        root,
        "preempt",
    )
    try:
        first.wait_until("step 3", lambda: last_step(workdir) >= 3)
        os.kill(worker(workdir, 1), signal.SIGTERM)
        res["preempt_rc"] = first.wait(EXIT_DEADLINE_S)
    finally:
        first.kill()
    res["preempt_out"] = first.text()
    res["preempt_steps"] = committed(workdir)
    res["preempt_logged"] = last_step(workdir)
    stopped = res["preempt_steps"][-1] if res["preempt_steps"] else 0
    state = workdir / "checkpoints" / str(stopped) / "state"
    res["preempt_writers"] = sorted(p.name for p in state.glob("ocdbt.process_*"))

    # 2. Restarts: SIGKILL worker 1, then SIGSTOP worker 1 of the restarted job.
    final = stopped + 24
    cmd = train_cmd(
        workdir, f"--config.train.steps={final}", "--config.checkpoint.every=2", processes=2
    )
    cut = cmd.index("--")
    cmd = [*cmd[:cut], "--max_restarts=2", "--hang_s=15", *cmd[cut:]]
    second = Job(cmd, root, "restarts")
    try:
        second.wait_until("a step after the resume", lambda: last_step(workdir) >= stopped + 3)
        os.kill(worker(workdir, 1), signal.SIGKILL)
        second.wait_until(
            "the first restart",
            lambda: "restart 1 of 2" in second.err_path.read_text(),
            EXIT_DEADLINE_S,
        )
        res["killed_at"] = last_step(workdir)
        res["ckpt_at_restart"] = max(committed(workdir))
        second.wait_until("a step after the restart", lambda: last_step(workdir) > res["killed_at"])
        os.kill(worker(workdir, 1), signal.SIGSTOP)
        res["stopped_at"] = time.monotonic()
        second.wait_until(
            "the second restart",
            lambda: "restart 2 of 2" in second.err_path.read_text(),
            EXIT_DEADLINE_S,
        )
        res["hang_found_after_s"] = time.monotonic() - res["stopped_at"]
        res["restarts_rc"] = second.wait(STEP_DEADLINE_S)
    finally:
        second.kill()
    res["restarts_out"] = second.text()
    res["final"] = final
    res["restarts_steps"] = committed(workdir)
    res["restarts_logged"] = last_step(workdir)
    return res


def test_preempted_two_process_job_saves_at_one_step_and_exits_143(faults):
    out = faults["preempt_out"]
    assert faults["preempt_rc"] == 143, out[-4000:]
    found = re.findall(
        r"\[0\] preempted at step (\d+): checkpoint saved in (\S+); exit status 143", out
    )
    assert len(found) == 1, out[-4000:]
    step = int(found[0][0])
    # The only checkpoint is the preemption's, at the step both processes stopped at, written
    # by both (each its own shards), and it is the last step trained.
    assert faults["preempt_steps"] == [step], faults["preempt_steps"]
    assert faults["preempt_logged"] == step
    assert faults["preempt_writers"] == ["ocdbt.process_0", "ocdbt.process_1"]
    # Whichever process exits first is named; both exit 143 after the same save.
    assert re.search(r"launch\.py: process [01] exited with code 143 \(preempted", out), out[-2000:]
    assert "Traceback" not in out
    # The console: no Gloo banners, no absl INFO lines.
    assert "[Gloo]" not in out and not re.search(r"^\[\d\] I\d{4} ", out, re.M), out[:4000]


def test_killed_then_hung_worker_restarts_and_the_job_completes(faults):
    out = faults["restarts_out"]
    assert faults["restarts_rc"] == 0, out[-4000:]
    # The hang was found by the watchdog (15 s, as tests/test_network_fault.py waits for a real
    # train.py), well before JAX's heartbeat (100 s), and blamed
    # on the stopped process 1, not on process 0 that waited for it.
    assert faults["hang_found_after_s"] < 60, faults["hang_found_after_s"]
    assert re.search(
        r"launch\.py: process 1 made no progress for 15 s \(--hang_s\): it is stopped \(state T\)",
        out,
    ), out[-4000:]
    assert "launch.py: process 0 made no progress" not in out
    assert "launch.py: process 1 was killed by SIGKILL" in out, out[-4000:]
    assert out.count("resumed from") == 3, out[-4000:]  # the command, then each restart
    assert faults["restarts_logged"] == faults["final"]
    assert faults["restarts_steps"][-1] == faults["final"]
    assert f"[0] done: step {faults['final']}," in out


# ---------------------------------------------------------------------------------------------
# The restart logic alone, with a stand-in worker (no JAX): quick.

STAND_IN = """
import os, pathlib, sys
rank, n = int(os.environ["JAXDIST_PROCESS_ID"]), int(os.environ["JAXDIST_NUM_PROCESSES"])
marker = pathlib.Path(sys.argv[1])
if rank == 1 and not marker.exists():
    marker.write_text("failed once")
    print("rank 1 failing", file=sys.stderr)
    sys.exit(7)
print(f"ok rank={rank} of {n}")
"""


@pytest.mark.parametrize(
    "flags, rc, restarted_on, finished",
    [
        ((), 7, None, []),
        (("--max_restarts=1",), 0, "on 2 process(es) (restart 1 of 1)", ["0 of 2", "1 of 2"]),
        (
            ("--max_restarts=1", "--elastic"),
            0,
            "on 1 process(es) (those that remain) (restart 1 of 1)",
            ["0 of 1"],
        ),
    ],
    ids=["no restarts", "restart", "elastic"],
)
def test_launcher_restarts_after_a_failure(tmp_path, flags, rc, restarted_on, finished):
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN)
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "launch.py"),
        "--num_processes=2",
        "--platform=cpu",
        "--grace_s=2",
        *flags,
        "--",
        "python",
        str(script),
        str(tmp_path / "marker"),
    ]
    out = subprocess.run(cmd, env=_env(None, None), capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, out.stdout + out.stderr
    assert "launch.py: process 1 exited with code 7; last line: 'rank 1 failing'" in out.stderr
    if restarted_on is None:
        assert "restarting" not in out.stderr
    else:
        assert f"restarting the job from its last checkpoint {restarted_on}" in out.stderr
    got = sorted(
        line.split("ok rank=")[1] for line in out.stdout.splitlines() if "ok rank=" in line
    )
    # The first attempt's rank 0 may have finished before rank 1 failed; the restart's must.
    assert set(finished) <= set(got), out.stdout


# ---------------------------------------------------------------------------------------------
# Disk full: a 1000 KiB tmpfs (in a user and mount namespace, no root needed) holds two of these
# checkpoints (~360 KiB each); the third save fails.

DISK_FULL = """
set -u
mkdir -p "$1" && mount -t tmpfs -o size=1000k tmpfs "$1" || exit 97
shift
"$@" > "$OUT/train.out" 2> "$OUT/train.err"
echo $? > "$OUT/rc"
ls "$MNT/w/checkpoints" > "$OUT/listing"
"$PY" scripts/ckpt.py verify "$MNT/w/checkpoints" > "$OUT/verify.out" 2>&1
"""


def test_disk_full_stops_with_one_line_and_keeps_the_earlier_checkpoints(tmp_path):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm) to mount a small tmpfs")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    out.mkdir()
    (tmp_path / "disk_full.sh").write_text(DISK_FULL)
    train = [
        sys.executable,
        "scripts/train.py",
        f"--workdir={mnt}/w",
        "--config.runtime.cpu_devices=1",
        "--config.mesh.data=1",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
        "--config.model.num_layers=1",
        "--config.model.d_model=32",
        "--config.model.seq_len=16",
        "--config.train.batch_size=8",
        "--config.train.eval_batches=1",
        "--config.train.steps=12",
        "--config.train.log_every=4",
        "--config.checkpoint.every=2",
        "--config.checkpoint.keep=100",
    ]
    env = {**_env(None, None), "OUT": str(out), "MNT": str(mnt), "PY": sys.executable}
    proc = subprocess.run(
        ["unshare", "-rm", "bash", str(tmp_path / "disk_full.sh"), str(mnt), *train],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {proc.stderr.strip()}")
    err = (out / "train.err").read_text()
    assert int((out / "rc").read_text()) == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    m = re.fullmatch(
        r"error: checkpoint step (\d+) could not be written to \S+/w/checkpoints: no space left "
        r"on device; the committed checkpoints are untouched \(steps 2, 4\); free space .*",
        lines[0],
    )
    assert m and int(m.group(1)) == 6, lines[0]
    # The earlier checkpoints are whole: the newest committed one verifies.
    assert {"2", "4"} <= set((out / "listing").read_text().split())
    assert (out / "verify.out").read_text().startswith("ok: step 4"), (
        out / "verify.out"
    ).read_text()


def test_elastic_restart_continues_on_the_remaining_process(tmp_path):
    """`--elastic` with the real train.py: worker 1 is killed; the job restarts on process 0 alone
    (4 devices instead of 8), `mesh.data=-1` absorbs the change, and the resharded restore
    continues from the last checkpoint to the final step."""
    workdir = tmp_path / f"elastic-{os.getpid()}-{time.monotonic_ns()}"  # unique in /proc
    mesh = ("--config.mesh.data=-1", "--config.mesh.fsdp=2", "--config.mesh.tensor=1")
    cmd = train_cmd(
        workdir, "--config.train.steps=30", "--config.checkpoint.every=2", *mesh, processes=2
    )
    cut = cmd.index("--")
    cmd = [*cmd[:cut], "--max_restarts=1", "--elastic", *cmd[cut:]]
    job = Job(cmd, tmp_path, "elastic")
    try:
        job.wait_until(
            "step 4 and a checkpoint", lambda: last_step(workdir) >= 4 and committed(workdir)
        )
        os.kill(worker(workdir, 1), signal.SIGKILL)
        job.wait_until(
            "the restart", lambda: "restart 1 of 1" in job.err_path.read_text(), EXIT_DEADLINE_S
        )
        saved_at_restart = max(committed(workdir))
        rc = job.wait(STEP_DEADLINE_S)
    finally:
        job.kill()
    out = job.text()
    assert rc == 0, out[-4000:]
    assert "on 1 process(es) (those that remain) (restart 1 of 1)" in out, out[-4000:]
    layouts = [r for r in records(workdir) if r.get("kind") == "layout"]
    assert [r["devices"] for r in layouts] == [8, 4], layouts
    assert [r["mesh"]["data"] for r in layouts] == [4, 2]
    assert f"resumed from {workdir / 'checkpoints'} at step " in out
    resumed = int(re.search(r"resumed from \S+ at step (\d+)", out).group(1))
    assert resumed >= saved_at_restart - 2  # the newest checkpoint (one may commit after the kill)
    assert "[0] done: step 30," in out, out[-4000:]
    assert committed(workdir)[-1] == 30
