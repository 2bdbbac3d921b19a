"""tests/prefork.py: a process forked from the preloaded server behaves as `python ARGS` does.

Each case runs the same command twice, through the server and with the plain interpreter, and
compares what a caller can see: output, exit status, the process's view of its arguments, path,
directory and environment. `forked` is asserted too (the child's parent is the server), so a
server that silently ran everything through the fallback fails here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import prefork

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "var": os.environ.get("PREFORK_PROBE"), "tf": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
    "main": __name__, "file": globals().get("__file__"),
    "parent": os.getppid(), "stdout_tty": sys.stdout.isatty(),
}))
sys.stderr.write("to stderr\\n")
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(shim folder, server pid, socket): a server of this test's own, ready, writing its log
    (`LOG_ENV`) to `prefork.log` in its folder."""
    folder = tmp_path_factory.mktemp("prefork")
    os.environ[prefork.LOG_ENV] = str(folder / "prefork.log")  # the server reads it as it starts
    try:
        proc, sock, python = prefork.start(str(folder))
    finally:
        del os.environ[prefork.LOG_ENV]
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    shims = os.path.dirname(python)
    yield Path(shims), proc.pid, sock
    proc.terminate()
    proc.wait(timeout=30)


def _log(server) -> list[dict]:
    path = Path(server[2]).parent / "prefork.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _server_env(server, env=None) -> dict[str, str]:
    """This process's environment pointed at `server`, with `env` added."""
    shims, _, sock = server
    return {
        **os.environ,
        prefork.SOCKET_ENV: str(sock),
        prefork.PYTHON_ENV: str(shims / "python"),
        **(env or {}),
    }


def _run(server, forked: bool, *args, env=None, cwd=ROOT, prefix=()):
    """`python ARGS` in `env` (added to this process's), through `server`'s shim or with the
    plain interpreter; `prefix` runs before it (`unshare ...`)."""
    python = server[0] / "python" if forked else sys.executable
    return subprocess.run(
        [*prefix, str(python), *args],
        cwd=cwd,
        env=_server_env(server, env),
        capture_output=True,
        text=True,
    )


def _both(server, *args, env=None, cwd=ROOT):
    """(forked run, fresh run) of `python ARGS` in `env` (added to this process's)."""
    return tuple(_run(server, forked, *args, env=env, cwd=cwd) for forked in (True, False))


def test_a_script_sees_what_a_fresh_interpreter_sees(server, tmp_path):
    _, server_pid, _ = server
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    forked, fresh = _both(
        server, str(script), "a", "--b=1", env={"PREFORK_PROBE": "x"}, cwd=tmp_path
    )
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert got.pop("parent") == server_pid  # it was forked
    assert want.pop("parent") != server_pid
    assert got == want, (got, want)
    assert got["argv"] == [str(script), "a", "--b=1"] and got["var"] == "x" and got["tf"] == "1"
    assert forked.stderr == fresh.stderr == "to stderr\n"
    assert forked.returncode == fresh.returncode == 0


def test_the_log_names_each_childs_cpu_command_and_test_and_each_refusal(server):
    """The server's log (`JAXDIST_TEST_PREFORK_LOG`): a line per forked child once it ends (its
    CPU seconds, its arguments, the test that started it: what a forked child costs is not in
    the test process's own rusage) and a line per refusal."""
    spin = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    test = "tests/test_x.py::test_y"
    forked = _run(server, True, "-c", spin, env={"PYTEST_CURRENT_TEST": f"{test} (call)"})
    refused = _run(server, True, "-c", "pass", env={"JAX_ENABLE_X64": "1"})
    assert forked.returncode == refused.returncode == 0, (forked.stderr, refused.stderr)
    deadline = time.monotonic() + 30  # the server writes a child's line when it reaps it
    while not [r for r in _log(server) if r.get("args") == ["-c", spin] and "cpu" in r]:
        assert time.monotonic() < deadline, _log(server)
        time.sleep(0.05)
    (child,) = [r for r in _log(server) if r.get("args") == ["-c", spin] and "cpu" in r]
    assert child["test"] == test and child["status"] == 0 and 0.3 <= child["cpu"] < 5, child
    (refusal,) = [r for r in _log(server) if r.get("args") == ["-c", "pass"]]
    assert refusal["refused"] == "environment:JAX_ENABLE_X64", refusal


def test_dash_c_and_relative_script_paths(server, tmp_path):
    forked, fresh = _both(server, "-c", PROBE, "z")
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    got.pop("parent"), want.pop("parent")
    assert got == want and got["argv"] == ["-c", "z"] and got["path0"] == ""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    forked, fresh = _both(server, "sub/probe.py", cwd=tmp_path)
    got, want = json.loads(forked.stdout), json.loads(fresh.stdout)
    got.pop("parent"), want.pop("parent")
    assert got == want and got["argv"] == ["sub/probe.py"]
    assert got["file"] == str(tmp_path / "sub" / "probe.py")
    forked, fresh = _both(server, "-u", "scripts/plot.py", "--help")
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)


