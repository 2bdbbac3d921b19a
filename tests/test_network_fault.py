"""A host's link goes down mid-run on the emulated cluster (`launch.py --network_fault`).

Issue 30 item 6 (a), through `scripts/network_fault.py` with 3 emulated hosts (the fewest that
leave a multi-host job, over the network, to restart on; each host costs one JAX process's start
and compile on a 2-core machine, so not 4 here: docs/MULTIHOST.md has the 4-host row). Skips in
one line where namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from jaxdist import checkpoint
from jaxdist.network import namespaces
from tests.test_multihost import ROOT, records
from tests.test_netem import _env_no_cache, clean, needs_namespaces  # noqa: F401 (fixture)

HANG_S = 15

# A stand-in for train.py (no JAX): reports steps to the launcher's watchdog, then blocks as a
# process waiting in a collective would. One process, `BEHIND`, reports a step less than the
# others, so "the one furthest behind" would name it: only the link check names the right one.
STAND_IN = """
import os, socket, sys, time
rank, n = int(os.environ["JAXDIST_PROCESS_ID"]), int(os.environ["JAXDIST_NUM_PROCESSES"])
print(f"rank={rank} of {n} on {socket.gethostname()} via {os.environ['JAXDIST_COORDINATOR']}")
if n < 3:
    sys.exit(0)
for step in range(1, (2 if rank == int(sys.argv[1]) else 3) + 1):
    with open(os.environ["JAXDIST_PROGRESS_FILE"], "w") as f:
        f.write(f"{step}\\n")
    time.sleep(0.3)
time.sleep(120)
"""


@needs_namespaces
@pytest.mark.parametrize("down", [1, 0], ids=["host1", "coordinator host0"])
def test_watchdog_names_the_host_whose_link_is_down_and_elastic_leaves_it_out(
    tmp_path,
    clean,  # noqa: F811
    down,
):
    """3 hosts; host `down`'s link goes down once step 3 is reported; every process then blocks.
    The watchdog names that host's process (not the one furthest behind), and the elastic
    restart runs on the two other hosts, its coordinator on the first of them."""
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN)
    behind = (down + 1) % 3
    cmd = [sys.executable, "scripts/launch.py", "--network=rate=100mbit", "--num_processes=3"]
    cmd += ["--platform=cpu", "--grace_s=1", "--hang_s=2", "--max_restarts=1", "--elastic"]
    cmd += [f"--network_fault={down}:3", "--", "python", str(script), str(behind)]
    done = subprocess.run(
        cmd, cwd=ROOT, env=_env_no_cache(), capture_output=True, text=True, timeout=120
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"--network_fault: host{down}'s link is down" in done.stderr, out[-3000:]
    assert (
        f"launch.py: process {down} made no progress for 2 s (--hang_s): it is cut off "
        f"(host{down}'s link is down: its switch port has no carrier) at step 3" in done.stderr
    ), out[-3000:]
    assert f"launch.py: leaving out host{down}" in done.stderr
    assert "on 2 process(es) (those that remain) (restart 1 of 1)" in done.stderr
    remain = [h for h in range(3) if h != down]
    coordinator = f"198.18.0.{remain[0] + 1}:8477"  # the second attempt's port
    for rank, host in enumerate(remain):
        assert f"rank={rank} of 2 on host{host} via {coordinator}" in done.stdout, done.stdout


def assert_no_cluster_left(grace_s: float = 30.0) -> None:
    """Every cluster whose launcher has ended is gone within `grace_s` (the time a reaper takes
    after a SIGKILL). Only ended launchers' count: a cluster another test runs beside this one
    (the other xdist worker's, e.g. tests/test_netem.py's) is no leak of this test's."""
    deadline = time.monotonic() + grace_s
    while namespaces.stale() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert namespaces.stale() == []


@pytest.mark.slow
@pytest.mark.bitwise  # two programs' parameters to the bit
@needs_namespaces
def test_link_down_is_named_and_the_elastic_restart_equals_a_resumed_run(tmp_path, clean):  # noqa: F811
    """The link of host 0 (the coordinator's, and process 0's, which writes the metrics and holds
    the workdir lock) goes down after step 5 is reported: the watchdog names process 0 (its host's
    switch port lost its carrier) within `--hang_s`, the job restarts on hosts 1 and 2 (the
    coordinator on host 1; the lock taken over) from its newest checkpoint and finishes; its losses
    after the resume and its final parameters equal, to the bit, those of a 2-host run started
    from a copy of that checkpoint."""
    work, out = tmp_path / "nf", tmp_path / "row.json"
    cmd = [sys.executable, "scripts/network_fault.py", "--hosts=3", "--steps=8", "--every=2"]
    cmd += [
        "--fault_host=0",
        "--fault_step=5",
        f"--hang_s={HANG_S}",
        f"--workdir={work}",
        f"--out={out}",
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, env=_env_no_cache(), capture_output=True, text=True, timeout=900
    )
    log = (work / "elastic.log").read_text()
    row = json.loads(out.read_text())
    assert row["elastic_rc"] == 0, log[-4000:]
    assert row["reference_rc"] == 0, (work / "reference.log").read_text()[-4000:]
    assert (
        f"launch.py: process 0 made no progress for {HANG_S} s (--hang_s): it is cut off "
        "(host0's link is down: its switch port has no carrier) at step" in log
    ), log[-4000:]
    assert row["detect_s"] <= HANG_S + 5, row
    assert "launch.py: leaving out host0" in log
    assert "on 2 process(es) (those that remain) (restart 1 of 1)" in log, log[-4000:]
    assert "coordinator 198.18.0.2:8477" in log
    assert "a process of this job's earlier attempt (ended)" in log  # the lock, from host 0
    assert_no_cluster_left()

    elastic, reference = work / "elastic", work / "reference"
    layouts = [r for r in records(elastic) if r.get("kind") == "layout"]
    assert [(r["devices"], r["processes"]) for r in layouts] == [(3, 3), (2, 2)], layouts
    resumed = int(re.search(r"\] resumed from \S+ at step (\d+)", log).group(1))
    assert 2 <= resumed <= 5 and resumed % 2 == 0, resumed
    assert sorted(checkpoint.committed_steps(reference / "checkpoints"))[0] == resumed

    def after_resume(workdir):
        recs = records(workdir)
        last = max(i for i, r in enumerate(recs) if r.get("kind") == "layout")
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs[last:] if "loss" in r}

    got, want = after_resume(elastic), after_resume(reference)
    assert sorted(got) == list(range(resumed + 1, 9)), sorted(got)
    assert got == want
    params = {
        name: checkpoint.read_arrays(str(w / "checkpoints"), step=8, prefix="params")
        for name, w in (("elastic", elastic), ("reference", reference))
    }
    assert params["elastic"] and sorted(params["elastic"]) == sorted(params["reference"])
    for k, v in params["elastic"].items():
        assert v.tobytes() == params["reference"][k].tobytes(), k
    assert row["equal_params"] and row["equal_losses"], row
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--network=rate=1gbit", "--network_fault=2:5"], "must be HOST:STEP with HOST in 0..1"),
        (["--network=rate=1gbit", "--network_fault=1:0"], "STEP at least 1"),
        (["--network_fault=1:5"], "--network_fault need --network"),
    ],
)
def test_bad_network_fault_is_refused_before_anything_starts(flags, says):
    cmd = [sys.executable, "scripts/launch.py", "--num_processes=2", *flags, "--", "true"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env_no_cache(), capture_output=True, text=True)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "emulated host(s)" not in done.stderr  # refused before a cluster was built
