"""Test setup: 8 simulated CPU devices, configured before any JAX backend starts.

The whole session, subprocesses included (they inherit the environment), shares one persistent
XLA compilation cache in a fresh temporary folder, so no result is ever carried over from an
earlier run. Every program is written to it, however quickly it compiled: most of the suite's
repeats are small ones (orbax's per-array slices, casts, RNG seeds) in the many short
`scripts/*.py` processes, each under the 0.2 s minimum this used to have; with no minimum,
tests/test_bad_input.py + tests/test_script.py load 229 of their 452 programs from the cache
instead of 5, and spend 43.8 instead of 52.0 s compiling (jax's DEBUG log of `jax._src.compiler`
and `jax._src.dispatch` counted over `pytest -p no:xdist -m 'not bitwise'` on those two files,
with `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2` and without; the variable overrides the
value set here). A loaded program is the same machine
code (tests/test_pipeline.py checks one to the bit) with the same HLO text and memory analysis.
XLA_FLAGS are part of the cache key, so a run with other code-generation flags never shares an
entry (and each session has its own folder anyway). Two processes may write the same entry at
once (jax writes in place, unlocked, each entry in one `write`): a process that reads a
half-written entry warns and compiles afresh (an entry is a zstd frame that states its length, a
checksummed zlib stream where zstandard is missing: a cut one does not decompress), and an entry
one writer wrote over another's longer one still starts with one whole frame, which is all that is
read (two processes serialize the same program to different bytes, 687,172 and 687,156 for one
train step), so a race costs time, never a wrong program. zstd (the test extra) compresses a train
step's executable in 2 ms where zlib takes 18.

XLA:CPU compiles at LLVM optimisation level 0 (`--xla_backend_optimization_level=0`): the suite's
programs are tiny and compile-bound, and the flag only changes machine-code generation after the
HLO passes, so sharding, collectives and buffer assignment are those of a default compile
(docs/PLANNER.md). It halves the suite's time. It also emits the LLVM module in one piece
(`--xla_cpu_parallel_codegen_split_count=1`): XLA:CPU otherwise splits it to compile the parts on
its thread pool, which saves wall time on an idle many-core machine but costs CPU here, where both
cores are busy with the two workers; with the default fusion emitters the results do not change
(every `bitwise` test passes either way), with the elemental one below they do. Measured with
`farm-bench -n 3 --vs` (the same pytest command with and without the
flag, pair by pair, CPU seconds of the whole process), 2026-11-27: 0.889 of the CPU time on two MoE
tests of tests/test_compose_context_expert.py (60.4 -> 54.1 s), 0.978 on three pipeline MoE tests
of tests/test_pipeline_context_expert.py with tests/test_script.py's bad-input runs, and 0.994
(no change) on the bitwise tests of tests/test_gpt.py and tests/test_staleness.py.

With JAXDIST_TEST_FAST_CODEGEN=1 (README's test command) fusions are also emitted by XLA:CPU's
elemental IR emitter instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`,
where this XLA has the flag): a train step compiles 2.5x faster (5.7 -> 2.2 CPU s for the MoE step
of tests/test_compose_context_expert.py) and the suite in half the time. It changes the code of
elementwise fusions, so a program can differ from a default compile in the last bits (a float32
ulp in the tiny GPT's parameters after 3 steps) and in temp bytes by a few hundred (0.01%).
The tests marked `bitwise` compare two different programs that compute the same sums to the bit
(the all-reduce algorithms against XLA's, one process against two, a recomputed GELU against a
stored one). They hold under the elemental emitter only with the LLVM module in one piece: with
`--xla_cpu_parallel_codegen_split_count=32`, 16 of the 77 in tests/test_allreduce.py,
test_staleness.py and test_gpt.py fail by an ulp (ring against XLA's all-reduce: 5.8e-11 in a
gradient of 1.5e-4); with 1, all 113 pass, as they do under the default emitters (2026-11-28,
jax 0.10.2). So the elemental emitter is used only where the split flag is (the probe below),
and the bitwise tests refuse it otherwise. They ran as a second pytest command
with the default emitters before: 290 s of wall time on two workers, now 152 s in the same run as
the others. Every other comparison in the suite is between programs compiled the same way at a
fixed tolerance; subprocess runs inherit the flags unless a test sets its own environment
(tests/helpers.suite_xla_flags keeps these).
"""