@pytest.mark.parametrize(
    "code, status",
    [
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('a message')", 1),
        ("raise ValueError('boom')", 1),
        ("raise KeyboardInterrupt", -signal.SIGINT),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
        ("import atexit; atexit.register(print, 'at exit'); print('body')", 0),
        (
            "import threading, time; threading.Thread(target=lambda: (time.sleep(0.3), "
            "print('thread joined'))).start()",
            0,
        ),
    ],
)
def test_exit_status_and_output_match(server, code, status):
    forked, fresh = _both(server, "-c", code)
    assert forked.returncode == fresh.returncode == status
    assert forked.stdout == fresh.stdout
    # A traceback's last line (the frames name the server's runner above `<string>`).
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]


def test_a_refusal_by_the_train_script_is_the_same_line(server):
    forked, fresh = _both(server, "scripts/train.py", "--config.mesh.data=3")
    assert forked.returncode == fresh.returncode == 2
    assert forked.stdout + forked.stderr == fresh.stdout + fresh.stderr
    assert "make the product 8" in forked.stderr


def test_xla_flags_are_read_by_the_child(server):
    """XLA_FLAGS is read when the backend starts, after the fork: a child sees its own."""
    code = "import jax; print(jax.device_count())"
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3", "JAX_PLATFORMS": "cpu"}
    forked, fresh = _both(server, "-c", code, env=flags)
    assert forked.stdout.strip() == fresh.stdout.strip() == "3"


def test_an_environment_read_at_import_runs_a_fresh_interpreter(server):
    """JAX_ENABLE_X64 is read when jax is imported: the server's import has the wrong value, so
    the client runs the interpreter itself."""
    _, server_pid, _ = server
    code = "import os, jax; print(jax.config.jax_enable_x64, os.getppid())"
    forked, _ = _both(server, "-c", code, env={"JAX_ENABLE_X64": "1"})
    enabled, parent = forked.stdout.split()
    assert enabled == "True" and int(parent) != server_pid


def test_a_compilation_cache_of_its_own_is_forked_and_used(server, tmp_path):
    """tests/test_resume.py gives its runs a compilation cache of their own: jax reads the
    variables at import, the child sets its config from them, and its programs go there."""
    _, server_pid, _ = server
    code = (
        "import os, jax; jax.jit(lambda x: x + 1)(1.0); d = jax.config.jax_compilation_cache_dir;"
        " print(os.getppid(), d, jax.config.jax_persistent_cache_min_entry_size_bytes,"
        " len(os.listdir(d)) > 0)"
    )
    forked, fresh = (
        _run(
            server,
            name == "forked",
            "-c",
            code,
            env={
                "JAX_COMPILATION_CACHE_DIR": str(tmp_path / name),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            },
        )
        for name in ("forked", "fresh")
    )
    parent, *got = forked.stdout.split()
    assert int(parent) == server_pid, forked.stderr
    assert got == [str(tmp_path / "forked"), "-1", "True"]
    assert fresh.stdout.split()[1:] == [str(tmp_path / "fresh"), "-1", "True"]


def test_a_variable_named_python_alone_is_no_interpreter_variable(server):
    """`PYTHON` names the interpreter a script should run (scripts/gpu_check.sh reads it): the
    child is forked with it. PYTHONHASHSEED, which the interpreter reads, runs a fresh one."""
    _, server_pid, _ = server
    code = "import os; print(os.getppid(), os.environ['PYTHON'])"
    forked, fresh = _both(server, "-c", code, env={"PYTHON": "/x/python"})
    assert int(forked.stdout.split()[0]) == server_pid
    assert forked.stdout.split()[1] == fresh.stdout.split()[1] == "/x/python"
    seeded, _ = _both(server, "-c", code, env={"PYTHON": "/x/python", "PYTHONHASHSEED": "5"})
    assert int(seeded.stdout.split()[0]) != server_pid


