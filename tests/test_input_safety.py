"""Hostile input refused in one line (issue 31, items 4, 5, 7, 8, 9).

Each case runs the real script in a subprocess and checks: exit code 2, exactly one line on stderr
(`error: ...`, naming the file or field), no traceback, nothing written. Tables of inputs hold one
class each: gin files, config files, degenerate data, Hugging Face folders, the coordinator port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
DEFAULT = ROOT / "configs" / "default.py"
# Each refused run stops before compiling; a run that compiled would print the step summary.
TINY = (
    "--config.train.steps=1",
    "--config.model.d_model=32",
    "--config.model.seq_len=16",
    "--config.train.batch_size=8",
    "--config.data.max_bytes=200000",
    "--config.train.eval_batches=1",
)
_CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "JAXDIST_", "JOB_COMPLETION_INDEX", "JOBSET_")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_PREFIXES)}
    env.pop("REPLICATED_JOB_NAME", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def run(script: str, *args: str, cwd: Path, timeout: float = 120, **env: str):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *map(str, args)],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(proc: subprocess.CompletedProcess, prefix: str = "error: ") -> str:
    """The single stderr line of a refused run: exit code 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-3000:]
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------------------------------------
# Item 8: a busy coordinator port.


@pytest.fixture
def held_port():
    """A port held by a listening socket, as a stale job or another service would hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_coordinator_port_is_one_line_not_a_segfault(held_port, tmp_path):
    """Process 0 of a 2-process job whose coordinator port is taken: JAX would segfault (139)."""
    from jaxdist import distributed

    assert distributed.port_in_use(held_port)
    started = time.monotonic()
    proc = run(
        "train.py",
        f"--config={DEFAULT}",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
        JAXDIST_COORDINATOR=f"127.0.0.1:{held_port}",
        JAXDIST_NUM_PROCESSES="2",
        JAXDIST_PROCESS_ID="0",
    )
    line = one_line(proc)
    assert line == (
        f"error: coordinator port {held_port} (127.0.0.1:{held_port}, from env) is already in use "
        "on this host, where process 0 serves the job's coordinator: stop what holds it, or pick "
        "another port (JAXDIST_COORDINATOR_PORT=N, JAXDIST_COORDINATOR=host:N, or "
        "scripts/launch.py --coordinator_port=0 for a free one)"
    ), line
    assert time.monotonic() - started < 60  # refused at once, not after the join timeout
    assert listing(tmp_path) == []


def test_launcher_refuses_a_busy_coordinator_port(held_port, tmp_path):
    proc = run(
        "launch.py",
        "--num_processes=2",
        f"--coordinator_port={held_port}",
        "--",
        "python",
        SCRIPTS / "train.py",
        f"--workdir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    line = one_line(proc, prefix="launch.py: ")
    assert line == (
        f"launch.py: --coordinator_port={held_port} is already in use on this host; pick "
        "another, or 0 (the default) for a free one"
    ), line
    assert listing(tmp_path) == []


def test_a_free_port_is_not_reported_busy():
    from jaxdist import distributed

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not distributed.port_in_use(port)
