"""Test setup: 8 simulated CPU devices, configured before any JAX backend starts.

The whole session, subprocesses included (they inherit the environment), shares one persistent
XLA compilation cache in a fresh temporary folder: many tests compile the same small programs, and
a fresh folder per session means no result is ever carried over from an earlier run.

XLA:CPU compiles at LLVM optimisation level 0 (`--xla_backend_optimization_level=0`): the suite's
programs are tiny and compile-bound, and the flag only changes machine-code generation after the
HLO passes, so sharding, collectives and buffer assignment are those of a default compile
(docs/PLANNER.md). It halves the suite's time.

With JAXDIST_TEST_FAST_CODEGEN=1 (the first half of README's test command) fusions are also
emitted by XLA:CPU's elemental IR emitter instead of its MLIR fusion emitters
(`--xla_cpu_use_fusion_emitters=false`, where this XLA has the flag): a train step compiles 2.5x
faster (5.7 -> 2.2 CPU s for the MoE step of tests/test_compose_context_expert.py) and the suite
in half the time. It changes the code of elementwise fusions, so a program can differ from a
default compile in the last bits (a float32 ulp in the tiny GPT's parameters after 3 steps) and
in temp bytes by a few hundred (0.01%), and two different programs that compute the same sums
(the all-reduce algorithms against XLA's, one process against two) no longer agree to the bit.
The tests that compare programs to the bit are marked `bitwise` and refuse the flag (the second
half of the command runs them without it). Every other comparison in the suite is between
programs compiled the same way at a fixed tolerance; subprocess runs inherit the flags unless a
test sets its own environment.
"""

import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session makes it
    _cache = tempfile.mkdtemp(prefix="jaxdist-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _add_xla_flag(flag: str, probe: bool = False) -> None:
    """Appends `flag` to XLA_FLAGS unless already there; with `probe`, only if a child process's
    CPU backend starts with it (XLA aborts on a flag it does not know, and flags come and go
    between versions)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] in flags:
        return
    if probe:
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        run = [sys.executable, "-c", "import jax; jax.devices()"]
        if subprocess.run(run, env=env, capture_output=True).returncode != 0:
            return
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


FAST_CODEGEN = os.environ.get("JAXDIST_TEST_FAST_CODEGEN") == "1"
_add_xla_flag("--xla_backend_optimization_level=0")
if FAST_CODEGEN:
    _add_xla_flag(_FUSION_EMITTERS, probe=True)  # the first process of the session probes once

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    bitwise = [item.nodeid for item in items if item.get_closest_marker("bitwise")]
    if FAST_CODEGEN and bitwise:
        raise pytest.UsageError(
            f"{len(bitwise)} bitwise tests (e.g. {bitwise[0]}) need XLA:CPU's default fusion "
            "emitters: run them without JAXDIST_TEST_FAST_CODEGEN=1, or deselect them with "
            "-m 'not bitwise'"
        )


# JAXDIST_TEST_CPU_LOG=FILE: one JSON line per test phase with the CPU seconds it cost (this
# process and the subprocesses it waited for), a measure of the suite's cost that a busy machine
# does not inflate as it does wall time. For planning where the suite's time goes; off by default.
_CPU_LOG = os.environ.get("JAXDIST_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if _CPU_LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a") as f:
            record = {
                "test": item.nodeid,
                "cpu_s": round(_cpu_seconds() - cpu, 3),
                "wall_s": round(time.perf_counter() - wall, 3),
            }
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(session):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a") as f:
            record = {"test": "<collection>", "cpu_s": round(_cpu_seconds() - cpu, 3)}
            f.write(json.dumps({**record, "wall_s": round(time.perf_counter() - wall, 3)}) + "\n")
