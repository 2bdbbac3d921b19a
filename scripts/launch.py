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
command means this launcher's own interpreter. SIGINT/SIGTERM are forwarded to every process,
which get `--grace_s` to save a checkpoint before SIGKILL. When a process exits non-zero or dies
by a signal, the others get SIGTERM, then SIGKILL (after at most FAILURE_GRACE_S), and the launcher
prints one line naming the process, how it ended and its last output line, then exits with that
process's code (128 + signal number for a signal). Exit 0 only when every process exits 0.

Faults it handles:
- `--hang_s=S`: each process reports its step to a file (`JAXDIST_PROGRESS_FILE`, written by the
  training loop); when one has reported nothing for S seconds the job is stopped, naming the
  process that stalled (one stopped by a signal, else the one furthest behind), exit HANG_EXIT_CODE.
- `--max_restarts=K`: after a failure (or a hang) the whole job is started again, up to K times;
  `train.py` resumes from the last checkpoint. `--elastic`: the restart runs on the processes that
  remain (the failed ones are left out), so a config with `mesh.data=-1` continues on fewer devices.

The emulated cluster (`--network=PROFILE`, needs root): the processes run on N / P emulated hosts
(`--processes_per_host=P`), each host a network namespace with its own hostname and address on a
switch, its link shaped both ways (`jaxdist.network`); the coordinator is on host 0. `--link=H:...`
changes host H's link. `--network_fault=H:STEP` takes host H's link down once a process has
reported step STEP (a fault to test `--hang_s` and `--elastic` against). Everything it creates is removed when the launcher ends, however it ends
(docs/MULTIHOST.md).
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
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxdist import job_goodput  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.network import counters, namespaces, profiles  # noqa: E402

POLL_S = 0.05
FAILURE_GRACE_S = 5.0  # after a failure the others cannot save (their peer is gone): no long wait
HANG_EXIT_CODE = 124  # as `timeout` reports a command it stopped
PREEMPTED_EXIT_CODE = 143  # jaxdist.loop.PREEMPTED_EXIT_CODE: stopped after a preemption save
ENV_PROGRESS_FILE = "JAXDIST_PROGRESS_FILE"
ENV_ENDED_PIDS = "JAXDIST_ENDED_PIDS"  # jaxdist.workdir_lock: an ended attempt's lock is taken over
PIPE_DRAIN_S = 2.0  # bound on waiting for a dead process's pipes (grandchildren may hold them)
NAME = "launch.py"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    parser = _parser()
    args = parser.parse_args(own)
    if not command:
        parser.error("no command: put it after '--', e.g. -- python scripts/train.py")
    _check(parser, args)
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    return args, command


