"""The training loop: linear and short. Logging, evaluation, checkpoints and profiling on a cadence.

`run(config, workdir)` validates the config, builds the mesh and the Engine, restores the newest
checkpoint under `workdir/checkpoints` if there is one, compiles the step once (ahead of time, so the
`layout` record describes the exact program that runs), and trains.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import checkpoint, data, distributed, metrics, train, weights
from jaxdist import config as config_lib
from jaxdist import mesh as mesh_lib
from jaxdist.errors import ConfigError

log = logging.getLogger("jaxdist")


def layout_record(engine: train.Engine, compiled, config) -> dict[str, Any]:
    """What the compiled step costs per device: memory (memory_analysis) and collective bytes (HLO)."""
    st = engine.abstract_state
    mem = compiled.memory_analysis()
    local_steps = config.grad_sync.local_steps if "local" in st else 1
    shard_bytes = lambda tree: sum(
        int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )
    record: dict[str, Any] = {
        "mesh": mesh_lib.mesh_shape(engine.mesh),
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "processes": jax.process_count(),
        "model": config.model.name,
        "params_total": engine.num_params,
        "bytes_per_device": {
            "params": shard_bytes(st["params"]),
            "opt_state": shard_bytes(st["opt_state"]),
            "temp": int(mem.temp_size_in_bytes) if mem is not None else None,
            "arguments": int(mem.argument_size_in_bytes) if mem is not None else None,
            "outputs": int(mem.output_size_in_bytes) if mem is not None else None,
            "aliased": int(mem.alias_size_in_bytes) if mem is not None else None,
        },
        # Local SGD averages inside a conditional taken every H-th step: bytes are per step on average.
        "collective_bytes_per_step": metrics.collective_bytes(
            compiled.as_text(), conditional_period=local_steps
        ),
        "global_batch": config.train.batch_size,
        "grad_accum": config.train.grad_accum,
        "compute_dtype": config.train.compute_dtype,
        "remat": config.train.remat,
    }
    for key in ("grad_sync", "local"):  # per-replica compressor / local SGD state
        if key in st:
            record["bytes_per_device"][f"{key}_state"] = shard_bytes(st[key])
    if "grad_sync" in st:  # what compression saves against an f32 ring all-reduce of the grads
        r = engine.mesh.shape["data"]
        f32 = shard_bytes(jax.tree.map(lambda x: x.update(dtype=jnp.float32), st["params"]))
        dense = 2 * (r - 1) / r * f32
        sent = sum(record["collective_bytes_per_step"].values())
        record["grad_sync"] = {
            "compression": config.grad_sync.compression,
            "f32_all_reduce_bytes_per_step": dense,
            "bytes_saved_per_step": dense - sent,
        }
    if local_steps > 1:
        record["local_steps"] = local_steps
    if engine.schedule is not None:
        record["pipeline"] = engine.schedule.describe()
        record["bubble_fraction"] = engine.schedule.bubble_fraction
    family = engine.family
    if family.tokens_per_example is not None:
        tokens = family.tokens_per_example(config.model)
        record["tokens_per_step"] = config.train.batch_size * tokens
    if family.flops_per_token is not None:
        record["flops_per_token"] = family.flops_per_token(config.model, st["params"])
    if config.model.name == "gpt" and local_steps == 1:
        # The planner models one optimizer state per parameter shard; local SGD keeps an outer
        # state plus a copy of the model and optimizer per replica, which it does not model.
        from jaxdist import plan

        predicted = plan.predict(config, num_devices=engine.mesh.size).memory
        record["predicted_bytes_per_device"] = {
            k: int(predicted[k]) for k in ("params", "opt_state", "temp")
        }
    return record


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def summary(record: dict[str, Any]) -> str:
    mesh = " × ".join(f"{k}={v}" for k, v in record["mesh"].items())
    b = record["bytes_per_device"]
    coll = record["collective_bytes_per_step"]
    wire = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in coll.items()) or "none"
    lines = [
        f"jaxdist │ {record['model']} │ {record['params_total']:,} parameters │ "
        f"{record['devices']} × {record['device_kind']} in {record['processes']} process(es)",
        f"mesh    │ {mesh}",
        f"memory  │ per device: params {_fmt_bytes(b['params'])}, optimizer {_fmt_bytes(b['opt_state'])}, "
        f"temp {_fmt_bytes(b['temp'])}",
        f"wire    │ per device per step: {wire} (total {_fmt_bytes(sum(coll.values()))})",
    ]
    extra = {"grad_sync_state": "compressor state", "local_state": "local SGD replica state"}
    for key, what in extra.items():
        if key in b:
            lines[2] += f", {what} {_fmt_bytes(b[key])}"
    if "local_steps" in record:
        lines[3] += f"; parameters averaged every {record['local_steps']} steps"
    if "predicted_bytes_per_device" in record:
        p = record["predicted_bytes_per_device"]
        lines.append(
            f"planner │ predicted params {_fmt_bytes(p['params'])}, optimizer {_fmt_bytes(p['opt_state'])}, "
            f"temp {_fmt_bytes(p['temp'])} (jaxdist/plan.py)"
        )
    if "bubble_fraction" in record:
        lines.append(f"pipeline│ bubble fraction {record['bubble_fraction']:.3f}")
    return "\n".join(lines)


def _fmt_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: an ETA at the precision a reader needs."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt_rate(per_s: float, unit: str) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{suffix} {unit}/s"
    return f"{per_s:.3g} {unit}/s"


def step_line(step: int, total: int, m: dict[str, float], eta_s: float | None) -> str:
    """The periodic log line, as nanoGPT and torchtitan print theirs.

    `step     20/300 │ loss 4.5491 │ lr 2.25e-03 │ 412.3 ms/step │ 1.24k tok/s │ MFU 41.2% │ ETA 1m55s`
    (MFU only where the device's peak is known; eval figures when the step evaluated).
    """
    parts = [f"step {step:6d}/{total}", f"loss {m['loss']:.4f}"]
    if "learning_rate" in m:
        parts.append(f"lr {m['learning_rate']:.2e}")
    if "step_time_s" in m:
        parts.append(f"{m['step_time_s'] * 1e3:.1f} ms/step")
    if "tokens_per_s" in m:
        parts.append(_fmt_rate(m["tokens_per_s"], "tok"))
    elif "examples_per_s" in m:
        parts.append(_fmt_rate(m["examples_per_s"], "ex"))
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if eta_s is not None and step < total:
        parts.append(f"ETA {_fmt_duration(eta_s)}")
    parts += eval_parts(m)
    return " │ ".join(parts)


def eval_parts(m: dict[str, float]) -> list[str]:
    """`eval loss 4.4241`, `eval accuracy 0.913`: every eval_* figure of a record."""
    return [
        f"eval {k.removeprefix('eval_')} {v:.4f}" for k, v in m.items() if k.startswith("eval_")
    ]


def _terminal_width() -> int:
    """Columns of the terminal stdout is, 0 for none (a pipe, a file, CI, a size-less pty)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError, AttributeError):
        return 0


