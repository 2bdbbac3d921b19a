"""Test setup: 8 simulated CPU devices, configured before any JAX backend starts.

The whole session, subprocesses included (they inherit the environment), shares one persistent
XLA compilation cache in a fresh temporary folder: many tests compile the same small programs, and
a fresh folder per session means no result is ever carried over from an earlier run.

XLA:CPU compiles at LLVM optimisation level 0 (`--xla_backend_optimization_level=0`): the suite's
programs are tiny and compile-bound, and the flag only changes machine-code generation after the
HLO passes, so sharding, collectives and buffer assignment are those of a default compile
(docs/PLANNER.md). It halves the suite's time. Every comparison in the suite is between programs
compiled the same way; subprocess runs inherit the flag unless a test sets its own environment.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the session makes it
    _cache = tempfile.mkdtemp(prefix="jaxdist-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