import atexit
import compileall
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# numpy's OpenBLAS starts a thread per core and, after a call, spins them waiting for the next; with
# two workers on two cores that spinning takes CPU from the other worker. The suite's numpy
# references are small: one thread. 0.987 of the CPU time over tests/test_moe.py and
# tests/test_context.py (farm-bench -n 2 --vs, 2026-11-28); subprocesses inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Bytecode: the suite starts ~1,000 Python processes, and each imports jaxdist, models and a script.
# Where PYTHONDONTWRITEBYTECODE is set (these machines set it), an editable install's modules get
# no .pyc, so every process compiled them from source again: 0.11 CPU s for what
# `scripts/train.py` imports (0.155 -> 0.045 s). The first process of the session compiles the
# repository's Python files once into their __pycache__ folders (ignored by git), which every
# process reads whatever its environment; a stale .pyc is never used (its source's size and
# modification time are in it); where it cannot write, processes compile as before.
# Installed packages: the README's test command installs with `pip install --no-compile`, since
# pip compiles all of the 18,600 files the extras bring, one at a time (35 of its 88 s here), and
# the suite imports 3,600 of them. The session writes bytecode whatever PYTHONDONTWRITEBYTECODE
# says (its processes inherit that), so the first process to import a module writes its .pyc
# (atomically: a temporary file renamed) and every later one reads it. Importing jax, flax, optax,
# orbax, transformers, torch and lm_eval took 20.1 s without their bytecode, 6.1 s with it; the
# two workers' collections, which import them at once, went from 10.8 to 19.6 CPU s (CI,
# 2026-12-06), where pip's compiling took 35 s of the install's wall time.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session
    for _folder in ("jaxdist", "models", "scripts", "configs", "tests"):
        compileall.compile_dir(Path(__file__).resolve().parents[1] / _folder, quiet=2)
    # The session's XLA compilation cache (the docstring above); subprocesses inherit the variable.
    _cache = tempfile.mkdtemp(prefix="jaxdist-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# MLIR locations carry the op's own source line, not the Python traceback to it: the compiler
# re-imports every location when Shardy partitions (hlo -> stablehlo -> hlo), and the suite reads no
# traceback from an HLO. 0.982 of the CPU time (farm-bench -n 3 --vs, 2026-11-27) on two MoE
# tests of tests/test_compose_context_expert.py, two pipeline MoE tests and tests/test_script.py's
# bad-input runs together.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
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
_ONE_PIECE = "--xla_cpu_parallel_codegen_split_count=1"
_add_xla_flag("--xla_backend_optimization_level=0")
# XLA re-checks the whole module after every pass of each pass pipeline (HloVerifier, the pipelines'
# invariant checker): a check of XLA's own passes that changes nothing in the program they produce.
# The suite skips it. A context=2 x data=4 int8 train step spent 172-191 ms of its 1.77-1.86 s
# compile in those checks (jax.profiler's trace of XLA's passes, event RunInvariantCheckers: 80
# runs, then none); tests/test_compose_context_expert.py's 8 compressor tests took 0.931 of the
# CPU time (0.899-0.960; farm-bench -n 3 --vs with and without the flag, 2026-12-06). The whole
# suite's compile time in its two workers went from 538 to 520 s (JAXDIST_TEST_CPU_LOG, one run
# each). Three train steps (int8 on context=2 x data=4, bf16 on expert=2 x data=4, data x fsdp x
# tensor) compiled to the same optimized HLO text and memory analysis with and without it.
_add_xla_flag("--xla_disable_hlo_passes=hlo-verifier")
_add_xla_flag(_ONE_PIECE, probe=True)
if FAST_CODEGEN and _ONE_PIECE in os.environ.get("XLA_FLAGS", "").split():
    _add_xla_flag(_FUSION_EMITTERS, probe=True)  # the first process of the session probes once

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    bitwise = [item.nodeid for item in items if item.get_closest_marker("bitwise")]
    flags = os.environ.get("XLA_FLAGS", "").split()
    if bitwise and _FUSION_EMITTERS in flags and _ONE_PIECE not in flags:
        raise pytest.UsageError(
            f"{len(bitwise)} bitwise tests (e.g. {bitwise[0]}) need XLA:CPU's default fusion "
            f"emitters, or the elemental one with {_ONE_PIECE}: add it to XLA_FLAGS, or "
            "deselect them with -m 'not bitwise'"
        )
    _costliest_files_first(items)


# With `--dist loadfile` a file runs whole on one worker, and xdist by default hands the files out
# by their number of tests, most first: a file of a few long tests (several training processes
# each) then starts among the last, and the other worker idles until it ends. The files below,
# measured the longest for their number of tests, start first, longest first; every other file
# follows in xdist's order. A file missing here is only scheduled later, never skipped. Figures:
# `nice -n 10 pytest -n 0 -m 'not bitwise' FILE` with JAXDIST_TEST_FAST_CODEGEN=1 on the shared
# 2-core machine, 2026-11-26: tests, wall s, CPU s (this process and its subprocesses).
COSTLIEST_FILES_FIRST = (
    "test_docs_commands.py",  # 116, 72 commands in subprocesses (31 of them: 412 CPU s)
    "test_bench.py",  # 4, 296 s, 118 s
    "test_resume.py",  # 6, 199 s, 117 s
    "test_faults.py",  # 7, 170 s, 110 s
    "test_optim_resume.py",  # 3, 122 s, 66 s
    "test_fast_tier.py",  # 5, 116 s, 118 s
    "test_reshard.py",  # 2, 107 s, 53 s
    "test_sample.py",  # 3, 83 s, 36 s
    "test_multihost.py",  # 6, 76 s, 97 s
    "test_mixtral.py",  # 7, 59 s, 59 s
    "test_allreduce_multihost.py",  # 33, 59 s, 107 s (2026-11-28, bitwise tests included)
    "test_bench_data.py",  # 6, 52 s, 51 s
    "test_lm_eval.py",  # 5, 47 s, 42 s
    "test_network_fault.py",  # 6, 39 s, 25 s (2026-11-28, bitwise tests included)
    "test_eval_script.py",  # 1, 35 s, 20 s
)


# Python's cyclic garbage collector in a test process: tracing and lowering allocate millions of
# small objects, and each collection walks every live one, the imported modules and collected
# tests included. After collection, those are frozen out of the walk and a collection starts every
# 20,000 net allocations instead of 700: measured with a `gc.callbacks` probe on the compressor
# tests of tests/test_compose_context_expert.py, the collector's CPU went from 2.42 s (1,913
# young collections) to 0.53 s (39) of ~50, and `farm-bench -n 3 --vs` over the same tests gave
# 0.955 of the CPU time (49.1 against 51.5 s, 2026-11-28) at the same peak memory (550 MiB).
# Cycles are still collected, later; nothing a test checks depends on when.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    if not session.config.option.collectonly and os.environ.get("JAXDIST_TEST_NO_PREFORK") != "1":
        _start_prefork_server()


# The scripts the tests start (tests/helpers.python(), the docs commands' `python`) are forked
# from a server that has imported jax, flax, optax, orbax and numpy once (tests/prefork.py says
# what a forked child reproduces of a fresh `python ARGS` and when it falls back to one;
# tests/test_prefork.py compares the two): a fresh interpreter spends ~1.2 CPU s on those imports
# before it reads its first flag, a forked one ~0.02. One server per test process, started once
# the tests are collected; a script started before it is ready runs the plain interpreter.
# JAXDIST_TEST_NO_PREFORK=1 turns it off. Forked children are the server's, not the test's:
# JAXDIST_TEST_CPU_LOG does not count their CPU; JAXDIST_TEST_PREFORK_LOG=FILE has each server
# write a JSON line per child it forked (CPU seconds, arguments, the test that started it) and
# per request it refused (why).
def _start_prefork_server() -> None:
    from tests import prefork

    folder = tempfile.mkdtemp(prefix="jaxdist-prefork-")
    server, sock, python = prefork.start(folder)
    os.environ[prefork.SOCKET_ENV] = sock
    os.environ[prefork.PYTHON_ENV] = python

    def stop() -> None:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False  # xdist keeps the order of the collected items


def _costliest_files_first(items) -> None:
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    first = {name: rank for rank, name in enumerate(COSTLIEST_FILES_FIRST)}
    # Stable: each file's tests keep their order; the rest by number of tests, as xdist would.
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -count[item.path.name]))


