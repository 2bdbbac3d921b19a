#!/usr/bin/env python
"""Start N local processes that form one JAX distributed job, and stop them all if one fails.

    python scripts/launch.py --num_processes=2 --devices_per_process=4 -- \
        python scripts/train.py --config=configs/default.py --workdir=runs/mp

Each process gets `JAXDIST_COORDINATOR=127.0.0.1:<free port>`, `JAXDIST_NUM_PROCESSES`,
`JAXDIST_PROCESS_ID` (read by `jaxdist.distributed.detect`) and either
- on CPU: `JAX_PLATFORMS=cpu` and `JAXDIST_CPU_DEVICES=K` (each process simulates K devices), or
- on GPU (`--platform=gpu`, or `auto` when `nvidia-smi -L` lists GPUs): `CUDA_VISIBLE_DEVICES` with
  its own K GPUs, taken in order from the GPUs visible to the launcher.

Every output line is prefixed with the rank ("[1] ..."). A leading `python`/`python3` in the
command means this launcher's own interpreter. SIGINT/SIGTERM are forwarded to every process.
When a process exits non-zero or dies by a signal, the others get SIGTERM, then SIGKILL after
`--grace_s`, and the launcher prints one line naming the process, how it ended and its last output
line, then exits with that process's code (128 + signal number for a signal). Exit 0 only when
every process exits 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

POLL_S = 0.05
PIPE_DRAIN_S = 2.0  # bound on waiting for a dead process's pipes (grandchildren may hold them)
NAME = "launch.py"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Start N local processes forming one JAX distributed job.",
        usage="%(prog)s --num_processes=N --devices_per_process=K [options] -- CMD [ARGS...]",
    )
    parser.add_argument("--num_processes", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--devices_per_process", type=int, default=1, help="CPU devices simulated, or GPUs, each"
    )
    parser.add_argument("--coordinator_port", type=int, default=0, help="0 = pick a free port")
    parser.add_argument(
        "--timeout_s", type=float, default=None, help="seconds to wait for all to join"
    )
    parser.add_argument(
        "--grace_s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL"
    )
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    args = parser.parse_args(own)
    if not command:
        parser.error("no command: put it after '--', e.g. -- python scripts/train.py")
    if args.num_processes < 1:
        parser.error(f"--num_processes={args.num_processes}: must be at least 1")
    if args.devices_per_process < 1:
        parser.error(f"--devices_per_process={args.devices_per_process}: must be at least 1")
    if not 0 <= args.coordinator_port < 65536:
        parser.error(f"--coordinator_port={args.coordinator_port}: must be 0..65535")
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    return args, command


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[str]:
    """GPU ids the launcher may hand out: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def _child_envs(args: argparse.Namespace, port: int) -> tuple[list[dict[str, str]], str]:
    n, k = args.num_processes, args.devices_per_process
    gpus = _visible_gpus() if args.platform in ("auto", "gpu") else []
    if args.platform == "gpu" and len(gpus) < n * k:
        raise SystemExit(
            f"{NAME}: --platform=gpu needs {n} x {k} = {n * k} GPUs but {len(gpus)} are visible"
        )
    use_gpu = args.platform == "gpu" or (args.platform == "auto" and len(gpus) >= n * k)
    envs = []
    for rank in range(n):
        env = dict(os.environ)
        env.update(
            JAXDIST_COORDINATOR=f"127.0.0.1:{port}",
            JAXDIST_NUM_PROCESSES=str(n),
            JAXDIST_PROCESS_ID=str(rank),
            PYTHONUNBUFFERED="1",  # lines reach the launcher as they are printed
        )
        if args.timeout_s is not None:
            env["JAXDIST_INIT_TIMEOUT_S"] = f"{args.timeout_s:g}"
        if use_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * k : (rank + 1) * k])
            env.pop("JAXDIST_CPU_DEVICES", None)
        else:
            env["JAX_PLATFORMS"] = "cpu"
            env["JAXDIST_CPU_DEVICES"] = str(k)
        envs.append(env)
    what = f"{k} GPU(s)" if use_gpu else f"{k} CPU device(s)"
    return envs, what


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL if the launcher itself is killed without a chance to clean up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # best effort: other platforms lack prctl
        pass


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")


def _is_noise(line: str) -> bool:
    """Stack-trace frames of a C++ abort say nothing about why; skip them for the summary."""
    s = line.strip()
    return not s or s.startswith("@ 0x") or s.startswith("*** ") or s.startswith("@     0x")


