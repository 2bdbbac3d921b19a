"""`runtime.gpu_xla_flags`: every flag is one this jaxlib knows, and the user's own XLA_FLAGS win."""

from __future__ import annotations

import os
import subprocess
import sys

from jaxdist import xla_flags

PROBE = "import jax.numpy as jnp; jnp.zeros(3).block_until_ready()"


def _start_backend(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)


def test_every_gpu_flag_is_known_to_the_installed_xla():
    # XLA parses all flags on every backend, so the CPU here rejects a GPU flag it does not know.
    ok = _start_backend(xla_flags.merged("", xla_flags.GPU_PERFORMANCE_FLAGS))
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _start_backend("--xla_gpu_no_such_flag_exists=true")
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr


def test_user_flags_win_and_apply_appends(monkeypatch):
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    out = xla_flags.merged(mine, xla_flags.GPU_PERFORMANCE_FLAGS).split()
    assert out[:2] == mine.split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in out
    assert len(out) == 2 + len(xla_flags.GPU_PERFORMANCE_FLAGS) - 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    xla_flags.apply(False)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    xla_flags.apply(True)
    assert os.environ["XLA_FLAGS"].startswith("--xla_dump_to=/tmp/x --xla_gpu_")
    assert os.environ["XLA_FLAGS"].count("--") == 1 + len(xla_flags.GPU_PERFORMANCE_FLAGS)
