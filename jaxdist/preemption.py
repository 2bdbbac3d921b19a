"""Preemption: SIGTERM/SIGINT turned into a checkpointed stop at a step every process agrees on."""

from __future__ import annotations

import os
import signal

import jax

# Exit status of a run stopped by a preemption notice after its checkpoint: 128 + SIGTERM, what a
# process killed by SIGTERM reports, so SLURM (--requeue) and JobSet/Job restart policies see an
# unfinished run. `JAXDIST_PREEMPTED_EXIT_CODE` overrides it.
PREEMPTED_EXIT_CODE = 128 + int(signal.SIGTERM)
# Variables that say a scheduler runs this process (SLURM, a Kubernetes indexed Job or JobSet).
_SCHEDULER_VARS = ("SLURM_JOB_ID", "JOB_COMPLETION_INDEX", "JOBSET_NAME")


class Preempted(Exception):
    """Raised by `run` after the checkpoint of a stop asked for by SIGTERM/SIGINT is committed.

    Attributes:
      step: the step the run stopped at and saved.
      directory: the checkpoint folder.
      exit_code: what the process should exit with (`preempted_exit_code()`).
    """

    def __init__(self, step: int, directory: str, exit_code: int):
        super().__init__(f"preempted at step {step}: checkpoint saved in {directory}")
        self.step, self.directory, self.exit_code = step, directory, exit_code


def preempted_exit_code(env: dict[str, str] | None = None) -> int:
    """PREEMPTED_EXIT_CODE for a job a scheduler or launcher may restart, else 0.

    A job of several processes, or one under SLURM or Kubernetes, was preempted: it exits non-zero
    so that it is requeued. A lone process outside a scheduler was stopped by its user (Ctrl-C,
    `kill`): it exits 0. `JAXDIST_PREEMPTED_EXIT_CODE` sets the code in every case.
    """
    env = os.environ if env is None else env
    if env.get("JAXDIST_PREEMPTED_EXIT_CODE", "").strip():
        return int(env["JAXDIST_PREEMPTED_EXIT_CODE"])
    if jax.process_count() > 1 or any(v in env for v in _SCHEDULER_VARS):
        return PREEMPTED_EXIT_CODE
    return 0


class Preemption:
    """Turns SIGTERM/SIGINT into a stop at a step boundary that every process agrees on.

    One process: a Python handler sets a flag. Several: `jax.distributed.initialize` starts JAX's
    preemption service, whose C++ SIGTERM handler tells every process through the coordinator and
    makes `reached_preemption_sync_point` true at one common step. A Python SIGTERM handler would
    replace that handler (the service would never hear of the signal), so none is installed for
    SIGTERM; SIGINT (Ctrl-C) is passed on to it as a SIGTERM.
    """

    def __init__(self):
        self.signum: int | None = None
        self._old = {}
        self._multi = jax.process_count() > 1

    def install(self):
        if self._multi:
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._forward)
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        del frame
        self.signum = signum

    def _forward(self, signum, frame):
        del frame
        self.signum = signum
        os.kill(os.getpid(), signal.SIGTERM)

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)

    def stop_requested(self) -> bool:
        """One process: whether SIGTERM/SIGINT arrived. Several: False (JAX's service decides)."""
        return not self._multi and self.signum is not None