class Launcher:
    def __init__(self, command: list[str], envs: list[dict[str, str]], grace_s: float):
        self.command = command
        self.envs = envs
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen] = []
        self.pumps: dict[int, list[threading.Thread]] = {}
        self.tail: dict[int, collections.deque[str]] = {}
        self.out_lock = threading.Lock()
        self.signalled: int | None = None
        self.kill_deadline: float | None = None
        self.killed = False

    # -- output ---------------------------------------------------------------------------------
    def _pump(self, rank: int, pipe, sink) -> None:
        prefix = f"[{rank}] ".encode()
        sink_bytes = sink.buffer if hasattr(sink, "buffer") else None
        for raw in iter(pipe.readline, b""):
            line = raw if raw.endswith(b"\n") else raw + b"\n"
            text = line.decode("utf-8", errors="replace").rstrip("\n")
            with self.out_lock:
                if not _is_noise(text):
                    self.tail[rank].append(text)
                try:
                    if sink_bytes is not None:
                        sink_bytes.write(prefix + line)
                    else:
                        sink.write(f"[{rank}] {text}\n")
                    sink.flush()
                except (OSError, ValueError):
                    pass  # our own output is gone (closed pipe): keep draining the child's
        pipe.close()

    # -- processes ------------------------------------------------------------------------------
    def _start(self) -> None:
        for rank, env in enumerate(self.envs):
            try:
                proc = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # own process group: we signal it whole, the tty does not
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )
            except OSError as e:
                self._signal_all(signal.SIGKILL)
                raise SystemExit(
                    f"{NAME}: cannot start {self.command[0]!r}: {e.strerror}"
                ) from None
            self.procs.append(proc)
            self.tail[rank] = collections.deque(maxlen=20)
        for rank, proc in enumerate(self.procs):
            self.pumps[rank] = [
                threading.Thread(
                    target=self._pump, args=(rank, proc.stdout, sys.stdout), daemon=True
                ),
                threading.Thread(
                    target=self._pump, args=(rank, proc.stderr, sys.stderr), daemon=True
                ),
            ]
            for t in self.pumps[rank]:
                t.start()

    def _signal_all(self, sig: int) -> None:
        """Signals each process's whole group, so children it left behind go too."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_all(self) -> None:
        """SIGTERM now, SIGKILL at the deadline (checked by the main loop)."""
        if self.kill_deadline is None:
            self.kill_deadline = time.monotonic() + self.grace_s
            self._signal_all(signal.SIGTERM)

    def _on_signal(self, signum, frame) -> None:
        if self.signalled is not None:  # second Ctrl-C: no more patience
            self._signal_all(signal.SIGKILL)
            return
        self.signalled = signum
        self.kill_deadline = time.monotonic() + self.grace_s
        self._signal_all(signum)

    def _last_line(self, rank: int) -> str:
        """The process's last exception line among its last 20 lines, else its last line."""
        for t in self.pumps.get(rank, []):
            t.join(PIPE_DRAIN_S)
        with self.out_lock:
            lines = list(self.tail[rank])
        # A Python exception line says why; C++ teardown logs printed after it usually do not.
        for line in reversed(lines):
            if _EXCEPTION_LINE.match(line):
                return line
        return lines[-1] if lines else ""

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self._start()
        failed: tuple[int, int] | None = None  # (rank, returncode) of the first failure
        while True:
            codes = [p.poll() for p in self.procs]
            if failed is None and self.signalled is None:
                for rank, code in enumerate(codes):
                    if code not in (None, 0):
                        failed = (rank, code)
                        self._stop_all()
                        break
            if all(c is not None for c in codes):
                break
            if not self.killed and self.kill_deadline and time.monotonic() > self.kill_deadline:
                self._signal_all(signal.SIGKILL)
                self.killed = True
            time.sleep(POLL_S)

        for rank in self.pumps:
            for t in self.pumps[rank]:
                t.join(PIPE_DRAIN_S)
        sys.stdout.flush()
        if failed is not None:
            rank, code = failed
            last = self._last_line(rank)
            others = sum(1 for r, p in enumerate(self.procs) if r != rank and p.returncode != 0)
            msg = f"{NAME}: process {rank} {_describe(code)}"
            msg += f"; last line: {last!r}" if last else "; it printed nothing"
            if others:
                msg += f"; stopped {others} other process(es)"
            print(msg, file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        if self.signalled is not None:
            name = signal.Signals(self.signalled).name
            print(f"{NAME}: got {name}, stopped all processes", file=sys.stderr, flush=True)
            return 128 + self.signalled
        return 0


def main(argv: list[str] | None = None) -> int:
    args, command = _parse(sys.argv[1:] if argv is None else argv)
    port = args.coordinator_port or _free_port()
    envs, what = _child_envs(args, port)
    print(
        f"{NAME}: {args.num_processes} process(es) x {what}, coordinator 127.0.0.1:{port}",
        file=sys.stderr,
        flush=True,
    )
    return Launcher(command, envs, args.grace_s).run()


if __name__ == "__main__":
    sys.exit(main())