def outputs_lines(workdir: str, ckpt_dir: str, steps: list[int]) -> list[str]:
    """Where a run's outputs are, and the commands that read them; printed last."""
    saved = f" (steps {', '.join(map(str, steps[-3:]))})" if steps else " (none saved)"
    lines = [
        f"outputs │ {workdir}",
        f"        │ checkpoints  {ckpt_dir}{saved}",
        f"        │ metrics      {os.path.join(workdir, 'metrics.jsonl')} (TensorBoard: "
        f"tensorboard --logdir {workdir})",
        f"        │ plot         python scripts/plot.py {workdir}",
    ]
    if steps:
        lines.append(f"        │ verify       python scripts/ckpt.py verify {ckpt_dir}")
    return lines


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


class _Preemption:
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

    def requested(self, step: int) -> bool:
        """True on every process at the same step once a stop was asked for."""
        if not self._multi:
            return self.signum is not None
        return distributed.reached_preemption_point(step)


# What a resume must keep, and why. Everything else may change: the learning rate and the other
# optimizer hyperparameters, train.steps (the schedule is recomputed, and said), the mesh.
RESUME_MUST_MATCH = {
    "model": "the saved weights have its shapes",
    "train.optimizer": "the saved optimizer state is that optimizer's",
    "train.batch_size": "the saved data position counts batches of that size",
    "train.seed": "the saved data position is in that seed's order",
    "data": "the saved data position indexes that data",
}


