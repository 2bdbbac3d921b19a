"""The training loop: linear and short. Logging, evaluation, checkpoints and profiling on a cadence.

`run(config, workdir)` validates the config, builds the mesh and the Engine, restores the newest
checkpoint under `workdir/checkpoints` if there is one, compiles the step once (ahead of time, so the
`layout` record describes the exact program that runs), and trains.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import (
    checkpoint,
    data,
    goodput,
    job_goodput,
    metrics,
    resume,
    train,
    weights,
    workdir_lock,
)
from jaxdist import config as config_lib
from jaxdist import mesh as mesh_lib
from jaxdist.checkpoint import fast as fast_lib
from jaxdist.checkpoint.fast import FastTier
from jaxdist.console import (
    Console,
    done_line,
    eval_parts,
    fmt_duration,
    outputs_lines,
    step_line,
    summary,
)
from jaxdist.errors import ConfigError, NonFiniteError
from jaxdist.layout_record import layout_changed, layout_record
from jaxdist.network import counters
from jaxdist.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption, preempted_exit_code
from jaxdist.step_guard import Rollback, StepGuard, fault_batch

log = logging.getLogger("jaxdist")

# Names tests and scripts read as `loop.X` (the console and preemption live in their own modules).
__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Hook",
    "Preempted",
    "done_line",
    "layout_record",
    "outputs_lines",
    "preempted_exit_code",
    "run",
    "step_line",
    "summary",
]
_fmt_duration = fmt_duration  # tests/test_console.py reads it as loop._fmt_duration


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


@dataclasses.dataclass
class Hook:
    """`fn(step, state, metrics)` after every step that is a multiple of `every` (0: never), and
    after the last step when `at_end`. `metrics` are the step's device arrays (not fetched)."""

    every: int
    fn: Callable[[int, Any, Any], None]
    at_end: bool = False

    def due(self, step: int, last_step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == last_step)


class _Profiler:
    """A trace of the `profile.steps` (each contiguous run of steps one trace) under workdir."""

    def __init__(self, steps: Sequence[int], workdir: str):
        self.steps, self.dir = set(steps), os.path.join(workdir, "profile")

    def before(self, step: int) -> None:  # `step`: the step about to run (0-based)
        if step in self.steps and step - 1 not in self.steps:
            jax.profiler.start_trace(self.dir)

    def after(self, step: int, m) -> None:  # `step`: steps done
        if step - 1 in self.steps and step not in self.steps:
            jax.block_until_ready(m)
            jax.profiler.stop_trace()


def _report_progress(at_step: int) -> None:
    """Tells the launcher's watchdog (`--hang_s`, JAXDIST_PROGRESS_FILE) this process moves."""
    progress_file = os.environ.get("JAXDIST_PROGRESS_FILE")  # set by scripts/launch.py
    if progress_file:
        try:
            with open(progress_file, "w", encoding="ascii") as f:
                f.write(f"{at_step}\n")
        except OSError:
            pass  # the watchdog is a help, never a reason to stop training


class _DataOrder:
    """Which batch of the data order (a pure function of its index) each step trains on.

    Step j (0-based) trains on batch `j + offset`, moved past every batch a rollback skipped
    (`train.on_spike=rollback`). Checkpoints save `index(step)` as their `data_position`, so a
    resume carries the skipped batches as the offset `data_position - step`.
    """

    def __init__(self, offset: int = 0):
        self.offset, self.skips = offset, []  # data indices skipped, ascending

    def index(self, step: int) -> int:
        i = step + self.offset
        for skipped in self.skips:
            if skipped <= i:
                i += 1
        return i

    def skip(self, index: int) -> None:
        self.skips = sorted({*self.skips, index})


@dataclasses.dataclass
class _Setup:
    """What `run` builds before the first step."""

    engine: train.Engine
    batches: data.Batches
    ckpt: checkpoint.Checkpointer
    cfg_json: dict[str, Any]
    preemption: Preemption
    lock: workdir_lock.WorkdirLock  # held by process 0 until `run` returns or raises
    fast: FastTier | None = None  # checkpoint.local_every > 0: the fast tier
    order: _DataOrder = dataclasses.field(default_factory=_DataOrder)


