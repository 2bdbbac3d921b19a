"""The test session's persistent compilation cache (tests/conftest.py) is on and serves programs.

The suite's speed relies on it: if a jax upgrade stopped honouring the environment variables that
turn it on, or stopped caching CPU programs, every repeat would silently compile again.
"""

from __future__ import annotations

import os
import uuid

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
