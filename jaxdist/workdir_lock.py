"""One training run per workdir: a lock file that names its holder (pid, host, since when).

Two trainers on one `--workdir` would interleave `metrics.jsonl`, collide mid-save and delete each
other's steps through `checkpoint.keep`. `acquire(workdir)` takes `WORKDIR/jaxdist.lock`:

- held by a live run: ConfigError, one line naming the holder;
- left by a run that died on this host (its pid is gone, or reused by another program): taken
  over, and the returned note says so;
- left by a process of an earlier attempt of this launch, on any (emulated) host: taken over
  (`scripts/launch.py` names the processes it started and saw end in `JAXDIST_ENDED_PIDS`: after
  `--elastic` leaves a host out, process 0 may run on another host than the lock's holder);
- several processes: process 0 holds it; every process learns the outcome from one all-gather,
  so they all refuse together.

The file holds JSON (`pid`, `host`, `since`, `start`: the holder's start time in clock ticks, so
a reused pid is not mistaken for the holder). While held, the holder also keeps an exclusive
`flock` on it, which the kernel drops when the process dies however it dies. `release` removes
the file; `loop.run` calls it on every way out, exceptions included.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.errors import ConfigError

LOCK_NAME = "jaxdist.lock"
ENV_ENDED_PIDS = "JAXDIST_ENDED_PIDS"  # set by scripts/launch.py: pids of its ended processes


def _ended_pids() -> set[int]:
    """Pids the launcher started in an earlier attempt of this job and saw end."""
    text = os.environ.get(ENV_ENDED_PIDS, "")
    return {int(p) for p in text.split(",") if p.strip().isdigit()}


def _start_ticks(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 22; the command name (field 2) may hold spaces, so count after its ")".
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    """Whether `pid` runs on this host and is the process that started at `start` ticks."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    now = _start_ticks(pid)
    return start is None or now is None or now == start


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
        f"since {holder.get('since', '?')}"
    )


class WorkdirLock:
    """A held lock on a workdir (or, on processes other than 0, a stand-in that holds nothing)."""

    def __init__(self, path: str, fd: int | None, note: str | None = None):
        self.path, self._fd = path, fd
        self.note = note  # a line for the console, e.g. that a dead run's lock was taken over

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Removes the lock file and drops the flock; safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    os.unlink(self.path)  # under the flock: nobody else has it now
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        holder = json.loads(raw.decode()) if raw.strip() else None
    except (UnicodeDecodeError, ValueError):
        return {}  # unreadable: take it over like a dead run's
    return holder if isinstance(holder, dict) else {}


def _open_locked(path: str) -> tuple[int | None, dict[str, Any] | None]:
    """(fd holding the flock on the file now at `path`, its old content), or (None, holder)."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
            holder = _read(fd)
            os.close(fd)
            return None, holder or {}
        try:  # the holder may have removed the file between our open and our flock
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, _read(fd)
        os.close(fd)
    raise ConfigError(f"could not lock {path}: it keeps being replaced; is another run starting?")


def _try_acquire(workdir: str) -> WorkdirLock:
    """Process-local: the lock, or ConfigError naming the holder."""
    path = os.path.join(workdir, LOCK_NAME)
    fd, holder = _open_locked(path)
    busy = (
        f"--workdir={workdir} is in use by another training run: {{}} (lock file {path}); "
        "wait for it to finish, stop it, or use another --workdir"
    )
    if fd is None:
        raise ConfigError(busy.format(_describe(holder or {})))
    host = socket.gethostname()
    note = None
    if holder:
        pid = holder.get("pid")
        same_host = holder.get("host") == host
        if isinstance(pid, int) and pid in _ended_pids() and pid != os.getpid():
            note = (
                f"took over the lock of --workdir={workdir} from {_describe(holder)}, a process "
                "of this job's earlier attempt (ended)"
            )
        elif same_host and isinstance(pid, int) and pid != os.getpid():
            if _alive(pid, holder.get("start")):  # alive, yet no flock: a file system without it
                os.close(fd)
                raise ConfigError(busy.format(_describe(holder)))
            note = (
                f"took over the lock of --workdir={workdir} from {_describe(holder)}, which is "
                "no longer running"
            )
        elif not same_host:
            os.close(fd)
            raise ConfigError(
                busy.format(_describe(holder)).replace(
                    "wait for it", f"if that run is gone, delete {path}; else wait for it"
                )
            )
    me = {
        "pid": os.getpid(),
        "host": host,
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "start": _start_ticks(os.getpid()),
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
    return WorkdirLock(path, fd, note)


def acquire(workdir: str) -> WorkdirLock:
    """Locks `workdir` (an existing folder) for this run; process 0 holds the lock.

    Every process calls it. Returns the lock (`release` it on every way out; `note` is a line to
    show when a dead run's lock was taken over). Raises ConfigError, on every process, when another
    run holds it.
    """
    error: ConfigError | None = None
    lock = WorkdirLock(os.path.join(workdir, LOCK_NAME), None)
    if jax.process_index() == 0:
        try:
            lock = _try_acquire(workdir)
        except ConfigError as err:
            error = err
    if jax.process_count() > 1:
        failed = multihost_utils.process_allgather(np.asarray(error is not None, np.int32))
        if np.any(failed) and error is None:
            lock.release()
            raise ConfigError(
                f"--workdir={workdir} is in use by another training run (process 0 says which)"
            )
    if error is not None:
        raise error
    return lock