def _build(config, workdir: str, checks) -> _Setup:
    """Validates, loads the data, builds the mesh and the engine; nothing compiled yet."""
    num_devices = jax.device_count()
    config_lib.validate(config, num_devices)
    mesh_lib.check_backend(config)
    for check in checks:
        check(config, num_devices)
    saved = checkpoint.committed_steps(os.path.join(workdir, "checkpoints"))
    finished = bool(saved) and saved[-1] >= config.train.steps  # says so in one line, later
    if jax.process_index() == 0 and not finished:  # the seconds before compiling are not silent
        print(
            f"loading data.source={config.data.source} and building the {config.model.name} "
            f"on {num_devices} device(s) ...",
            flush=True,
        )
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    if jax.process_index() == 0:
        for warning in ds.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    engine = train.build(config, mesh_lib.make_mesh(config.mesh), ds)
    t = config.train
    batches = data.Batches(
        ds,
        batch_size=t.batch_size,
        seq_len=config.model.seq_len,
        seed=t.seed,
        shardings=engine.batch_shardings,
        packing=config.data.packing,
    )
    os.makedirs(workdir, exist_ok=True)
    lock = workdir_lock.acquire(workdir)  # before the first write into the workdir
    if lock.note:
        print(f"note: {lock.note}", file=sys.stderr, flush=True)
    cfg_json = config_lib.to_json_dict(config)
    preemption = Preemption()
    try:
        ckpt = checkpoint.Checkpointer(
            os.path.join(workdir, "checkpoints"),
            every=config.checkpoint.every,
            keep=config.checkpoint.keep,
            config_json=cfg_json,
            stop_requested=preemption.stop_requested,
        )
    except BaseException:
        lock.release()
        raise
    fast = None
    if config.checkpoint.local_every > 0:
        local_dir = config.checkpoint.local_dir or fast_lib.default_dir(workdir)
        fast = FastTier(local_dir, every=config.checkpoint.local_every, config_json=cfg_json)
    return _Setup(engine, batches, ckpt, cfg_json, preemption, lock, fast)


def run(
    config,
    workdir: str,
    *,
    checks: Sequence[Callable[[Any, int], None]] = (),
    layout_extras: Sequence[Callable[[Any, train.Engine], dict[str, Any]]] = (),
) -> dict[str, float]:
    """Trains per `config`, writing metrics, config and checkpoints under `workdir`.

    Args:
      config: the experiment config (validated here).
      workdir: the run's folder; a rerun resumes from its newest checkpoint.
      checks: `check(config, num_devices)` run after validation, before anything is built
        (scripts/train.py passes the planner's memory refusal); raise ConfigError to refuse.
      layout_extras: `extra(config, engine) -> dict` merged into the `layout` record
        (scripts/train.py passes the planner's prediction).

    Returns the last logged metrics (and the final evaluation loss under "eval_loss"); an empty
    dict when the checkpoint in `workdir` already reached `train.steps` (nothing is run).

    Raises:
      Preempted: SIGTERM or SIGINT stopped the run; its checkpoint is committed.
      NonFiniteError: a non-finite step with train.on_nonfinite=stop, or too many skipped.
    """
    clock = goodput.Clock()
    workdir = check_workdir(workdir)
    init_from = weights.apply_init_from(config)  # the source's model fields, before validation
    weights.check_init_tokenizer(init_from, config.data.source)
    setup = _build(config, workdir, checks)
    engine, ckpt, main = setup.engine, setup.ckpt, jax.process_index() == 0
    try:
        state, start = resume.restore_or_init(
            engine, ckpt, config, setup.cfg_json, init_from, main, clock, setup.fast, setup.order
        )
        if state is None:
            return {}
        return _train(config, workdir, setup, state, start, layout_extras, clock)
    finally:
        try:
            ckpt.wait()
            ckpt.close()
        finally:
            setup.lock.release()