# JAXDIST_TEST_CPU_LOG=FILE: one JSON line per test phase with the CPU seconds it cost (this
# process and the subprocesses it waited for), a measure of the suite's cost that a busy machine
# does not inflate as it does wall time. For planning where the suite's time goes; off by default.
# Each record also names its xdist worker and the time it ended: with `wall_s`, each worker's
# timeline (which files it ran when, and whether one worker idled while the other finished).
_CPU_LOG = os.environ.get("JAXDIST_TEST_CPU_LOG")
# With it, each record also counts what the phase asked of jax in this process (not in its
# subprocesses): programs compiled (persistent-cache misses: the suite's cache is fresh, so each is
# a program no earlier phase of the session compiled), programs loaded from the cache (compiled
# earlier, traced and lowered again), and functions traced. With `cpu_s` they say what a test's
# programs cost: a train step over 8 devices ~1.3-1.8 CPU s to trace, lower and compile, an eager
# op's program a few ms (CI of 2026-12-06: tests/test_compose_context_expert.py 63 programs in
# 80 CPU s, tests/test_moe.py 177 in 24 s).
_JAX_EVENTS = {
    "/jax/compilation_cache/cache_misses": "programs_compiled",
    "/jax/compilation_cache/cache_hits": "programs_from_cache",
}
# And the wall seconds jax spent tracing, lowering to MLIR and compiling (a cache hit's load counts
# as compiling).
_JAX_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_jax_counts: dict[str, float] = {}


