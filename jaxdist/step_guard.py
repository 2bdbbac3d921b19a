"""What a bad step does: each step judged once for a non-finite loss or gradient and for a loss
spike (`train.on_nonfinite`, `train.on_spike`): a stop, a skipped update, or a rollback to the fast
checkpoint tier; and the fault hook the spike tests feed noise through.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import checkpoint
from jaxdist.errors import NonFiniteError


class Rollback(Exception):
    """A loss spike at `step` under `train.on_spike=rollback`: return to the fast tier."""

    def __init__(self, step: int):
        super().__init__(f"loss spike at step {step}")
        self.step = step


class StepGuard:
    """Judges each step's finiteness once: stops (on_nonfinite=stop) or reports a skipped update."""

    def __init__(
        self,
        train_cfg,
        ckpt: checkpoint.Checkpointer,
        say: Callable[[str], None],
        start,
        record: Callable[[int, dict[str, Any]], None] = lambda step, rec: None,
    ):
        self.t, self.ckpt, self.say, self.record = train_cfg, ckpt, say, record
        self.through, self.in_a_row = start, 0  # last step judged; skips in a row
        self.rollbacks = 0  # train.on_spike=rollback: spikes rolled back in this run

    def check(self, m, at_step: int) -> None:
        if at_step <= self.through:
            return
        self.through = at_step
        if bool(m["finite"]):
            if "spike" in m and bool(m["spike"]):
                self._spike(m, at_step)
            else:
                self.in_a_row = 0
            return
        good = self.ckpt.latest_step()
        last_good = f"step {good} in {self.ckpt.directory}" if good is not None else "none"
        if self.t.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite loss or gradient at step {at_step}; last good checkpoint: "
                f"{last_good} (set train.on_nonfinite=skip to drop such updates)"
            )
        self.in_a_row += 1
        n = self.in_a_row
        self.say(
            f"step {at_step}: non-finite loss or gradient, update skipped ({n} in a row; "
            f"stopping at train.max_skipped={self.t.max_skipped})"
        )
        if n >= self.t.max_skipped:
            raise NonFiniteError(
                f"{n} non-finite steps in a row ({at_step - n + 1} to {at_step}), each update "
                f"skipped: stopped at train.max_skipped={self.t.max_skipped}; last good "
                f"checkpoint: {last_good} (lower train.learning_rate, or raise train.max_skipped)"
            )

    def _spike(self, m, at_step: int) -> None:
        """One line and a `spike` record; `train.max_skipped` spikes in a row stop the run."""
        self.in_a_row += 1
        rollback = self.t.on_spike == "rollback"
        self.rollbacks += rollback
        n = self.rollbacks if rollback else self.in_a_row
        loss, limit = float(m["loss"]), float(m["spike_threshold"])
        what = f"rolling back ({n} rollbacks" if rollback else f"update skipped ({n} in a row"
        self.say(
            f"step {at_step}: loss spike {loss:.4g} > {limit:.4g} (running mean + "
            f"{self.t.spike_k:g} running std), {what}; stopping at "
            f"train.max_skipped={self.t.max_skipped})"
        )
        self.record(
            at_step,
            {"kind": "spike", "loss": loss, "threshold": limit, "action": self.t.on_spike},
        )
        if rollback and n >= self.t.max_skipped:
            raise NonFiniteError(
                f"{n} loss spikes, each rolled back: stopped at train.max_skipped="
                f"{self.t.max_skipped} (lower train.learning_rate, raise train.spike_k or "
                "train.max_skipped)"
            )
        if rollback:
            raise Rollback(at_step)
        if n >= self.t.max_skipped:
            raise NonFiniteError(
                f"{n} loss spikes in a row ({at_step - n + 1} to {at_step}), each update "
                f"skipped: stopped at train.max_skipped={self.t.max_skipped} (lower "
                f"train.learning_rate, raise train.spike_k or train.max_skipped)"
            )


def fault_batch(batch: dict[str, Any], index: int, vocab_size: int) -> dict[str, Any]:
    """The fault hook of the spike tests: `JAXDIST_FAULT_NOISE_AT=7,9` makes batches 7 and 9 of
    the data order noise (0-based; step s trains on batch s - 1 unless a rollback skipped some):
    random token ids from the upper half of the vocabulary, bytes text rarely holds (inputs and
    targets); random normal inputs for a model that reads floats."""
    at = os.environ.get("JAXDIST_FAULT_NOISE_AT", "")
    if str(index) not in at.split(","):
        return batch
    rng = np.random.default_rng(index)
    out = dict(batch)
    for key, x in batch.items():
        if jnp.issubdtype(x.dtype, jnp.integer):
            noise = rng.integers(vocab_size // 2, vocab_size, size=x.shape).astype(x.dtype)
        else:
            noise = rng.standard_normal(x.shape).astype(x.dtype)
        out[key] = jax.make_array_from_callback(x.shape, x.sharding, lambda i, n=noise: n[i])
    return out