def check_workdir(workdir: str) -> str:
    """The absolute workdir; ConfigError if it is empty, a file, or in a folder that is read-only.

    Nothing is created: a new workdir is made only once the run is known to be able to start.
    """
    if not str(workdir).strip():
        raise ConfigError("--workdir is empty; name the run's folder, e.g. --workdir=runs/NAME")
    path = os.path.abspath(workdir)  # orbax requires absolute checkpoint paths
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"--workdir={workdir} is an existing file; name a folder (a new one, or an earlier run's)"
        )
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"--workdir={workdir}: {existing} is a file, so no folder can be made there"
        )
    try:  # os.access says yes to root on a read-only mount; a real write does not
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(
            f"--workdir={workdir}: cannot write in {existing} ({err.strerror}); "
            "choose a writable folder"
        ) from None
    return path


def _schedule_change_note(saved_train: dict[str, Any], train_cfg, step: int) -> str | None:
    """One line saying the LR schedule is recomputed when a resume changes `train.steps`."""
    if saved_train.get("steps", train_cfg.steps) == train_cfg.steps:
        return None
    from ml_collections import ConfigDict

    from jaxdist import optim

    before = ConfigDict({**train_cfg.to_dict(), **saved_train})
    lr_then = float(optim.schedule(before)(step))
    lr_now = float(optim.schedule(train_cfg)(step))
    return (
        f"train.steps changed from {before.steps} to {train_cfg.steps}: the learning-rate "
        f"schedule is recomputed for {train_cfg.steps} steps (at step {step}: "
        f"{lr_now:.3g}, was {lr_then:.3g})"
    )