def _train(
    config, workdir, setup: _Setup, state, start: int, layout_extras, clock: goodput.Clock
) -> dict[str, float]:
    """The steps from `start` to `train.steps`, with the hooks on their cadence."""
    engine, batches, ckpt, t = setup.engine, setup.batches, setup.ckpt, config.train
    main = jax.process_index() == 0
    compiled = _compile_step(engine, batches, clock, main)
    redone = _steps_logged_past(workdir, start)  # a restart from scratch redoes steps too
    record = layout_record(engine, compiled, config)
    for extra in layout_extras:
        record.update(extra(config, engine))
    writer = metrics.MetricsWriter(workdir, enabled=main)
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(setup.cfg_json, f, indent=2, sort_keys=True)
        if start == 0 or layout_changed(workdir, record):
            writer.write_layout(record)
        print(summary(record), flush=True)
    console = Console(main, t.steps, start)
    guard = StepGuard(t, ckpt, console.say, start, writer.write_step)
    logger = _Logger(config, record, writer, console, guard, start, clock)
    evaluate = _Evaluator(engine, batches, t.eval_batches)
    hooks = _hooks(config, setup, start, logger, console, guard, evaluate, writer, clock)
    unit = "tok" if logger.rate_key == "tokens_per_s" else "ex"
    ends = _RunEnd(writer, clock, start, redone, (logger.per_step_items, unit))
    profiler = _Profiler(config.profile.steps, workdir)
    setup.preemption.install()
    step = start
    try:
        with clock.charge("productive"):
            while step < t.steps:
                profiler.before(step)
                with clock.charge("data"):
                    index = setup.order.index(step)
                    batch = fault_batch(batches.get(index), index, config.model.vocab_size)
                state, m = compiled(state, batch)
                step += 1
                ends.step = step  # before the hooks: a preemption's checkpoint hook stops the run
                profiler.after(step, m)
                try:
                    for hook in hooks:
                        if hook.due(step, t.steps):
                            hook.fn(step, state, m)
                except Rollback as spike:
                    state, step = _rollback(engine, setup, console, writer, clock, spike.step)
                    ends.redone += spike.step - 1 - step  # trained again: recomputed
                    guard.through, logger.prev = step, None
        return _finish(config, workdir, setup, logger, console, step, state, evaluate, ends)
    except Preempted:
        ends.write()
        raise
    finally:
        setup.preemption.restore()
        console.close()
        writer.close()


def _compile_step(engine, batches, clock: goodput.Clock, main: bool):
    """The train step lowered for the batches' shapes and compiled ahead of time (said, timed)."""
    shapes = batches.global_shapes()
    dtypes = {k: jnp.int32 for k in shapes}  # token ids, labels, segment ids, positions
    dtypes["inputs"] = jnp.int32 if batches.ds.kind == "tokens" else jnp.float32
    abstract_batch = engine.abstract_batch(shapes, dtypes)
    if main:
        print("compiling the train step ...", flush=True)
    t0 = time.perf_counter()
    with clock.charge("compile"):
        compiled = engine.train_step.lower(engine.abstract_state, abstract_batch).compile()
    if main:
        print(f"compiled in {time.perf_counter() - t0:.1f}s", flush=True)
    return compiled


def _hooks(config, setup: _Setup, start, logger, console, guard, evaluate, writer, clock):
    """What runs after a step, each on its cadence: progress, the finiteness judge, evaluation,
    the log line, the bar, the persistent checkpoint and the fast tier."""
    engine, ckpt, t = setup.engine, setup.ckpt, config.train
    hooks = [
        Hook(1, lambda step, state, m: _report_progress(step) if step > start + 1 else None),
        # The previous step's finiteness is judged one step late, so the host never waits on the
        # step it just dispatched.
        Hook(1, lambda step, state, m: logger.judge_previous(step, m)),
        Hook(
            t.eval_every, lambda step, state, m: logger.add_eval(step, m, lambda: evaluate(state))
        ),
        Hook(t.log_every, logger.log, at_end=True),
        Hook(1, lambda step, state, m: console.advance()),
        # Saved only once known finite, so the "last good checkpoint" is never a non-finite one.
        Hook(
            1,
            lambda step, state, m: _checkpoint(
                engine, ckpt, guard, console, clock, step, state, m, setup.order.index(step)
            ),
        ),
    ]
    if setup.fast is not None:
        hooks.append(
            Hook(
                setup.fast.every,
                lambda step, state, m: _fast_save(
                    engine,
                    setup.fast,
                    guard,
                    clock,
                    writer,
                    step,
                    state,
                    m,
                    setup.order.index(step),
                ),
            )
        )
    return hooks


def _checkpoint(engine, ckpt, guard, console, clock, step: int, state, m, position: int) -> None:
    """Saves when orbax's policies say so (interval, preemption); a preemption then stops."""
    if not ckpt.should_save(step):  # asked once per step, on every process
        return
    guard.check(m, step)
    with clock.charge("checkpoint"):
        ckpt.save(step, engine.to_user(state), data_position=position, force=True)
    if not ckpt.preempted:
        return
    with clock.charge("checkpoint"):
        ckpt.wait()
    console.close()
    stopped = Preempted(step, str(ckpt.directory), preempted_exit_code())
    if console.main:
        code = stopped.exit_code
        print(f"{stopped}" + (f"; exit status {code} (unfinished)" if code else ""), flush=True)
    raise stopped


