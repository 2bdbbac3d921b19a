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


# ------------------------------------------------------------------------------------------------
# Item 7: every token of every token file is below model.vocab_size, checked before compiling.


def _tokens(path: Path, n: int, bad_at: int | None = None, bad: int = 300) -> None:
    ids = (np.arange(n) % 200).astype(np.uint16)
    if bad_at is not None:
        ids[bad_at] = bad
    ids.tofile(path)


@pytest.mark.parametrize(
    "case, bad_file, offset",
    [
        ("past the first 2^20 train tokens", "train.bin", (1 << 20) + 12_345),
        ("in val.bin", "val.bin", 777),
    ],
)
def test_out_of_vocabulary_token_is_one_line_naming_file_offset_id(
    tmp_path, case, bad_file, offset
):
    folder = tmp_path / "tokens"
    folder.mkdir()
    sizes = {"train.bin": (1 << 20) + 50_000, "val.bin": 5_000}
    for name, n in sizes.items():
        _tokens(folder / name, n, offset if name == bad_file else None)
    work = tmp_path / "work"
    work.mkdir()
    proc = run(
        "train.py",
        f"--config={DEFAULT}",
        *TINY,
        f"--workdir={work / 'run'}",
        f"--config.data.source={folder}",
        cwd=work,
    )
    line = one_line(proc)
    assert line == (
        f"error: data.source='{folder}': {folder / bad_file} has token id 300 at token offset "
        f"{offset} (byte {2 * offset}); model.vocab_size=256 must exceed it"
    ), line
    assert listing(work) == []


def test_token_check_reads_every_chunk_and_remembers_each_file(tmp_path, monkeypatch):
    from jaxdist import data
    from jaxdist.errors import ConfigError

    monkeypatch.setattr(data, "_TOKEN_CHUNK", 1000)
    path = tmp_path / "t.bin"
    _tokens(path, 10_500, bad_at=10_321, bad=4000)
    with pytest.raises(
        ConfigError, match=r"has token id 4000 at token offset 10321 \(byte 20642\)"
    ):
        data._check_token_ids("x", str(path), np.dtype(np.uint16), 1024)
    assert data.token_max(str(path), np.dtype(np.uint16)) == 4000
    # Same path, size and mtime: the remembered maximum, without reading the file again.
    reads = []
    monkeypatch.setattr(data.np, "memmap", lambda *a, **k: reads.append(a) or np.zeros(0))
    assert data.token_max(str(path), np.dtype(np.uint16)) == 4000 and reads == []
    monkeypatch.undo()
    _tokens(path, 10_500)  # rewritten: a new mtime, scanned again
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert data.token_max(str(path), np.dtype(np.uint16)) == 199


# ------------------------------------------------------------------------------------------------
# Item 9: degenerate data.


def _degenerate(root: Path) -> None:
    np.array([5], np.uint16).tofile(root / "one.bin")
    np.savez(root / "strings.npz", images=np.array(["a", "b", "c"]), labels=np.arange(3))
    np.savez(root / "zero_d.npz", images=np.array(3.0), labels=np.array(1))
    np.savez(root / "str_labels.npz", images=np.zeros((4, 2, 2)), labels=np.array(list("wxyz")))
    np.savez(root / "few_labels.npz", images=np.zeros((4, 2, 2)), labels=np.arange(3))
    np.savez(root / "neg_labels.npz", images=np.zeros((4, 2, 2)), labels=np.array([0, 1, -1, 2]))
    np.savez(root / "one_image.npz", images=np.zeros((1, 2, 2)), labels=np.array([0]))
    (root / "not_zip.npz").write_bytes(b"PK\x03\x04 not really a zip")


DEGENERATE = {
    "one.bin": "the train split has 0 tokens, fewer than model.seq_len+1=65",
    "strings.npz": "'images' is <U1 of shape [3]; expected numbers of shape [N, H, W]",
    "zero_d.npz": "'images' is float64 of shape []; expected numbers of shape [N, H, W]",
    "str_labels.npz": "'labels' is <U1 of shape [4]; expected integers of shape [N]",
    "few_labels.npz": "4 images and 3 labels; expected as many of each",
    "neg_labels.npz": "labels range over -1..2; class ids are 0..N-1",
    "one_image.npz": "1 images and 1 labels; expected as many of each, at least 2",
    "not_zip.npz": "not a readable .npz",
}


@pytest.fixture(scope="module")
def degenerate(tmp_path_factory):
    root = tmp_path_factory.mktemp("degenerate")
    _degenerate(root)
    return root


@pytest.mark.parametrize("name", list(DEGENERATE))
def test_degenerate_data_is_one_line(degenerate, tmp_path, name):
    config = ROOT / "configs" / ("mlp.py" if name.endswith(".npz") else "default.py")
    proc = run(
        "train.py",
        f"--config={config}",
        "--config.train.steps=1",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.source={degenerate / name}",
        cwd=tmp_path,
    )
    line = one_line(proc)
    assert line.startswith(f"error: data.source='{degenerate / name}'"), line
    assert DEGENERATE[name] in line, line
    assert listing(tmp_path) == []