def run(config, workdir: str) -> dict[str, float]:
    """Trains per `config`, writing metrics, config and checkpoints under `workdir`.

    Returns the last logged metrics (and the final evaluation loss under "eval_loss"); an empty
    dict when the checkpoint in `workdir` already reached `train.steps` (nothing is run).

    Raises:
      Preempted: SIGTERM or SIGINT stopped the run; its checkpoint is committed.
    """
    workdir = check_workdir(workdir)
    init_from = weights.apply_init_from(config)  # the source's model fields, before validation
    num_devices = jax.device_count()
    config_lib.validate(config, num_devices)
    mesh_lib.check_backend(config)
    from jaxdist import plan

    plan.refuse_if_far_over_memory(config, num_devices)
    main = jax.process_index() == 0
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    if main:
        for warning in ds.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    mesh = mesh_lib.make_mesh(config.mesh)
    engine = train.build(config, mesh, ds)
    t = config.train
    batches = data.Batches(
        ds,
        batch_size=t.batch_size,
        seq_len=config.model.seq_len,
        seed=t.seed,
        shardings=engine.batch_shardings,
    )
    shapes = batches.global_shapes()
    dtypes = {"inputs": jnp.int32 if ds.kind == "tokens" else jnp.float32, "targets": jnp.int32}
    abstract_batch = engine.abstract_batch(shapes, dtypes)

    os.makedirs(workdir, exist_ok=True)
    cfg_json = config_lib.to_json_dict(config)
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        every=config.checkpoint.every,
        keep=config.checkpoint.keep,
        config_json=cfg_json,
    )
    start = 0
    if ckpt.latest_step() is not None:
        saved = ckpt.saved_config()
        checkpoint.check_config_compatible(
            saved, cfg_json, fields=tuple(RESUME_MUST_MATCH), why=RESUME_MUST_MATCH
        )
        state, meta = ckpt.restore(engine.abstract_state)
        start = int(meta["data_position"])
        if start >= t.steps:
            # Read back (a damaged newest step falls back and trains on), but nothing left to
            # train: no evaluation record is appended and the checkpoints stay as they are.
            ckpt.close()
            if main:
                print(
                    f"already finished: step {start} of {t.steps} (train.steps) in "
                    f"{ckpt.directory}; raise train.steps to train on, or use a new --workdir",
                    flush=True,
                )
            return {}
        if main:
            print(f"resumed from {ckpt.directory} at step {int(state['step'])}", flush=True)
            note = _schedule_change_note((saved or {}).get("train", {}), t, start)
            if note:
                print(note, flush=True)
    elif init_from is not None:  # its weights, a fresh optimizer, step 0
        state = engine.init(params=weights.load_params(init_from, engine.abstract_state["params"]))
        if main:
            print(f"initialised from {init_from.path} ({init_from.kind})", flush=True)
    else:
        state = engine.init()

    compiled = engine.train_step.lower(engine.abstract_state, abstract_batch).compile()
    record = layout_record(engine, compiled, config)
    writer = metrics.MetricsWriter(workdir, enabled=main)
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(cfg_json, f, indent=2, sort_keys=True)
        if start == 0 or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            writer.write_layout(record)
        print(summary(record), flush=True)

    peak = metrics.peak_flops(jax.devices()[0])
    per_step_items = record.get("tokens_per_step", t.batch_size)
    rate_key = "tokens_per_s" if "tokens_per_step" in record else "examples_per_s"

    def evaluate(state) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for i in range(t.eval_batches):
            for k, v in engine.eval_step(state, batches.get(i, "val")).items():
                out.setdefault(k, []).append(float(v))
        return {f"eval_{k}": float(np.mean(v)) for k, v in out.items()}

    finite_checks = {"through": start, "in_a_row": 0}  # last step checked; skips in a row

    def say(line: str) -> None:
        if bar is not None:
            bar.write(line)
        elif main:
            print(line, flush=True)

    def check_finite(m, at_step: int) -> None:
        """Stops (on_nonfinite=stop) or reports a skipped update; each step is judged once."""
        if at_step <= finite_checks["through"]:
            return
        finite_checks["through"] = at_step
        if bool(m["finite"]):
            finite_checks["in_a_row"] = 0
            return
        good = ckpt.latest_step()
        last_good = f"step {good} in {ckpt.directory}" if good is not None else "none"
        if t.on_nonfinite == "stop":
            raise ConfigError(
                f"non-finite loss or gradient at step {at_step}; last good checkpoint: "
                f"{last_good} (set train.on_nonfinite=skip to drop such updates)"
            )
        finite_checks["in_a_row"] += 1
        n = finite_checks["in_a_row"]
        say(
            f"step {at_step}: non-finite loss or gradient, update skipped ({n} in a row; "
            f"stopping at train.max_skipped={t.max_skipped})"
        )
        if n >= t.max_skipped:
            raise ConfigError(
                f"{n} non-finite steps in a row ({at_step - n + 1} to {at_step}), each update "
                f"skipped: stopped at train.max_skipped={t.max_skipped}; last good checkpoint: "
                f"{last_good} (lower train.learning_rate, or raise train.max_skipped)"
            )

    progress_file = os.environ.get("JAXDIST_PROGRESS_FILE")  # set by scripts/launch.py

    def report_progress(at_step: int) -> None:
        """Tells the launcher's watchdog (--hang_s) this process is still moving."""
        if progress_file:
            try:
                with open(progress_file, "w", encoding="ascii") as f:
                    f.write(f"{at_step}\n")
            except OSError:
                pass  # the watchdog is a help, never a reason to stop training

    pre = _Preemption()
    pre.install()
    bar = None
    if main and _terminal_width() > 0:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True)
    profile_steps = set(config.profile.steps)
    last: dict[str, float] = {}
    prev_metrics = None
    t_last, n_since = time.perf_counter(), 0
    t_start = t_last
    step = start
    try:
        while step < t.steps:
            if step in profile_steps and step - 1 not in profile_steps:
                jax.profiler.start_trace(os.path.join(workdir, "profile"))
            state, m = compiled(state, batches.get(step))
            step += 1
            n_since += 1
            if step > start + 1:  # the first step pays one-off costs (first run, warm-up)
                report_progress(step)
            if step - 1 in profile_steps and step not in profile_steps:
                jax.block_until_ready(m)
                jax.profiler.stop_trace()
            # The previous step's finiteness is checked one step late, so the host never waits on
            # the step it just dispatched.
            if prev_metrics is not None:
                check_finite(prev_metrics, step - 1)
            prev_metrics = m
            if step % t.log_every == 0 or step == t.steps:
                m = jax.device_get(m)
                check_finite(m, step)
                now = time.perf_counter()
                dt = (now - t_last) / n_since
                t_last, n_since = now, 0
                last = {k: float(v) for k, v in m.items() if k != "finite"}
                last["step_time_s"] = dt
                last[rate_key] = per_step_items / dt
                if peak and "flops_per_token" in record:
                    last["mfu"] = metrics.mfu(
                        last[rate_key], record["flops_per_token"], num_devices, peak
                    )
                if t.eval_every and step % t.eval_every == 0:
                    last.update(evaluate(state))
                    report_progress(step)
                writer.write_step(step, last)
                eta = (now - t_start) / (step - start) * (t.steps - step)
                if bar is not None:  # tqdm shows the ETA itself
                    line = step_line(step, t.steps, last, None).split(" │ ", 1)[1]
                    bar.set_postfix_str(line.split(" │ eval ")[0], refresh=False)
                    if any(k.startswith("eval_") for k in last):
                        bar.write(f"step {step}: " + ", ".join(eval_parts(last)))
                elif main:
                    print(step_line(step, t.steps, last, eta), flush=True)
            if bar is not None:
                bar.update(1)
            # A checkpoint is written only once its step is known to be finite, so the "last
            # good checkpoint" named by check_finite never holds a non-finite state.
            if pre.requested(step):  # asked once per step, on every process
                check_finite(m, step)
                ckpt.save(step, state, data_position=step, force=True)
                ckpt.wait()
                if bar is not None:
                    bar.close()
                    bar = None
                stopped = Preempted(step, str(ckpt.directory), preempted_exit_code())
                if main:
                    code = stopped.exit_code
                    print(
                        f"{stopped}" + (f"; exit status {code} (unfinished)" if code else ""),
                        flush=True,
                    )
                raise stopped
            if ckpt.should_save(step) and step < t.steps:
                check_finite(m, step)
                ckpt.save(step, state, data_position=step)
        if prev_metrics is not None:
            check_finite(prev_metrics, step)
        final_eval = evaluate(state)
        report_progress(step)
        last.update(final_eval)
        writer.write_step(step, {**final_eval, "kind": "eval"})
        if config.checkpoint.every > 0:
            ckpt.save(step, state, data_position=step, force=True)
        ckpt.wait()
        report_progress(step)
        if bar is not None:  # closed first: `done:` gets its own line, not the bar's
            bar.close()
            bar = None
        if main:
            evals = ", ".join(eval_parts(final_eval))
            print(
                f"done: step {step}, train loss {last.get('loss', float('nan')):.4f}, {evals}",
                flush=True,
            )
            steps = ckpt.all_steps()
            print("\n".join(outputs_lines(workdir, str(ckpt.directory), steps)), flush=True)
        return last
    finally:
        pre.restore()
        if bar is not None:
            bar.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