def _parser() -> argparse.ArgumentParser:
    """launch.py's own flags (those before `--`)."""
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
        "--grace_s",
        type=float,
        default=30.0,
        help="seconds between a forwarded SIGTERM/SIGINT and SIGKILL: time for a preemption save",
    )
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart the whole job after a failure up to this many times (it resumes)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="restart on the processes that remain rather than on all --num_processes",
    )
    parser.add_argument(
        "--hang_s",
        type=float,
        default=0.0,
        help="stop the job when a process reports no step for this many seconds (0 = off)",
    )
    parser.add_argument(
        "--network",
        default="",
        help="run on emulated hosts with shaped links: a profile (list: --network=list) or "
        f"inline {profiles.INLINE_HELP.replace('%', '%%')}; needs root",
    )
    parser.add_argument(
        "--processes_per_host",
        type=int,
        default=1,
        help="with --network: processes on each emulated host (loopback between them)",
    )
    parser.add_argument(
        "--link",
        action="append",
        default=[],
        help="with --network: HOST:field=value,... changes one host's link, e.g. 1:rate=10mbit",
    )
    parser.add_argument(
        "--network_fault",
        default="",
        help="with --network: HOST:STEP takes host HOST's link down (ip link set eth0 down) once "
        "a process has reported step STEP, e.g. 2:6",
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (parser.error) flags out of range or that need --network; sets `args.fault`
    (HOST, STEP) from --network_fault, or None."""
    if args.num_processes < 1:
        parser.error(f"--num_processes={args.num_processes}: must be at least 1")
    if args.devices_per_process < 1:
        parser.error(f"--devices_per_process={args.devices_per_process}: must be at least 1")
    if args.max_restarts < 0:
        parser.error(f"--max_restarts={args.max_restarts}: must be at least 0")
    if args.hang_s < 0:
        parser.error(f"--hang_s={args.hang_s:g}: must be at least 0 (0 = off)")
    if args.processes_per_host < 1 or args.num_processes % args.processes_per_host:
        parser.error(
            f"--processes_per_host={args.processes_per_host}: must be at least 1 and divide "
            f"--num_processes={args.num_processes}"
        )
    if not args.network and (args.link or args.processes_per_host != 1 or args.network_fault):
        parser.error("--link, --processes_per_host and --network_fault need --network")
    args.fault = None
    if args.network_fault:
        hosts = args.num_processes // args.processes_per_host
        m = re.fullmatch(r"(\d+):(\d+)", args.network_fault)
        if not m or int(m.group(1)) >= hosts or int(m.group(2)) < 1:
            parser.error(
                f"--network_fault={args.network_fault}: must be HOST:STEP with HOST in "
                f"0..{hosts - 1} (the emulated hosts) and STEP at least 1, e.g. {hosts - 1}:5"
            )
        args.fault = (int(m.group(1)), int(m.group(2)))
    if not 0 <= args.coordinator_port < 65536:
        parser.error(f"--coordinator_port={args.coordinator_port}: must be 0..65535")


def _port_in_use(port: int) -> bool:
    """jaxdist.distributed.port_in_use, the probe process 0 makes before serving the coordinator."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxdist.distributed import port_in_use

    return port_in_use(port)


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


def _child_envs(
    args: argparse.Namespace, port: int, coordinator: str = "127.0.0.1"
) -> tuple[list[dict[str, str]], str]:
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
            JAXDIST_COORDINATOR=f"{coordinator}:{port}",
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
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exited with code {returncode} (preempted: checkpoint saved, run unfinished)"
    return f"exited with code {returncode}"


def _proc_state(pid: int) -> str:
    """Linux process state letter (`R`, `S`, `D`, `T` stopped, `Z`), or "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _read_progress(path: str) -> tuple[int, float] | None:
    """(last step reported, when) from a progress file, None before the first report."""
    try:
        mtime = os.stat(path).st_mtime
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0]), mtime
    except (OSError, ValueError, IndexError):
        return None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")


def _is_noise(line: str) -> bool:
    """Stack-trace frames of a C++ abort say nothing about why; skip them for the summary."""
    s = line.strip()
    return not s or s.startswith("@ 0x") or s.startswith("*** ") or s.startswith("@     0x")


class Launcher:
    """One attempt of a job: start the processes, watch them, stop them all on a failure."""

    def __init__(
        self,
        command: list[str],
        envs: list[dict[str, str]],
        grace_s: float,
        hang_s: float = 0.0,
        progress_dir: str | None = None,
        wrap=None,
        fault: tuple[int, Callable[[], str]] | None = None,
        unreachable: Callable[[], dict[int, str]] | None = None,
    ):
        self.command = command
        # rank -> the command that process runs (inside its emulated host, with --network)
        self.commands = [command if wrap is None else wrap(r, command) for r in range(len(envs))]
        self.envs = envs
        self.grace_s = grace_s
        self.hang_s = hang_s
        self.procs: list[subprocess.Popen] = []
        self.pumps: dict[int, list[threading.Thread]] = {}
        self.tail: dict[int, collections.deque[str]] = {}
        self.out_lock = threading.Lock()
        self.signalled: int | None = None
        self.kill_deadline: float | None = None
        self.killed = False
        self.failed_ranks: list[int] = []  # failed or stalled, not stopped by us
        # (step, action): the action runs once, when a process has reported that step
        self.fault = fault
        # rank -> why it cannot be reached (its host's link is down), asked only to blame
        self.unreachable = unreachable
        self.progress: list[str] = []
        if progress_dir is not None:
            for rank, env in enumerate(envs):
                path = os.path.join(progress_dir, f"rank{rank}")
                if os.path.exists(path):
                    os.remove(path)  # an earlier attempt's
                env[ENV_PROGRESS_FILE] = path
                self.progress.append(path)

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
                    self.commands[rank],
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
            self.kill_deadline = time.monotonic() + min(self.grace_s, FAILURE_GRACE_S)
            self._signal_all(signal.SIGTERM)

    def _stalled(self) -> tuple[int, str] | None:
        """(rank, why) of the process that stopped making progress, once one has for hang_s."""
        if self.hang_s <= 0 or not self.progress:
            return None
        now = time.time()
        reports = [_read_progress(p) for p in self.progress]
        if not any(r is not None and now - r[1] > self.hang_s for r in reports):
            return None
        return self._culprit(reports)

    def _culprit(self, reports: list[tuple[int, float] | None]) -> tuple[int, str]:
        """The process to blame: one stopped by a signal, else the one furthest behind.

        Its peers wait for it in a collective and stop reporting too, so staleness alone does not
        say who; they do get one step further (they dispatched the step it never joined).
        """
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None and _proc_state(proc.pid) == "T":
                last = reports[rank][0] if reports[rank] else None
                return rank, f"is stopped (state T) at step {last}"
        cut_off = self.unreachable() if self.unreachable is not None else {}
        for rank in sorted(cut_off):
            last = reports[rank][0] if reports[rank] else None
            return rank, f"is cut off ({cut_off[rank]}) at step {last}"
        started = [(r[0], r[1], rank) for rank, r in enumerate(reports) if r is not None]
        if len(started) < len(reports):  # one never reported a step: it is furthest behind
            rank = next(rank for rank, r in enumerate(reports) if r is None)
            return rank, "never reported a step"
        step, when, rank = min(started)
        return rank, f"reported step {step} last, {time.time() - when:.0f} s ago"

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
        blame = ""  # a process found stopped when another failed: the likely cause
        hung: tuple[int, str] | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            dead = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if dead and failed is None and hung is None and self.signalled is None:
                # Seen in one poll, a process killed by a signal is the cause: the others' errors
                # (a collective's peer gone) follow from it.
                failed = min(dead, key=lambda rc: (rc[1] >= 0, rc[0]))
                rank = failed[0]
                culprit = self._culprit([_read_progress(p) for p in self.progress])
                certain = "state T" in culprit[1] or "cut off" in culprit[1]
                if self.progress and culprit[0] != rank and certain:
                    blame = f"process {culprit[0]} {culprit[1]}: it stalled first; "
                    self.failed_ranks.append(culprit[0])
                self.failed_ranks.append(rank)
                self._stop_all()
            if self.fault is not None and self.progress:
                reports = [_read_progress(p) for p in self.progress]
                reached = max((r[0] for r in reports if r is not None), default=0)
                if reached >= self.fault[0]:
                    what = self.fault[1]()
                    print(
                        f"{NAME}: --network_fault: {what} (a process reported step {reached})",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.fault = None
            if failed is None and hung is None and self.signalled is None:
                hung = self._stalled()
                if hung is not None:
                    self.failed_ranks.append(hung[0])
                    self._stop_all()
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
        if hung is not None and failed is None:
            rank, why = hung
            last = self._last_line(rank)
            msg = (
                f"{NAME}: process {rank} made no progress for {self.hang_s:g} s (--hang_s): it "
                f"{why}; stopped all {len(self.procs)} processes"
            )
            msg += f"; its last line: {last!r}" if last else ""
            print(msg, file=sys.stderr, flush=True)
            return HANG_EXIT_CODE
        if failed is not None:
            rank, code = failed
            last = self._last_line(rank)
            others = sum(1 for r, p in enumerate(self.procs) if r != rank and p.returncode != 0)
            msg = f"{NAME}: {blame}process {rank} {_describe(code)}"
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


def _cluster(args: argparse.Namespace) -> namespaces.Cluster:
    """The emulated cluster of `--network`, built (raises ConfigError when it cannot be)."""
    hosts = args.num_processes // args.processes_per_host
    links = profiles.host_links(profiles.link(args.network), hosts, args.link)
    cluster = namespaces.Cluster(links).up()
    print(f"{NAME}: {cluster.describe()}", file=sys.stderr, flush=True)
    return cluster


def _cut_off(cluster: namespaces.Cluster, on: list[int], per: int) -> dict[int, str]:
    """rank -> why, for the ranks (rank r on host on[r // per]) whose host's link is down."""
    down = set(cluster.hosts_without_carrier())
    return {
        rank: f"host{on[rank // per]}'s link is down: its switch port has no carrier"
        for rank in range(len(on) * per)
        if on[rank // per] in down
    }


def _link_down(cluster: namespaces.Cluster, host: int) -> str:
    """`--network_fault`'s action: host `host`'s link goes down; returns what was done."""
    cluster.set_link(host, up=False)
    return f"host{host}'s link is down (ip link set eth0 down in {cluster.hosts[host].netns})"


PROGRESS_PREFIX = "jaxdist-progress-"


def _progress_dir() -> str:
    """A new folder for this launcher's progress files, named `jaxdist-progress-<pid>-*` under
    the temporary folder, after removing those of launchers no longer alive: a launcher killed
    outright (SIGKILL) cannot remove its own, as `namespaces.remove_stale` removes a cluster's."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(PROGRESS_PREFIX) :].partition("-")[0]
        if not (name.startswith(PROGRESS_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # dead; a live one (ours or another user's) keeps its folder
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            pass
    return tempfile.mkdtemp(prefix=f"{PROGRESS_PREFIX}{os.getpid()}-")


def _job_goodput(snapshots: list[tuple[str, float, float]]) -> None:
    """Sums the attempts' goodput records into the job's: one line, and a `goodput_job` record
    in the run's metrics.jsonl (when the command was a training run that wrote one).

    `snapshots`: each attempt's (goodput file, start, end), times in seconds since the epoch.
    """
    attempts = [
        job_goodput.Attempt(job_goodput.read_snapshot(path), start, end)
        for path, start, end in snapshots
    ]
    workdirs = [a.record["workdir"] for a in attempts if a.record and a.record.get("workdir")]
    if not workdirs:
        return  # not a training run, or no attempt reached a logged step
    record = job_goodput.job_record(attempts)
    print(f"{NAME}: {job_goodput.summary_line(record)}", file=sys.stderr, flush=True)
    try:
        job_goodput.append_to_metrics(record, workdirs[-1])
    except OSError as err:
        print(f"{NAME}: cannot append the job's goodput record: {err}", file=sys.stderr)


def _wiring(args: argparse.Namespace, cluster, live: list[int], attempt: int):
    """How attempt `attempt` is wired: (coordinator port, coordinator host, wrap, fault,
    unreachable), the last three None on this host's loopback (no --network)."""
    if cluster is None:
        return args.coordinator_port or _free_port(), "127.0.0.1", None, None, None
    per = args.processes_per_host
    # a fresh namespace: any port is free; a new one per attempt (TIME_WAIT)
    port = (args.coordinator_port or 8476) + attempt
    on = list(live)  # rank r runs on host on[r // per]
    wrap = lambda rank, cmd: cluster.wrap(on[rank // per], cmd)  # noqa: E731
    unreachable = lambda: _cut_off(cluster, on, per)  # noqa: E731
    fault = None
    if args.fault is not None and attempt == 0:
        fault = (args.fault[1], lambda h=args.fault[0]: _link_down(cluster, h))
    return port, cluster.hosts[live[0]].address, wrap, fault, unreachable


def _add_counters_env(envs: list[dict], cluster, processes_per_host: int) -> None:
    """Where each process of an emulated cluster reads its host's link counters and rates."""
    for env in envs:
        env[counters.ENV_COUNTERS] = cluster.counters_path
        env[counters.ENV_PROCESSES_PER_HOST] = str(processes_per_host)
        env[counters.ENV_RATES] = ",".join(f"{h.link.rate_bps:g}" for h in cluster.hosts)


def _without_failed(args: argparse.Namespace, cluster, live: list[int], failed_ranks):
    """--elastic: (args for the processes that remain, the hosts they run on), or None (after
    saying so) when none remains. On an emulated cluster a failed process's host is left out
    whole: its link, not only one process, is what failed."""
    per = args.processes_per_host
    if cluster is not None:
        gone = {live[rank // per] for rank in failed_ranks}
        live = [h for h in live if h not in gone]
        remaining = len(live) * per
        if remaining < 1:
            print(f"{NAME}: no host left to restart on", file=sys.stderr, flush=True)
            return None
        left_out = ", ".join(f"host{h}" for h in sorted(gone))
        print(f"{NAME}: leaving out {left_out}", file=sys.stderr, flush=True)
    else:
        remaining = args.num_processes - len(set(failed_ranks))
        if remaining < 1:
            print(f"{NAME}: no process left to restart on", file=sys.stderr, flush=True)
            return None
    return argparse.Namespace(**{**vars(args), "num_processes": remaining}), live


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--network=list" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        print(profiles.listing())
        return 0
    args, command = _parse(argv)
    if args.coordinator_port and _port_in_use(args.coordinator_port):
        print(
            f"{NAME}: --coordinator_port={args.coordinator_port} is already in use on this host; "
            "pick another, or 0 (the default) for a free one",
            file=sys.stderr,
        )
        return 2
    cluster = None
    if args.network:
        try:
            cluster = _cluster(args)
        except ConfigError as e:
            print(f"{NAME}: {e}", file=sys.stderr, flush=True)
            return 2
    # Progress files also let a failure be blamed on a process that had stalled before it.
    progress_dir = _progress_dir()
    snapshots: list[tuple[str, float, float]] = []  # goodput file, start, end (job_goodput.py)
    live = list(range(args.num_processes // args.processes_per_host))  # the emulated hosts
    ended: list[int] = []  # pids of the processes of earlier attempts (all ended)
    try:
        for attempt in range(args.max_restarts + 1):
            port, host, wrap, fault, unreachable = _wiring(args, cluster, live, attempt)
            envs, what = _child_envs(args, port, host)
            if cluster is not None:
                _add_counters_env(envs, cluster, args.processes_per_host)
            print(
                f"{NAME}: {args.num_processes} process(es) x {what}, coordinator {host}:{port}",
                file=sys.stderr,
                flush=True,
            )
            snapshot = os.path.join(progress_dir, f"goodput-{attempt}.json")
            for env in envs:
                env[job_goodput.ENV_GOODPUT_FILE] = snapshot
                if ended:
                    env[ENV_ENDED_PIDS] = ",".join(map(str, ended))
            launcher = Launcher(
                command,
                envs,
                args.grace_s,
                args.hang_s,
                progress_dir,
                wrap=wrap,
                fault=fault,
                unreachable=unreachable,
            )
            started = time.time()
            try:
                code = launcher.run()
            finally:
                snapshots.append((snapshot, started, time.time()))
            ended += [p.pid for p in launcher.procs]  # run() returns once every one has ended
            if code == 0 or launcher.signalled is not None or attempt == args.max_restarts:
                return code
            if args.elastic:
                narrowed = _without_failed(args, cluster, live, launcher.failed_ranks)
                if narrowed is None:
                    return code
                args, live = narrowed
            where = " (those that remain)" if args.elastic else ""
            print(
                f"{NAME}: restarting the job from its last checkpoint on {args.num_processes} "
                f"process(es){where} (restart {attempt + 1} of {args.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
        return code
    finally:
        _job_goodput(snapshots)
        shutil.rmtree(progress_dir, ignore_errors=True)
        if cluster is not None:
            cluster.down()
            if cluster.wire_summary():
                print(f"{NAME}: {cluster.wire_summary()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