def _fast_save(
    engine, fast: FastTier, guard, clock, writer, step: int, state, m, position: int
) -> None:
    """A fast-tier save (process-local, copied to the peer) of a step known to be finite; its
    seconds and the bytes process 0 keeps (its shards and its peer's) as a `fast_tier` record."""
    guard.check(m, step)
    with clock.charge("checkpoint"):
        fast.save(step, engine.to_user(state), data_position=position)
    writer.write_step(
        step, {"kind": "fast_tier", "save_s": fast.last_save_s, "bytes": fast.last_bytes}
    )


def _rollback(engine, setup: _Setup, console, writer, clock, spike_step: int):
    """(state, step) of the newest fast-tier step before `spike_step`; the spike's batch skipped.

    Every process gets here at the same step (the loss is global) and restores together.
    """
    fast, order = setup.fast, setup.order
    bad = order.index(spike_step - 1)  # the batch the spike step trained on
    with clock.charge("restart"):
        step, listing, _ = fast.newest_complete(engine.abstract_state)
        got = None
        if step is not None and step < spike_step:
            got = fast.restore(step, listing, engine.abstract_state)
    if got is None:
        raise NonFiniteError(
            f"loss spike at step {spike_step}: no readable fast-tier step before it to roll back "
            f"to (checkpoint.local_every={fast.every}); use train.on_spike=skip"
        )
    state, manifest, _ = got
    order.skip(bad)
    console.say(
        f"step {spike_step}: rolled back to fast-tier step {step}; data batch {bad} skipped "
        f"(steps {step + 1} to {spike_step - 1} trained again)"
    )
    writer.write_step(spike_step, {"kind": "rollback", "to_step": step, "skipped_batch": bad})
    return engine.to_storage(state), int(manifest["step"])


def _finish(
    config, workdir, setup, logger, console, step, state, evaluate, ends
) -> dict[str, float]:
    """The final evaluation and checkpoint, then the goodput record and where the outputs are."""
    ckpt, clock = setup.ckpt, ends.clock
    try:
        logger.judge_previous(step + 1, None)
    except Rollback:  # no step is left to train after it: the last update is kept
        console.say(f"step {step}: the last step spiked; nothing left to roll back into, kept")
    with clock.charge("eval"):
        final_eval = evaluate(state)
    _report_progress(step)
    logger.last.update(final_eval)
    logger.writer.write_step(step, {**final_eval, "kind": "eval"})
    with clock.charge("checkpoint"):
        if config.checkpoint.every > 0:
            position = setup.order.index(step)
            ckpt.save(step, setup.engine.to_user(state), data_position=position, force=True)
        ckpt.wait()
        ckpt.close()  # orbax's threads stop inside the clock: the record covers the whole run
    if setup.fast is not None and config.checkpoint.every > 0:
        setup.fast.remove()  # the final persistent save supersedes the process-local copies
    _report_progress(step)
    console.close()  # first: `done:` gets its own line, not the bar's
    # What is left to do after the record is printing: the record covers the whole run.
    outputs = outputs_lines(workdir, str(ckpt.directory), ckpt.all_steps()) if console.main else []
    record = ends.write()
    if console.main:
        loss = logger.last.get("loss", float("nan"))
        print(done_line(step, loss, final_eval, record, ends.items_trained()), flush=True)
        print(goodput.summary_line(record), flush=True)
        print("\n".join(outputs), flush=True)
    return logger.last


class _RunEnd:
    """Writes the run's `goodput` record once (at its end, or when a preemption stops it)."""

    def __init__(self, writer, clock, start: int, redone: int, per_step: tuple[float, str]):
        self.writer, self.clock = writer, clock
        self.start, self.step, self.redone = start, start, redone
        self.per_step = per_step  # (items per step, "tok" or "ex")
        self.written: dict[str, Any] | None = None

    def items_trained(self) -> tuple[float, str]:
        return (self.step - self.start) * self.per_step[0], self.per_step[1]

    def write(self) -> dict[str, Any]:
        if self.written is None:
            steps = self.step - self.start
            if steps > 0 and self.redone > 0:  # steps a previous attempt had trained already
                per_step = self.clock.seconds["productive"] / steps
                self.clock.move(min(self.redone, steps) * per_step, "productive", "recomputed")
            self.written = self.clock.record()
            self.writer.write_record(self.written)
            if self.writer.enabled:
                job_goodput.write_snapshot(self.written, self.writer.workdir, final=True)
        return self.written


