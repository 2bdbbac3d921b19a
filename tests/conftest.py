"""Test setup: 8 simulated CPU devices, configured before any JAX backend starts.

The whole session, subprocesses included (they inherit the environment), shares one persistent
XLA compilation cache in a fresh temporary folder: many tests compile the same small programs, and
a fresh folder per session means no result is ever carried over from an earlier run.
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

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
