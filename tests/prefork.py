"""The suite's Python processes, forked from an interpreter that has imported the heavy packages.

A fresh `python scripts/X.py` spends ~1.2 CPU s importing jax, flax, optax, orbax and numpy before
it reads its first flag; the suite starts hundreds of such processes. A server started once per
test process imports those packages (`PRELOAD`: third-party only, never `jaxdist` or `models`,
which a command may import from another copy of the repository) and waits on a Unix socket. The
client (`python tests/prefork.py client ARGS`, or the `python` shim `shim()` writes) sends its
arguments, working directory, environment and file descriptors 0-2; the server forks, and the
child takes them over and runs the script as `__main__`, as `python ARGS` would:

- `sys.argv`, `sys.path[0]`, `__main__.__file__`, the working directory and `os.environ` are the
  client's; stdin/stdout/stderr are its descriptors, rebuilt with a fresh interpreter's buffering
  (`-u` honoured).
- The child leads a process group of its own: a signal the client receives (TERM, INT, HUP, QUIT,
  USR1, USR2), sent to it alone or to its group, reaches the child's group once. When the client
  is killed outright (SIGKILL), the server kills the child the same way.
- It ends as the interpreter does: non-daemon threads joined, atexit handlers run, the exit code
  of `SystemExit`, 1 with the traceback printed for an uncaught exception, death by SIGINT for an
  uncaught KeyboardInterrupt. The client exits with the same status, or dies of the same signal.

What differs from a fresh process, and why no test that runs through it depends on it: the
child's /proc/PID/cmdline is the server's (a test that finds processes by command line starts
them with sys.executable); its parent is the server; its string hashes and numpy's global
generator are seeded once per server (numpy's is re-seeded in the child); warnings an import
printed went to the server's stderr (none of `PRELOAD`'s do); its `sys.executable` is the shim
`python` (`PYTHON_ENV`), so the Python processes it starts itself (scripts/launch.py's workers,
which it starts as `sys.executable SCRIPT`) are forked too where the fork reproduces them.

What a fork cannot reproduce is refused, and the client then runs the real interpreter (`exec`):
any interpreter option but `-u`; an environment whose variables read at import time (`JAX_*`,
`XLA_*` but those a backend reads when it starts (`ENV_READ_LATER`) and the compilation cache's,
which the child sets jax's config from before anything compiles (`ENV_APPLIED`), `PYTHON*` but
PYTHONUNBUFFERED (the child's streams honour it, as `-u`), `TF_*`, `OPENBLAS_*`, `OMP_*`, `MKL_*`,
`TENSORSTORE_*`) differ from the server's, PYTHONPATH aside: a child puts its own entries on
`sys.path`, unless one the server lacks, or one the server has and the child lacks, holds a
top-level module the server has imported; a client in other namespaces than the server's (`ip
netns exec`, `unshare`: a forked child would run in the server's network, mounts, hostname); a
client that inherited a descriptor besides 0-2 (`pass_fds`, as multiprocessing's spawn passes
its pipes: only 0-2 reach the child); a server with more than one thread (fork would copy a
lock some thread holds). tests/test_prefork.py checks a forked run against a fresh one.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "flax.nnx",
    "optax",
    "orbax.checkpoint",
    "ml_collections",
    "absl.app",
    "absl.flags",
    "absl.logging",
)
ENV_READ_AT_IMPORT = (
    "JAX_",
    "XLA_",
    "PYTHON",
    "TF_",
    "OPENBLAS_",
    "OMP_",
    "MKL_",
    "TENSORSTORE_",
)
# Read when a backend starts, after the fork (jax/_src/xla_bridge.py, jaxlib/xla_client.py).
ENV_READ_LATER = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_", "XLA_CLIENT_MEM_FRACTION")
# Read when jax is imported, into its config only, and used when the first program is compiled
# (jax/_src/compilation_cache.py): a child whose value differs sets the config from it first.
ENV_APPLIED = {
    "JAX_COMPILATION_CACHE_DIR": str,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": float,
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": int,
}
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
SOCKET_ENV = "JAXDIST_TEST_PREFORK"
LOG_ENV = "JAXDIST_TEST_PREFORK_LOG"  # a file: a JSON line per child that ended, per refusal
PYTHON_ENV = "JAXDIST_TEST_PYTHON"  # the shim `python` tests/helpers.python() hands out


def env_key(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` an import may read: a child forked after the imports needs them
    equal to the server's."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(ENV_READ_AT_IMPORT)
        and not k.startswith(ENV_READ_LATER)
        and k != "PYTHON"  # a script's choice of interpreter (scripts/gpu_check.sh), not Python's
        and k != "PYTHONPATH"  # compared on its own (`pythonpath_refusal`)
        and k != "PYTHONUNBUFFERED"  # the child's streams honour it (`_stdio`)
        and k not in ENV_APPLIED  # compared on its own: the child applies it (`_apply_config`)
    }


NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")


def namespaces() -> dict[str, str]:
    """This process's namespaces (`/proc/self/ns`), by kind: a child forked by the server runs in
    the server's, so a client in any other runs the interpreter itself."""
    found = {}
    for kind in NAMESPACES:
        try:
            found[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            pass
    return found


def inherited_descriptors() -> list[int]:
    """Descriptors besides 0-2 this process holds (what a parent passed it): only 0-2 reach a
    forked child."""
    folder = "/proc/self/fd"
    held = []
    for name in os.listdir(folder):
        fd = int(name)
        if fd > 2:
            try:
                os.readlink(f"{folder}/{name}")  # the listing's own descriptor is closed by now
            except OSError:
                continue
            held.append(fd)
    return held


def pythonpath_entries(value: str | None, cwd: str) -> list[str]:
    """The `sys.path` entries the interpreter makes of PYTHONPATH `value` in `cwd`."""
    if not value:
        return []
    return [os.path.join(cwd, entry) for entry in value.split(os.pathsep)]


def pythonpath_refusal(ours: list[str], theirs: list[str], imported: set[str]) -> str:
    """'' when a child may run with PYTHONPATH entries `theirs` instead of the server's `ours`:
    no entry in one and not the other holds a top-level module the server has imported
    (`imported`), which the child's path could otherwise have found elsewhere, or a module the
    interpreter imports as it starts (`sitecustomize`, `usercustomize`), which a forked child
    would not run. The repository root, which tests put on PYTHONPATH for `jaxdist`, holds none."""
    startup = {"sitecustomize", "usercustomize"}
    for entry in set(ours) ^ set(theirs):
        try:
            names = {name.split(".")[0] for name in os.listdir(entry)}
        except OSError:
            continue  # a missing entry finds nothing
        if names & (imported | startup):
            return "PYTHONPATH:" + entry
    return ""


def parse_argv(args: list[str]) -> tuple[str, str, list[str], bool] | None:
    """(mode, target, rest, unbuffered) for `python ARGS`, mode one of script / -c / -m; None
    for what the fork does not reproduce (other options, no target, an interactive session)."""
    unbuffered = False
    i = 0
    while i < len(args) and args[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(args):
        return None
    first = args[i]
    if first in ("-c", "-m"):
        if i + 1 >= len(args):
            return None
        return first, args[i + 1], args[i + 2 :], unbuffered
    if first.startswith("-") or first == "":
        return None
    return "script", first, args[i + 1 :], unbuffered


# ------------------------------------------------------------------------------------------------
# Client.


def _send(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    header = struct.pack("!Q", len(payload))
    sock.sendmsg(
        [header + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    )


def client(args: list[str]) -> None:
    """Runs `python ARGS` through the server named by $JAXDIST_TEST_PREFORK, else `exec`s the
    interpreter itself."""
    path = os.environ.get(SOCKET_ENV)
    real = sys.executable
    fallback = [real, *args]
    if not path or parse_argv(args) is None:
        os.execv(real, fallback)
    inherited = inherited_descriptors()  # before the socket adds one of ours
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {
            "args": args,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "namespaces": namespaces(),
            "inherited": inherited,
        }
        _send(sock, json.dumps(request).encode(), [0, 1, 2])
        reply = sock.makefile("rb")
        first = reply.readline().split()
    except OSError:
        first = []
    if not first or first[0] != b"pid":
        sock.close()
        os.execv(real, fallback)
    pid = int(first[1])

    def forward(signum, frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    while True:
        try:
            line = reply.readline().split()
            break
        except InterruptedError:
            continue
    status = int(line[1]) if line and line[0] == b"exit" else 1 << 8
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status))


def start(folder: str):
    """Starts a server in `folder` (its socket `folder/s`, its shims in `folder/bin`); returns
    (the server process, the socket's path, the shim `python`). Not waited for: a client that
    comes before the socket exists runs the plain interpreter."""
    import subprocess

    sock = os.path.join(folder, "s")
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "serve", sock],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    return server, sock, os.path.join(shim(os.path.join(folder, "bin")), "python")


def shim(directory: str) -> str:
    """Writes `python` and `python3` into `directory` that run through the server; returns it."""
    os.makedirs(directory, exist_ok=True)
    for name in ("python", "python3"):
        target = os.path.join(directory, name)
        with open(target, "w") as f:
            f.write(
                f'#!/bin/sh\nexec {sys.executable} -I -S {os.path.abspath(__file__)} client "$@"\n'
            )
        os.chmod(target, 0o755)
    return directory


# ------------------------------------------------------------------------------------------------
# Server.


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, raw in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[: len(raw) - (len(raw) % fds.itemsize)])
    while len(data) < 8:
        more = conn.recv(1 << 16)
        if not more:
            raise OSError("request cut short")
        data += more
    (size,) = struct.unpack("!Q", data[:8])
    body = data[8:]
    while len(body) < size:
        more = conn.recv(1 << 20)
        if not more:
            raise OSError("request cut short")
        body += more
    return json.loads(body), list(fds)


def _refusal(request: dict, fds: list[int], server: _Server) -> str:
    """Why `server` will not fork for `request` ('' when it will)."""
    if len(fds) != 3:
        return "descriptors"
    if request.get("inherited"):
        return "inherited descriptors:" + ",".join(map(str, request["inherited"]))
    ours, spaces = server.namespaces, request.get("namespaces", {})
    differ = sorted(k for k in ours.keys() | spaces.keys() if ours.get(k) != spaces.get(k))
    if differ:
        return "namespaces:" + ",".join(differ)
    if parse_argv(request["args"]) is None:
        return "options"
    unset = [k for k in server.applied if k not in request["env"]]
    if unset:  # jax's default, which the server's import no longer has
        return "environment:" + ",".join(unset)
    key, theirs = server.key, env_key(request["env"])
    if theirs != key:
        return "environment:" + ",".join(
            sorted(k for k in key.keys() | theirs.keys() if key.get(k) != theirs.get(k))
        )
    entries = pythonpath_entries(request["env"].get("PYTHONPATH"), request["cwd"])
    imported = {name.split(".")[0] for name in sys.modules}
    refused = pythonpath_refusal(server.pythonpath, entries, imported)
    if refused:
        return refused
    if len(os.listdir("/proc/self/task")) != 1:
        return "threads"
    return ""


def serve(path: str) -> None:
    """Imports `PRELOAD`, then forks a child per request on the Unix socket `path` until the
    process that started it is gone."""
    _Server(path).run()


class _Server:
    """One thread, one `select` loop: requests in, children out, their ends reported."""

    def __init__(self, path: str):
        import importlib

        self.parent = os.getppid()
        # a JSON line per child (its CPU, what it ran, for which test) and per refusal (why, what)
        self.log = os.environ.get(LOG_ENV)
        before = dict(os.environ)
        self.key = env_key(before)
        self.applied = {k: before[k] for k in ENV_APPLIED if k in before}
        self.namespaces = namespaces()
        # sys.path is [this script's folder, PYTHONPATH's entries, the rest]: a child puts its
        # own folder and entries before the rest.
        self.pythonpath = pythonpath_entries(before.get("PYTHONPATH"), os.getcwd())
        self.rest_of_path = sys.path[1 + len(self.pythonpath) :]
        for name in PRELOAD:
            importlib.import_module(name)
        # What the imports set (jax sets TF_CPP_MIN_LOG_LEVEL and TPU_SKIP_MDS_QUERY when unset):
        # a child's environment gets the same change where it started as the server's did.
        changes = {k: (before.get(k), os.environ.get(k)) for k in os.environ.keys() | before.keys()}
        self.imported = {k: change for k, change in changes.items() if change[0] != change[1]}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: dict[int, socket.socket] = {}  # child pid -> its client's connection
        self.clients: dict[socket.socket, int] = {}
        self.requests: dict[int, dict] = {}  # child pid -> what it runs, for the log

    def run(self) -> None:
        import select

        while os.getppid() == self.parent:
            watched = [self.listener, self.wake_r, *self.clients]
            ready, _, _ = select.select(watched, [], [], 1.0)
            if self.wake_r in ready:
                self._drain_wakeups()
            self._reap()
            for conn in [c for c in ready if c in self.clients]:
                self._check_client(conn)
            if self.listener in ready:
                self._accept()

    def _drain_wakeups(self) -> None:
        while True:
            try:
                if not os.read(self.wake_r, 4096):
                    return
            except BlockingIOError:
                return

    def _reap(self) -> None:
        """Reports each ended child's wait status to its client."""
        while self.children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                return
            if self.log:
                with open(self.log, "a") as f:
                    cpu = round(usage.ru_utime + usage.ru_stime, 3)
                    what = self.requests.pop(pid, {})
                    f.write(json.dumps({"pid": pid, "status": status, "cpu": cpu, **what}) + "\n")
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.clients.pop(conn, None)
                try:
                    conn.sendall(b"exit %d\n" % status)
                except OSError:
                    pass
                conn.close()

    def _check_client(self, conn: socket.socket) -> None:
        """A client's connection is readable only when it closed: the client was killed, so its
        child is killed too."""
        try:
            gone = not conn.recv(1)
        except OSError:
            gone = True
        if not gone:
            return
        pid = self.clients.pop(conn)
        self.children.pop(pid, None)
        conn.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(10)
            request, fds = _recv_request(conn)
            conn.settimeout(None)
            refused = _refusal(request, fds, self)
            if refused:
                if self.log:
                    with open(self.log, "a") as f:
                        f.write(json.dumps({"refused": refused, "args": request["args"]}) + "\n")
                conn.sendall(b"no %s\n" % refused.encode())
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                self._become_child(conn, request, fds)
            try:
                os.setpgid(pid, pid)  # here too: the group exists before the client learns `pid`
            except OSError:
                pass  # the child has ended already
            self.children[pid] = conn
            self.clients[conn] = pid
            if self.log:  # what the child ran and for which test, for its record in `_reap`
                test = request["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
                self.requests[pid] = {"args": request["args"][:8], "test": test}
            conn.sendall(b"pid %d\n" % pid)
        except OSError:
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _become_child(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for other in self.clients:
            other.close()
        conn.close()
        try:
            _child(request, fds, self)  # ends the process
        finally:
            os._exit(70)  # never back into the server's loop


def _stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr as a fresh interpreter makes them for descriptors 0-2."""
    import io

    def writer(fd: int, errors: str, line: bool):
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary, encoding="utf-8", errors=errors, line_buffering=line, write_through=unbuffered
        )

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"
    )
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _apply_config(server_values: dict[str, str]) -> None:
    """jax's config from this child's `ENV_APPLIED` variables where they differ from the server's
    (`_refusal` has checked the child sets each one the server sets)."""
    for name, kind in ENV_APPLIED.items():
        value = os.environ.get(name)
        if value is not None and value != server_values.get(name):
            import jax

            jax.config.update(name.lower(), kind(value))


def _child(request: dict, fds: list[int], server: _Server) -> None:
    import atexit
    import runpy
    import threading
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's global generator is unseeded
    os.environ.clear()
    os.environ.update(request["env"])
    for k, (was, now) in server.imported.items():
        if os.environ.get(k) == was:
            if now is None:
                del os.environ[k]
            else:
                os.environ[k] = now
    entries = pythonpath_entries(os.environ.get("PYTHONPATH"), request["cwd"])
    sys.path[:] = ["", *entries, *server.rest_of_path]  # [0] is set below, as the mode has it
    sys.executable = os.environ.get(PYTHON_ENV) or sys.executable  # its `python`s come here too
    _apply_config(server.applied)
    mode, target, rest, unbuffered = parse_argv(request["args"])
    _stdio(unbuffered or bool(os.environ.get("PYTHONUNBUFFERED")))
    code, killed_by = 0, 0
    try:
        if mode == "script":
            sys.argv = [target, *rest]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            path = os.path.abspath(target)  # a script's __file__ and code are absolute
            with open(path, "rb") as f:
                compiled = compile(f.read(), path, "exec")
            main = _main_module(file=path, loader=SourceFileLoader("__main__", path))
            exec(compiled, main.__dict__)
        elif mode == "-m":
            sys.argv = ["-m", *rest]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            sys.argv = ["-c", *rest]
            sys.path[0] = ""
            main = _main_module(loader=BuiltinImporter)
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        killed_by = signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if killed_by:
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    os._exit(code)


def _main_module(loader, file: str | None = None):
    """A fresh `__main__`, as the interpreter makes it for a script or `-c`."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    main.__loader__ = loader
    main.__spec__ = None
    if file is not None:
        main.__file__ = file
        main.__cached__ = None
    sys.modules["__main__"] = main
    return main


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "client":
        client(sys.argv[2:])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET | client ARGS")
