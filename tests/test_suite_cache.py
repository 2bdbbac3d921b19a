"""The test session's caches (tests/conftest.py): XLA programs, and the repository's bytecode.

The suite's speed relies on them: if a jax upgrade stopped honouring the environment variables that
turn the compilation cache on, or stopped caching CPU programs, every repeat would silently compile
again; without the session's .pyc files, each of its processes compiles jaxdist from source where
PYTHONDONTWRITEBYTECODE is set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp


def test_session_cache_is_on_for_every_program_and_shared_with_subprocesses():
    assert jax.config.jax_enable_compilation_cache
    assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == 0  # subprocesses


def test_a_program_compiled_again_is_loaded_from_the_session_cache():
    salt = uuid.uuid4().int % 1_000_003  # a program no earlier test or run has written
    events: list[str] = []

    def listener(name: str, **_) -> None:
        events.append(name.rsplit("/", 1)[-1])

    def fn(x):
        return jnp.tanh(x) * salt + 1.0

    x = jnp.arange(8.0)
    jax.monitoring.register_event_listener(listener)
    try:
        results = []
        for want in ("cache_misses", "cache_hits"):  # compiled and written, then loaded
            jax.clear_caches()
            events.clear()
            results.append(jax.jit(fn).lower(x).compile()(x))
            assert want in events, (want, events)
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert jnp.array_equal(results[0], results[1])


# Counts the modules a fresh interpreter compiles from source (importlib calls `source_to_code`
# only where no valid .pyc is found) while running `imports`, with bytecode writing off as on these
# machines: those whose path holds one of `where`.
_COUNT_SOURCE_COMPILES = """
import importlib._bootstrap_external as ext, sys
compiled = []
plain = ext.SourceLoader.source_to_code
def source_to_code(self, data, path, **kw):
    compiled.append(path)
    return plain(self, data, path, **kw)
ext.SourceLoader.source_to_code = source_to_code
sys.path.insert(0, ".")
{imports}
print(compiled[:3])
print(len([p for p in compiled if any(w in p for w in {where!r})]))
"""


def _compiled_from_source(imports: str, where: tuple[str, ...]) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_SOURCE_COMPILES.format(imports=imports, where=where)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]), proc.stdout


def test_a_process_reads_the_sessions_bytecode_for_the_repository():
    """What scripts/train.py imports of jaxdist, models and scripts: none compiled from source."""
    imports = "import jaxdist.loop, jaxdist.train, jaxdist.config_files, scripts.train"
    count, out = _compiled_from_source(imports, ("/jaxdist/", "/models/", "/scripts/"))
    assert count == 0, out


def test_installed_packages_the_session_imported_have_bytecode():
    """The README installs with `pip install --no-compile`; the session writes the bytecode of what
    it imports (tests/conftest.py), so a later process, even one told not to write any, compiles
    none of jax, flax, optax, orbax or numpy from source."""
    assert not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ
    count, out = _compiled_from_source(
        "import jax, flax.nnx, optax, orbax.checkpoint, numpy", ("-packages/",)
    )
    assert count == 0, out