def _steps_logged_past(workdir: str, start: int) -> int:
    """How many steps after `start` an earlier attempt logged (trained, then lost to a restart)."""
    last = start
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            for line in f:
                if '"loss"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the crash
                if rec.get("kind") is None and isinstance(rec.get("step"), int):
                    last = max(last, rec["step"])
    except OSError:
        return 0
    return last - start


class _Evaluator:
    """Mean of each eval figure over `eval_batches` validation batches."""

    def __init__(self, engine, batches, eval_batches: int):
        self.engine, self.batches, self.n = engine, batches, eval_batches

    def __call__(self, state) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for i in range(self.n):
            for k, v in self.engine.eval_step(state, self.batches.get(i, "val")).items():
                out.setdefault(k, []).append(float(v))
        return {f"eval_{k}": float(np.mean(v)) for k, v in out.items()}


class _Logger:
    """The log hook: fetches the metrics every `train.log_every` steps, times, writes, prints."""

    def __init__(self, config, record, writer, console, guard, start: int, clock=None):
        self.t, self.writer, self.console, self.guard = config.train, writer, console, guard
        self.clock = clock if clock is not None else goodput.Clock()
        self.per_step_items = record.get("tokens_per_step", config.train.batch_size)
        self.rate_key = "tokens_per_s" if "tokens_per_step" in record else "examples_per_s"
        self.flops_per_token = record.get("flops_per_token")
        self.peak = metrics.peak_flops(jax.devices()[0])
        self.start, self.last = start, {}
        self.prev = None  # the previous step's metrics, judged one step late
        self.pending_eval: dict[str, float] = {}
        self.t_last = self.t_start = time.perf_counter()
        self.n_since = 0
        # On an emulated cluster (launch.py --network): every host's link bytes per log window.
        self.net = counters.Window.from_env() if writer.enabled else None

    def judge_previous(self, step: int, m) -> None:
        """Checks the finiteness of step - 1 (dispatched one step ago); keeps `m` for next time."""
        self.n_since += m is not None
        if self.prev is not None:
            self.guard.check(self.prev, step - 1)
        self.prev = m

    def add_eval(self, step: int, m, run_eval: Callable[[], dict[str, float]]) -> None:
        """Evaluates, off the step-time clock; the figures join this step's log line when it logs,
        and are written as their own record otherwise."""
        jax.block_until_ready(m)  # the step's own time stays on the clock
        t0 = time.perf_counter()
        with self.clock.charge("eval"):
            figures = run_eval()
        self.t_last += time.perf_counter() - t0
        self.t_start += time.perf_counter() - t0
        _report_progress(step)
        if step % self.t.log_every == 0 or step == self.t.steps:
            self.pending_eval = figures
        else:
            self.writer.write_step(step, {**figures, "kind": "eval"})
            self.console.say(f"step {step}: " + ", ".join(eval_parts(figures)))

    def log(self, step: int, state, m) -> None:
        del state
        m = jax.device_get(m)
        self.guard.check(m, step)
        now = time.perf_counter()
        dt = (now - self.t_last) / max(self.n_since, 1)
        steps = self.n_since
        self.t_last, self.n_since = now, 0
        last = {k: float(v) for k, v in m.items() if k != "finite"}
        last["step_time_s"] = dt
        last[self.rate_key] = self.per_step_items / dt
        if self.peak and self.flops_per_token is not None:
            last["mfu"] = metrics.mfu(
                last[self.rate_key], self.flops_per_token, jax.device_count(), self.peak
            )
        last.update(self.pending_eval)
        self.pending_eval = {}
        self.last = last
        self.writer.write_step(step, last)
        if self.writer.enabled:  # the launcher's job-level goodput (a killed attempt's last word)
            job_goodput.write_snapshot(self.clock.record(), self.writer.workdir, final=False)
        net = self.net.take(steps) if self.net is not None else None
        if net is not None:
            self.writer.write_step(step, net)
            late = self.net.straggler(net)
            if late is not None:
                self.writer.write_step(step, late)
        eta = (now - self.t_start) / (step - self.start) * (self.t.steps - step)
        self.console.step(step, self.t.steps, last, eta)
