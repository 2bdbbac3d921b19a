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

from jaxdist import checkpoint, data, distributed, metrics, train
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
    if local_steps > 1:
        record["local_steps"] = local_steps
    if engine.schedule is not None:
        from jaxdist import pipeline

        # The table bubble assumes unit-time ticks; the lock-step cost is what the program runs.
        record["pipeline"] = {**engine.schedule.describe(), **pipeline.step_cost(engine, compiled)}
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
        line = f"pipeline│ bubble fraction {record['bubble_fraction']:.3f}"
        if "lockstep_vs_ideal" in record.get("pipeline", {}):
            line += f", lock-step cost {record['pipeline']['lockstep_vs_ideal']:.2f}× the ideal"
        lines.append(line)
    return "\n".join(lines)


class _Preemption:
    """Turns SIGTERM/SIGINT into a flag checked at step boundaries."""

    def __init__(self):
        self.signum: int | None = None
        self._old = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        del frame
        self.signum = signum

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)

    def requested(self, step: int) -> bool:
        """True on every process at the same step once a stop was asked for."""
        if jax.process_count() == 1:
            return self.signum is not None
        # With several processes JAX's preemption service takes SIGTERM and agrees on a step.
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
    """
    workdir = check_workdir(workdir)
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

    pre = _Preemption()
    pre.install()
    bar = None
    if main and sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True)
    profile_steps = set(config.profile.steps)
    last: dict[str, float] = {}
    prev_metrics = None
    t_last, n_since = time.perf_counter(), 0
    step = start
    try:
        while step < t.steps:
            if step in profile_steps and step - 1 not in profile_steps:
                jax.profiler.start_trace(os.path.join(workdir, "profile"))
            state, m = compiled(state, batches.get(step))
            step += 1
            n_since += 1
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
                    last["mfu"] = last[rate_key] * record["flops_per_token"] / (num_devices * peak)
                if t.eval_every and step % t.eval_every == 0:
                    last.update(evaluate(state))
                writer.write_step(step, last)
                if bar is not None:
                    bar.set_postfix(loss=f"{last['loss']:.4f}")
                elif main:
                    print(
                        f"step {step:6d} │ loss {last['loss']:.4f} │ lr {last['learning_rate']:.2e} │ "
                        f"{dt * 1e3:.1f} ms/step",
                        flush=True,
                    )
            if bar is not None:
                bar.update(1)
            # A checkpoint is written only once its step is known to be finite, so the "last
            # good checkpoint" named by check_finite never holds a non-finite state.
            if ckpt.should_save(step) and step < t.steps:
                check_finite(m, step)
                ckpt.save(step, state, data_position=step)
            if pre.requested(step):
                check_finite(m, step)
                ckpt.save(step, state, data_position=step, force=True)
                ckpt.wait()
                if main:
                    print(
                        f"preempted at step {step}: checkpoint saved in {ckpt.directory}",
                        flush=True,
                    )
                return last
        if prev_metrics is not None:
            check_finite(prev_metrics, step)
        final_eval = evaluate(state)
        last.update(final_eval)
        writer.write_step(step, {**final_eval, "kind": "eval"})
        if main:
            print(
                f"done: step {step}, train loss {last.get('loss', float('nan')):.4f}, "
                f"eval loss {final_eval['eval_loss']:.4f}",
                flush=True,
            )
        if config.checkpoint.every > 0:
            ckpt.save(step, state, data_position=step, force=True)
        return last
    finally:
        pre.restore()
        if bar is not None:
            bar.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