def _cpu_seconds() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if _CPU_LOG:

    def _count_event(event: str, **_) -> None:
        if event in _JAX_EVENTS:
            _jax_counts[_JAX_EVENTS[event]] = _jax_counts.get(_JAX_EVENTS[event], 0) + 1

    def _count_duration(event: str, secs: float, **__) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            _jax_counts["functions_traced"] = _jax_counts.get("functions_traced", 0) + 1
        if event in _JAX_DURATIONS:
            key = _JAX_DURATIONS[event]
            _jax_counts[key] = _jax_counts.get(key, 0) + secs

    jax.monitoring.register_event_listener(_count_event)
    jax.monitoring.register_event_duration_secs_listener(_count_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        _jax_counts.clear()
        yield
        with open(_CPU_LOG, "a") as f:
            record = {
                "test": item.nodeid,
                "cpu_s": round(_cpu_seconds() - cpu, 3),
                "wall_s": round(time.perf_counter() - wall, 3),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                "end": round(time.time(), 1),
                **{k: _jax_counts.get(k, 0) for k in (*_JAX_EVENTS.values(), "functions_traced")},
                **{k: round(_jax_counts.get(k, 0), 3) for k in _JAX_DURATIONS.values()},
            }
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(session):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a") as f:
            record = {"test": "<collection>", "cpu_s": round(_cpu_seconds() - cpu, 3)}
            f.write(json.dumps({**record, "wall_s": round(time.perf_counter() - wall, 3)}) + "\n")
