"""grad_sync.staleness = tau: step t applies the reduced gradient of step t - tau; it resumes exactly."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist import checkpoint
from tests.helpers import engine_for, tiny_gpt_config

pytestmark = pytest.mark.bitwise  # compares compiled programs to the bit (tests/conftest.py)


def _cfg(tau: int, algorithm: str = "xla"):
    c = tiny_gpt_config(data=4, fsdp=2)
    c.grad_sync.staleness, c.grad_sync.algorithm = tau, algorithm
    c.train.warmup_steps = 0  # the first update moves the parameters (warm-up starts at lr 0)
    return c


def _run(c, steps: int, state=None, start: int = 0):
    eng, batches = engine_for(c)
    state = eng.init() if state is None else state
    for i in range(start, start + steps):
        state, _ = eng.train_step(state, batches.get(i))
    return eng, state


def _close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["xla", "ring"])
def test_step_t_applies_the_gradient_of_step_t_minus_tau(algorithm):
    """tau = 2: steps 1-2 only fill the queue (parameters and optimizer held); step 3 applies the
    gradient of step 0 (taken at the initial parameters on batch 0), exactly as a synchronous
    run's first step does."""
    _, sync1 = _run(_cfg(0, algorithm), 1)
    _, held = _run(_cfg(2, algorithm), 2)
    eng, stale3 = _run(_cfg(2, algorithm), 3)
    init = jax.device_get(eng.init()["params"])
    _close(held["params"], init, rtol=0)  # nothing applied while the queue fills
    _close(stale3["params"], sync1["params"], rtol=1e-6)
    moved = [
        np.abs(np.asarray(x) - y).max()
        for x, y in zip(*map(jax.tree.leaves, (stale3["params"], init)))
    ]
    assert min(moved) > 1e-4  # every tensor moved: the comparison above is not vacuous


def test_in_flight_gradients_are_checkpointed_and_resume_bit_exact(tmp_path):
    c = _cfg(2)
    _, straight = _run(c, 5)
    eng, half = _run(c, 3)
    with checkpoint.Checkpointer(tmp_path / "ckpt", every=1, keep=1, config_json="{}") as ckpt:
        ckpt.save(3, half, data_position=3)
        ckpt.wait()
        restored, _ = ckpt.restore(eng.abstract_state)
    assert "in_flight" in restored
    _, resumed = _run(c, 2, state=restored, start=3)
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layout_record_counts_the_in_flight_gradients():
    from jaxdist import loop
    from tests.helpers import compile_step

    c = _cfg(2)
    eng, compiled = compile_step(c)
    b = loop.layout_record(eng, compiled, c)["bytes_per_device"]
    assert b["in_flight_state"] == 2 * b["params"]  # tau gradients, sharded like the params