def test_pythonpath_is_the_childs_unless_it_could_shadow_an_import(server, tmp_path):
    """A PYTHONPATH of the child's own (relative entries included) gives the path and imports a
    fresh interpreter has; one holding a package the server imported (numpy) or a sitecustomize
    runs a fresh one."""
    _, server_pid, _ = server
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe_mod.py").write_text("WHERE = __file__\n")
    code = "import os, sys, probe_mod; print(os.getppid(), sys.path, probe_mod.WHERE)"
    env = {"PYTHONPATH": os.pathsep.join(["lib", str(ROOT)])}
    forked, fresh = _both(server, "-c", code, env=env, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    parent, rest = forked.stdout.split(" ", 1)
    assert int(parent) == server_pid and rest == fresh.stdout.split(" ", 1)[1]
    (tmp_path / "shadow" / "numpy").mkdir(parents=True)
    shadowed, _ = _both(server, "-c", code, env={"PYTHONPATH": "lib:shadow"}, cwd=tmp_path)
    assert int(shadowed.stdout.split(" ", 1)[0]) != server_pid
    # a sitecustomize runs as a fresh interpreter starts, never in a forked child: refused
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("print('customized')\n")
    forked, fresh = _both(server, "-c", code, env={"PYTHONPATH": "lib:site"}, cwd=tmp_path)
    assert forked.stdout.startswith("customized\n") and fresh.stdout.startswith("customized\n")


# What a child's own `sys.executable` starts (scripts/launch.py's workers): forked too, unless the
# fork cannot reproduce it.
SPAWN = """
import os, subprocess, sys
print(os.getppid(), flush=True)
subprocess.run([sys.executable, *sys.argv[1:]], check=True)
"""
PARENT = "import os; print(os.getppid())"


def test_the_python_processes_a_child_starts_are_forked_too(server):
    _, server_pid, _ = server
    forked, fresh = _both(server, "-c", SPAWN, "-c", PARENT)
    assert fresh.returncode == 0, fresh.stderr
    child, grandchild = map(int, forked.stdout.split())
    assert child == grandchild == server_pid, forked.stderr
    assert server_pid not in map(int, fresh.stdout.split())


def test_unbuffered_by_the_environment_is_forked_and_unbuffered(server):
    """launch.py starts its workers with PYTHONUNBUFFERED=1: the child's stdout writes through, as
    a fresh one's does (`os._exit` flushes nothing; a buffered pipe would lose the line)."""
    _, server_pid, _ = server
    code = "import os, sys; print(os.getppid(), file=sys.stderr); print('out'); os._exit(0)"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONUNBUFFERED", raising=False)
        for value, out in (("1", "out\n"), (None, "")):  # forked either way, as the server's
            forked, fresh = _both(
                server, "-c", code, env={"PYTHONUNBUFFERED": value} if value else None
            )
            assert int(forked.stderr) == server_pid and int(fresh.stderr) != server_pid
            assert forked.stdout == fresh.stdout == out


def test_a_client_holding_another_descriptor_runs_fresh(server):
    """multiprocessing's spawn passes its pipes with `pass_fds`: only 0-2 reach a forked child, so
    the client runs the interpreter itself, which holds them."""
    _, server_pid, _ = server
    code = (
        "import os, subprocess, sys\n"
        "read, write = os.pipe()\n"
        "tell = f'import os; os.write({write}, str(os.getppid()).encode())'\n"
        "subprocess.run([sys.executable, '-c', tell], pass_fds=(write,), check=True)\n"
        "os.close(write)\n"
        "print(os.getppid(), os.read(read, 100).decode())\n"
    )
    forked, fresh = _both(server, "-c", code)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    child, grandchild = map(int, forked.stdout.split())
    assert child == server_pid and grandchild not in (server_pid, 0)


def test_a_client_in_another_network_namespace_runs_fresh(server):
    """`ip netns exec` / `unshare` (jaxdist/network/namespaces.py): a forked child would run in the
    server's network; the client runs the interpreter itself, in its own."""
    _, server_pid, _ = server
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("no permission to make a network namespace here")
    code = "import os, socket; print(os.getppid(), len(socket.if_nameindex()))"
    forked = _run(server, True, "-c", SPAWN, "-c", code)
    assert forked.returncode == 0, forked.stderr
    unshared = _run(server, True, "-c", code, prefix=("unshare", "--net", "--"))
    parent, interfaces = map(int, unshared.stdout.split())
    assert parent != server_pid and interfaces == 1, unshared.stderr  # its own: loopback only
    assert int(forked.stdout.split()[1]) == server_pid  # the same code, in ours: forked


@pytest.mark.parametrize("to_group", [False, True], ids=["to the client", "to its group"])
def test_a_signal_reaches_the_child_once_and_kill_9_of_the_client_ends_it(
    server, tmp_path, to_group
):
    shims, _, sock = server
    marker = tmp_path / "pid"
    code = (
        "import os, signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
        f"open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
        "while not got: time.sleep(0.01)\n"
        "time.sleep(0.5)\n"  # a second delivery would land here
        "print('TERM', len(got), flush=True); sys.exit(7)\n"
    )
    env = {**os.environ, prefork.SOCKET_ENV: str(sock)}
    for kill, status, out_want in ((signal.SIGTERM, 7, "TERM 1\n"), (signal.SIGKILL, -9, "")):
        marker.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [str(shims / "python"), "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.02)
        child = int(marker.read_text())
        assert child != proc.pid  # forked
        os.killpg(proc.pid, kill) if to_group else proc.send_signal(kill)
        out, _ = proc.communicate(timeout=30)
        assert (proc.returncode, out) == (status, out_want)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
            assert time.monotonic() < deadline, "the child outlived its killed client"
            time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return "Z"
