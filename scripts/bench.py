"""Benchmarks: step time, throughput, MFU, memory and bytes on the wire. Prints a table, writes JSON.

    python scripts/bench.py                                   # overhead vs a hand-written jit step
    python scripts/bench.py --study=compile                   # compile time, 4 vs 48 layers
    python scripts/bench.py --config=configs/gpt_small.py --config.train.batch_size=8

Studies:
  overhead  the framework's train step against a minimal hand-written `jax.jit` step of the same
            model (same parameters, same shardings, same optimizer) on the same mesh; reports both
            step times (median over --steps after --warmup) and their ratio (target ≤ 1.03).
  batch     statistical efficiency: steps and examples to reach --target_loss on `stdlib` validation
            data for each global batch, adamw vs lamb, learning rate scaled by train.lr_scaling
            (sqrt by default here) from the smallest batch, warmup on. Table, JSON and a PNG plot.
  moments   the config's job (train.steps, its schedule) with train.opt_state_dtype float32, and
            bfloat16 rounded to nearest and stochastically (train.opt_state_rounding): mean training loss of the last 10 steps, validation loss, Δ, and the optimizer
            state / argument bytes per device from the compiled step's memory_analysis().
  compression  for each grad_sync.compression (and local SGD) on the config's mesh (data=8 is the
            usual choice): bytes on the wire per step (compiled HLO, steady state after any
            warm-up), ratio to `none`, median step time, and the loss after --max_steps steps vs
            uncompressed AdamW (error feedback on; each row's recipe in COMPRESSION_SETTINGS,
            --methods=a,b runs only those rows and their baselines; --table=small: each method
            with its paper's optimizer on a 1-layer GPT; --max_loss_vs_baseline=F exits 1 when a
            row ends more than F above its baseline).
            --max_steps=0 compiles only: bytes and ratios for models too big to train here.
  compile   lower+compile time of the train step for 4 and 48 layers (layers are scanned, so it
            should stay flat: target ≤ 1.5×).
  aggregation  per grad_sync.algorithm: HLO bytes of the busiest device, sequential steps and step
            time; the planner's all-reduce time 8 → 4096 devices; steps to --target_loss for each
            grad_sync.staleness in --taus (scripts/aggregation_study.py, docs/AGGREGATION.md).
  network   the same small GPT trained on emulated hosts (scripts/launch.py --network, needs root)
            per --methods and --links: step time, exposed communication, each host's link bytes
            per step (kernel) vs the HLO's, time to a target loss (scripts/network_study.py).
  fp8       train.matmul_precision: the config trained --max_steps steps (300 by default here) at
            `default` and at each of --precisions (fp8_all casts every block matmul; `fp8` skips
            the small ones, which on the tiny models is all of them), final loss (mean of the last
            10 steps) and held-out loss of each against `default` (the bar: +1%). On a CPU FP8 is
            emulated: only the losses mean anything, not the step times (docs/FP8.md).
  context, moe  context and expert parallelism (scripts/bench_parallel.py): temp memory and step
            time vs sequence length for mesh.context 1/2/4/8; step time vs number of experts at
            equal active parameters, dropless vs capacity.

Timing: every step is synchronised with `block_until_ready`; medians with the 10th–90th percentile
spread. The device's peak FLOP/s is looked up by device kind; no MFU is reported on CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_parallel  # noqa: E402
import benchlib  # noqa: E402
from absl import flags, logging  # noqa: E402
from benchlib import build as _build  # noqa: E402
from benchlib import hand_written_step  # noqa: E402
from benchlib import stats as _stats  # noqa: E402
from benchlib import timed as _timed  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Model/mesh config.", lock_config=True
)
_STUDY = flags.DEFINE_enum(
    "study",
    "overhead",
    [
        "overhead",
        "compile",
        "batch",
        "moments",
        "compression",
        "aggregation",
        "context",
        "moe",
        "network",
        "fp8",
    ],
    "Which benchmark.",
)
_LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024"], "--study=context: lengths T.")
_CONTEXTS = flags.DEFINE_list(
    "contexts",
    ["1", "2", "4", "8"],
    "--study=context: mesh.context sizes (each divides the 8 devices; data = 8 / context), the "
    "first the baseline of each row's temp ratio.",
)
_EXPERTS = flags.DEFINE_list("experts", ["4", "8", "16"], "--study=moe: numbers of experts.")
_BATCHES = flags.DEFINE_list(
    "batch_sizes", ["16", "32", "64", "128", "256", "512"], "--study=batch: global batches."
)
_BASE_BATCH = flags.DEFINE_integer(
    "base_batch_size",
    0,
    "--study=batch: the batch the learning rate is scaled from (0 = smallest).",
)
_TARGET = flags.DEFINE_float("target_loss", 2.6, "--study=batch: validation loss to reach.")
_MAX_STEPS = flags.DEFINE_integer(
    "max_steps",
    400,
    "--study=batch: give up after this many steps; --study=compression: steps run.",
)
_LAMB_LR = flags.DEFINE_float(
    "lamb_learning_rate",
    2e-2,
    "--study=batch: LAMB's base learning rate "
    "(its trust ratio scales updates to ‖w‖, so it wants a larger one).",
)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 10, "--study=batch: steps between validation checks."
)
_EVAL_EXAMPLES = flags.DEFINE_integer(
    "eval_every_examples",
    0,
    "--study=batch: examples between validation checks (steps = this // batch, at least 1), "
    "the same resolution in examples at every batch; 0 = --eval_every steps.",
)
_OPTIMIZERS = flags.DEFINE_list(
    "optimizers", ["adamw", "lamb"], "--study=batch: optimizers compared (LR_RULES names)."
)
_MUON_LR = flags.DEFINE_float(
    "muon_learning_rate", 2e-2, "--study=batch: Muon's base learning rate (both halves)."
)
_LR_GRID = flags.DEFINE_list(
    "lr_grid",
    ["1"],
    "--study=batch: multipliers of each optimizer's base learning rate tried at the base batch; "
    "the fewest steps to the target wins and is scaled by the optimizer's rule.",
)
_RETUNE = flags.DEFINE_list(
    "retune",
    [],
    "--study=batch: multipliers of the rule's learning rate also tried at every other batch "
    "(the re-tuned comparison).",
)
_MAX_EXAMPLES = flags.DEFINE_integer(
    "max_examples", 0, "--study=batch: give up after this many examples too (0 = no limit)."
)
_VAL_EXAMPLES = flags.DEFINE_integer(
    "val_examples",
    0,
    "--study=batch: one fixed validation set of this many sequences for every batch; "
    "0 = train.eval_batches batches of each run's own size.",
)
_TUNED = flags.DEFINE_list(
    "tuned",
    [],
    "--study=batch: OPT=LR pairs, the learning rate at the base batch an earlier sweep chose; "
    "those optimizers skip the sweep (a re-tune run beside a running study).",
)
_RETUNE_ONLY = flags.DEFINE_bool(
    "retune_only", False, "--study=batch: run only the --retune rows (with --tuned)."
)
_MERGE = flags.DEFINE_list(
    "merge",
    [],
    "--study=batch: JSON files of earlier --study=batch runs to join into --out (no training).",
)
_PARTIAL = flags.DEFINE_bool(
    "partial", False, "--study=batch: rewrite --out after every run (results so far)."
)
_PARTS = flags.DEFINE_list(
    "parts",
    ["algorithms", "staleness"],
    "--study=aggregation: which parts to run (algorithms, staleness, per_hop, per_hop_topk, "
    "compress_over, streaming).",
)
_ROWS = flags.DEFINE_list(
    "rows",
    None,
    "--study=aggregation: row numbers (1-based) of the per_hop, per_hop_topk, compress_over and "
    "streaming tables to run, in each the rows it holds (default: every row).",
)
_TAUS = flags.DEFINE_list(
    "taus", ["0", "1", "2", "4"], "--study=aggregation: grad_sync.staleness values to train."
)
_PLANNER_CONFIG = flags.DEFINE_string(
    "planner_config", "configs/gpt_1b.py", "--study=aggregation: model the planner rows cost."
)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps first.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternating rounds of (framework, hand-written).")
_OUT = flags.DEFINE_string("out", "runs/bench/bench.json", "JSON results file.")


def study_overhead(config) -> dict:
    import jax

    from jaxdist import config as config_lib
    from jaxdist import data, loop, mesh, metrics

    config_lib.validate(config, jax.device_count())
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    engine, batches = _build(config, m, ds)
    batch = batches.get(0)
    hand = hand_written_step(engine)
    framework_times, hand_times = [], []
    state_f, state_h = engine.init(), engine.init()
    # Alternate rounds so drift in machine load hits both alike.
    for _ in range(_REPEATS.value):
        state_f, t = _timed(engine.train_step, state_f, batch, _STEPS.value, _WARMUP.value)
        framework_times += t
        state_h, t = _timed(hand, state_h, batch, _STEPS.value, _WARMUP.value)
        hand_times += t
    f, h = _stats(framework_times), _stats(hand_times)
    compiled = engine.train_step.lower(engine.abstract_state, batch).compile()
    record = loop.layout_record(engine, compiled, config)
    tokens = record.get("tokens_per_step", config.train.batch_size)
    peak = metrics.peak_flops(jax.devices()[0])
    result = {
        "study": "overhead",
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "mesh": record["mesh"],
        "params": record["params_total"],
        "framework": f,
        "hand_written": h,
        "ratio": f["median_s"] / h["median_s"],
        "tokens_per_s": tokens / f["median_s"],
        "bytes_per_device": record["bytes_per_device"],
        "collective_bytes_per_step": record["collective_bytes_per_step"],
    }
    if peak and "flops_per_token" in record:
        result["mfu"] = metrics.mfu(
            result["tokens_per_s"], record["flops_per_token"], jax.device_count(), peak
        )
    print(f"{'step':<14}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}")
    for name, s in (("framework", f), ("hand-written", h)):
        print(
            f"{name:<14}{s['median_s'] * 1e3:>12.2f}{s['p10_s'] * 1e3:>10.2f}{s['p90_s'] * 1e3:>10.2f}"
        )
    print(f"ratio framework / hand-written: {result['ratio']:.3f}  (target ≤ 1.03)")
    print(
        f"throughput: {result['tokens_per_s']:.0f} tokens/s"
        + (f", MFU {result['mfu']:.1%}" if "mfu" in result else " (no MFU: device peak unknown)")
    )
    return result


def study_compile(config) -> dict:
    import jax

    from jaxdist import data, mesh

    out = {"study": "compile", "device": jax.devices()[0].device_kind, "layers": {}}
    ds = None
    for layers in (4, 4, 48):  # the first compile also pays one-off start-up costs: discarded
        cfg = config.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.model.num_layers = layers
        ds = ds or data.load(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
        engine, batches = _build(cfg, mesh.make_mesh(cfg.mesh), ds)
        abstract_batch = engine.abstract_batch(
            batches.global_shapes(), {"inputs": "int32", "targets": "int32"}
        )
        t0 = time.perf_counter()
        engine.train_step.lower(engine.abstract_state, abstract_batch).compile()
        out["layers"][layers] = time.perf_counter() - t0
        print(f"{layers:>3} layers: compile {out['layers'][layers]:.2f} s")
    out["ratio_48_vs_4"] = out["layers"][48] / out["layers"][4]
    print(f"ratio 48 / 4 layers: {out['ratio_48_vs_4']:.2f}  (target ≤ 1.5)")
    return out


# The learning-rate rule each optimizer claims when the batch grows k× (train.lr_scaling).
LR_RULES = {"adamw": "sqrt", "lamb": "sqrt", "lars": "linear", "sgd": "linear", "muon": "none"}


def _base_learning_rate(config, opt: str) -> float:
    """The learning rate an optimizer starts from at the base batch, before --lr_grid."""
    return {"lamb": _LAMB_LR.value, "muon": _MUON_LR.value}.get(opt, config.train.learning_rate)


def study_batch(config) -> dict:
    """Steps and examples to --target_loss per optimizer and global batch.

    The learning rate is tuned once at the base batch (--lr_grid multipliers of each optimizer's
    base rate, fewest steps wins), then scaled by the optimizer's rule (LR_RULES) to every batch;
    with --retune, each larger batch also tries those multipliers of the rule's rate, and the best
    is reported beside it.
    """
    from jaxdist import data, mesh

    if _MERGE.value:
        return _merge_batch(_MERGE.value)
    sizes = sorted(int(b) for b in _BATCHES.value)
    base_batch = _BASE_BATCH.value or min(sizes)
    optimizers = list(_OPTIMIZERS.value)
    unknown = [o for o in optimizers if o not in LR_RULES]
    if unknown:
        raise ConfigError(
            f"--optimizers: {', '.join(unknown)} unknown; valid: {', '.join(LR_RULES)}"
        )
    grid = [float(x) for x in _LR_GRID.value]
    retune = [float(x) for x in _RETUNE.value]
    out = _batch_header(config, base_batch, optimizers, grid, retune)
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    out["mesh"] = mesh.mesh_shape(m)
    print(
        f"{'optimizer':<10}{'batch':>7}{'kind':>8}{'lr':>10}{'steps':>8}{'examples':>10}"
        f"{'final val':>11}{'ms/step':>9}{'load':>6}"
    )

    def record(run: dict) -> dict:
        out["runs"].append(run)
        print(
            f"{run['optimizer']:<10}{run['batch_size']:>7}{run['kind']:>8}"
            f"{run['learning_rate']:>10.2e}{str(run['steps'] or '—'):>8}"
            f"{str(run['examples'] or '—'):>10}{run['final_val_loss']:>11.3f}"
            f"{run['step_time_s'] * 1e3:>9.1f}{run['load_average'][0]:>6.1f}",
            flush=True,
        )
        if _PARTIAL.value:  # results so far, should the study be stopped
            out["summary"] = _batch_summary(out)
            with open(_OUT.value, "w") as f:
                json.dump(out, f, indent=2)
        return run

    # Sweeps first, then every rule run, then the re-tunes: stopped early, the study has its
    # main answer (with --partial, in --out).
    tuned = {}
    for spec in _TUNED.value:  # rates tuned by an earlier run: no sweep
        opt, _, lr = spec.partition("=")
        tuned[opt] = float(lr)
    for opt in optimizers:
        if opt in tuned:
            continue
        base_lr = _base_learning_rate(config, opt)
        sweep = [
            record(_batch_run(config, m, ds, opt, base_batch, base_batch, base_lr, "none", g))
            for g in grid
        ]
        best = min(sweep, key=_run_rank)
        best["chosen"] = True
        tuned[opt] = best["learning_rate"]
    # in the order given: a study stopped early has the batches listed first
    others = [int(b) for b in _BATCHES.value if int(b) != base_batch]
    for g in retune if _RETUNE_ONLY.value else [1.0, *retune]:
        for opt in optimizers:
            for b in others:
                record(_batch_run(config, m, ds, opt, b, base_batch, tuned[opt], LR_RULES[opt], g))
    out["load_average_end"] = list(os.getloadavg())
    out["summary"] = _batch_summary(out)
    _print_batch_summary(out["summary"])
    if not any(r["steps"] for r in out["runs"]):
        print(f"no run reached {_TARGET.value}: no plot (raise --max_steps or --target_loss)")
        return out
    _plot_batch(out)
    return out


def _batch_header(config, base_batch: int, optimizers: list[str], grid, retune) -> dict:
    """--study=batch's JSON before its runs: the machine, the model and every setting."""
    import jax

    return {
        "study": "batch",
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "mesh": None,
        "model": {k: config.model[k] for k in ("name", "num_layers", "d_model", "seq_len")},
        "schedule": config.train.schedule,
        "warmup_steps": config.train.warmup_steps,
        "target_loss": _TARGET.value,
        "base_batch_size": base_batch,
        "lr_rules": {o: LR_RULES[o] for o in optimizers},
        "lr_grid": grid,
        "retune": retune,
        "max_steps": _MAX_STEPS.value,
        "max_examples": _MAX_EXAMPLES.value,
        "val_examples": _VAL_EXAMPLES.value,
        "eval_every": _EVAL_EVERY.value,
        "eval_every_examples": _EVAL_EXAMPLES.value,
        "load_average_start": list(os.getloadavg()),
        "runs": [],
    }


def _merge_batch(paths: list[str]) -> dict:
    """One study from several --study=batch JSONs (optimizers run side by side, or a --retune
    run beside them): their runs together, the base-batch choice and the summary recomputed."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    out = {k: v for k, v in parts[0].items() if k not in ("runs", "summary", "plot")}
    out["merged_from"] = paths
    out["lr_rules"] = {o: r for part in parts for o, r in part["lr_rules"].items()}
    out["load_average_start"] = [part["load_average_start"] for part in parts]
    out["load_average_end"] = [part.get("load_average_end") for part in parts]
    out["runs"] = [r for part in parts for r in part["runs"]]
    for opt in out["lr_rules"]:
        sweep = [r for r in out["runs"] if r["optimizer"] == opt and r["kind"] == "sweep"]
        for r in sweep:
            r["chosen"] = False
        if sweep:
            min(sweep, key=_run_rank)["chosen"] = True
    out["summary"] = _batch_summary(out)
    _print_batch_summary(out["summary"])
    if any(r["steps"] for r in out["runs"]):
        _plot_batch(out)
    return out


def _run_rank(run: dict) -> tuple:
    """Fewest steps to the target first; among runs that missed it, the lowest validation loss."""
    return (run["steps"] is None, run["steps"] or 0, run["final_val_loss"])


def _batch_summary(out: dict) -> dict:
    """Per optimizer: the rule's and the best re-tuned run per batch, and the critical batch.

    The critical batch is the largest batch whose examples to the target stay within 2× the
    fewest over all batches (McCandlish et al.'s B_crit: twice the minimal examples, there also
    about twice the minimal steps); larger batches buy few steps for many examples.
    """
    summary = {}
    for opt in out["lr_rules"]:
        runs = [r for r in out["runs"] if r["optimizer"] == opt]
        rows = []
        for b in sorted({r["batch_size"] for r in runs}):
            at_b = [r for r in runs if r["batch_size"] == b]
            # None: a partial record (the sweep still running) or --retune_only
            rule = next((r for r in at_b if r["kind"] == "rule" or r.get("chosen")), None)
            if rule is None:
                rule = {"learning_rate": None, "steps": None, "examples": None}
                rule["step_time_s"] = statistics.median(r["step_time_s"] for r in at_b)
            best = min(at_b, key=_run_rank)
            rows.append(
                {
                    "batch_size": b,
                    "rule": {k: rule[k] for k in ("learning_rate", "steps", "examples")},
                    "retuned": {
                        k: best[k] for k in ("learning_rate", "lr_multiplier", "steps", "examples")
                    },
                    "step_time_s": rule["step_time_s"],
                }
            )
        entry = {"rows": rows}
        for which in ("rule", "retuned"):
            ex = [(row["batch_size"], row[which]["examples"]) for row in rows]
            reached = [e for _, e in ex if e]
            if not reached:
                entry[f"critical_batch_{which}"] = None
                continue
            limit = 2 * min(reached)
            within = [b for b, e in ex if e and e <= limit]
            # one batch measured says nothing; the largest measured is only a lower bound
            entry[f"critical_batch_{which}"] = max(within) if len(reached) > 1 else None
            entry[f"critical_batch_{which}_lower_bound"] = len(reached) > 1 and max(within) == max(
                b for b, _ in ex
            )
        summary[opt] = entry
    return summary


def _print_batch_summary(summary: dict) -> None:
    print(
        f"{'optimizer':<10}{'batch':>7}{'rule steps':>12}{'examples':>10}"
        f"{'retuned steps':>15}{'examples':>10}{'×lr':>6}{'ms/step':>9}"
    )
    for opt, entry in summary.items():
        for row in entry["rows"]:
            r, t = row["rule"], row["retuned"]
            print(
                f"{opt:<10}{row['batch_size']:>7}{str(r['steps'] or '—'):>12}"
                f"{str(r['examples'] or '—'):>10}{str(t['steps'] or '—'):>15}"
                f"{str(t['examples'] or '—'):>10}{t['lr_multiplier']:>6g}"
                f"{row['step_time_s'] * 1e3:>9.1f}"
            )
        print(
            f"{opt}: critical batch (examples ≤ 2× the fewest; ≥: the largest measured) "
            + ", ".join(
                f"{'≥' if entry.get(f'critical_batch_{w}_lower_bound') else ''}"
                f"{entry[f'critical_batch_{w}']} {label}"
                for w, label in (("rule", "with its rule"), ("retuned", "re-tuned"))
            )
        )


def _batch_run(
    config,
    m,
    ds,
    opt: str,
    batch_size: int,
    base_batch: int,
    base_lr: float,
    rule: str,
    multiplier: float,
) -> dict:
    """One optimizer at one global batch: steps (and examples) to the target validation loss.

    The learning rate is `base_lr` scaled from `base_batch` by `rule`, times `multiplier`.
    """
    import jax
    import numpy as np

    from jaxdist import data, optim

    max_steps = _MAX_STEPS.value
    if _MAX_EXAMPLES.value:
        max_steps = min(max_steps, max(1, _MAX_EXAMPLES.value // batch_size))
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.train.optimizer = opt
        cfg.train.learning_rate = base_lr * multiplier
        cfg.train.batch_size = batch_size
        cfg.train.base_batch_size = base_batch
        cfg.train.lr_scaling = rule
        cfg.train.steps = max_steps
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, max_steps // 10)
    engine, batches = _build(cfg, m, ds)
    if _VAL_EXAMPLES.value:  # one validation set for every batch size
        fixed = data.Batches(
            ds,
            batch_size=_VAL_EXAMPLES.value,
            seq_len=cfg.model.seq_len,
            seed=0,
            shardings=engine.batch_shardings,
        )
        val = [fixed.get(0, "val")]
    else:
        val = [batches.get(i, "val") for i in range(cfg.train.eval_batches)]
    every = _EVAL_EVERY.value
    if _EVAL_EXAMPLES.value:
        every = max(1, _EVAL_EXAMPLES.value // batch_size)
    state = engine.init()
    reached, val_loss, curve, times = None, float("nan"), [], []
    for step in range(1, max_steps + 1):
        t0 = time.perf_counter()
        state, mets = engine.train_step(state, batches.get(step - 1))
        jax.block_until_ready(mets)
        times.append(time.perf_counter() - t0)
        if step % every == 0 or step == max_steps:
            val_loss = float(np.mean([float(engine.eval_step(state, v)["loss"]) for v in val]))
            curve.append([step, val_loss])
            if val_loss <= _TARGET.value:
                reached = step
                break
            if not np.isfinite(val_loss):
                break
    return {
        "optimizer": opt,
        "batch_size": batch_size,
        "kind": "sweep" if batch_size == base_batch else "rule" if multiplier == 1 else "retune",
        "rule": rule,
        "lr_multiplier": multiplier,
        "learning_rate": optim.scaled_learning_rate(cfg.train),
        "steps": reached,
        "examples": reached * batch_size if reached else None,
        "final_val_loss": val_loss,
        "val_curve": curve,
        "step_time_s": statistics.median(times[2:] or times),
        "load_average": list(os.getloadavg()),
    }


def study_moments(config) -> dict:
    """The config's job with float32 and bfloat16 optimizer moments: loss and memory per device."""
    import jax
    import numpy as np

    from jaxdist import data, loop, mesh

    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    steps = _MAX_STEPS.value if flags.FLAGS["max_steps"].present else config.train.steps
    out = {
        "study": "moments",
        "device": jax.devices()[0].device_kind,
        "mesh": mesh.mesh_shape(m),
        "optimizer": config.train.optimizer,
        "steps": steps,
        "load_average": list(os.getloadavg()),
        "runs": [],
    }
    print(
        f"{'opt_state_dtype':<26}{'loss':>8}{'val':>8}{'Δ loss':>9}{'state B/dev':>13}"
        f"{'B/param':>9}{'args B/dev':>12}{'step ms':>9}"
    )
    for dtype, rounding in (
        ("float32", "nearest"),
        ("bfloat16", "nearest"),
        ("bfloat16", "stochastic"),
    ):
        cfg = config.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.train.opt_state_dtype = dtype
            cfg.train.opt_state_rounding = rounding
            cfg.train.steps = steps
        engine, batches = _build(cfg, m, ds)
        compiled = engine.train_step.lower(engine.abstract_state, batches.get(0)).compile()
        mem = loop.layout_record(engine, compiled, cfg)["bytes_per_device"]
        state, times, losses = engine.init(), [], []
        for step in range(steps):
            t0 = time.perf_counter()
            state, mets = compiled(state, batches.get(step))
            losses.append(float(mets["loss"]))  # synchronises
            times.append(time.perf_counter() - t0)
        val = [batches.get(i, "val") for i in range(cfg.train.eval_batches)]
        val_loss = float(np.mean([float(engine.eval_step(state, v)["loss"]) for v in val]))
        run = {
            "opt_state_dtype": dtype,
            "opt_state_rounding": rounding,
            "final_loss": float(np.mean(losses[-10:])),  # steps steps-9 .. steps
            "val_loss": val_loss,
            "opt_state_bytes_per_device": mem["opt_state"],
            "param_bytes_per_device": mem["params"],
            "state_bytes_per_param": mem["opt_state"] / (mem["params"] / 4),
            "argument_bytes_per_device": mem["arguments"],
            "temp_bytes_per_device": mem["temp"],
            "step_time_s": statistics.median(times[3:]),
        }
        base = out["runs"][0] if out["runs"] else run
        run["loss_vs_float32"] = run["final_loss"] / base["final_loss"] - 1
        run["val_vs_float32"] = run["val_loss"] / base["val_loss"] - 1
        out["runs"].append(run)
        print(
            f"{dtype + (' ' + rounding if dtype != 'float32' else ''):<26}{run['final_loss']:>8.4f}{val_loss:>8.4f}{run['loss_vs_float32']:>+9.2%}"
            f"{mem['opt_state']:>13,}{run['state_bytes_per_param']:>9.2f}"
            f"{mem['arguments']:>12,}{run['step_time_s'] * 1e3:>9.1f}",
            flush=True,
        )
    out["load_average_end"] = list(os.getloadavg())
    return out


def _plot_batch(out: dict) -> None:
    """Steps and examples to the target against the global batch, one line per optimizer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[plot]')")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, (opt, entry) in enumerate(out["summary"].items()):
        for which, style in (("rule", "o-"), ("retuned", "s--")):
            rows = [row for row in entry["rows"] if row[which]["steps"]]
            label = f"{opt} ({out['lr_rules'][opt]})" if which == "rule" else f"{opt} re-tuned"
            bs = [row["batch_size"] for row in rows]
            for ax, key in zip(axes, ("steps", "examples")):
                ax.plot(bs, [row[which][key] for row in rows], style, color=f"C{k}", label=label)
        axes[2].plot(
            [row["batch_size"] for row in entry["rows"]],
            [row["step_time_s"] * 1e3 for row in entry["rows"]],
            "o-",
            color=f"C{k}",
            label=opt,
        )
    for ax, ylabel in zip(axes, ("steps to target", "examples to target", "ms per step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch")
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"validation loss ≤ {out['target_loss']} on stdlib bytes: {out['model']['name']} "
        f"d_model {out['model']['d_model']}, {out['devices']} device(s)"
    )
    png = os.path.splitext(_OUT.value)[0] + "_batch.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    out["plot"] = png
    print(f"wrote {png}")


# (label, grad_sync fields, train overrides, the uncompressed run it is compared with). Every row
# is compared with uncompressed AdamW ("none"), the best run a user could have had without
# compression; ef_sign and the momentum-SGD rows run momentum SGD (their methods' optimizer) at
# --sgd_learning_rate. The rest keep the config's optimizer (AdamW by default).
_SGD = {"optimizer": "sgd", "momentum": 0.9}
# Deep Gradient Compression (1%, momentum correction, 20-step density warm-up) and 1-bit
# compressed momentum SGD: both move the SGD momentum into the compressor.
_DGC = {"compression": "topk", "topk_ratio": 0.01, "momentum_correction": True, "warmup_steps": 20}
_EF_SIGN_SGD = {"compression": "ef_sign", "momentum_correction": True}
COMPRESSION_SETTINGS = [
    ("none", {}, {}, "none"),
    ("bf16", {"compression": "bf16"}, {}, "none"),
    ("fp16", {"compression": "fp16"}, {}, "none"),
    ("int8", {"compression": "int8"}, {}, "none"),
    ("onebit_adam", {"compression": "onebit_adam", "warmup_steps": 40}, {}, "none"),
    ("twobit_adam", {"compression": "twobit_adam", "warmup_steps": 40}, {}, "none"),
    (
        "topk_adam",
        {"compression": "topk_adam", "topk_ratio": 0.05, "warmup_steps": 60},
        {},
        "none",
    ),
    ("powersgd", {"compression": "powersgd", "rank": 8, "warmup_steps": 40}, {}, "none"),
    (
        "topk",
        {
            "compression": "topk",
            "topk_ratio": 0.05,
            "topk_exchange": "two_phase",
            "freeze_variance": True,
            "warmup_steps": 60,
        },
        {},
        "none",
    ),
    ("local_sgd(H=4)", {"local_steps": 4}, {}, "none"),
    # post-local SGD: every step synchronous for the first 80 (40% of 200), then H = 4
    ("post_local_sgd(H=4)", {"local_steps": 4, "warmup_steps": 80}, {}, "none"),
    # the best momentum SGD measured (lr 0.05-1.0, grad_clip 0 / 0.5 / 1, Nesterov; docs)
    ("none+sgd", {}, {**_SGD, "nesterov": True}, "none"),
    ("topk(DGC)+sgd", _DGC, _SGD, "none"),
    ("ef_sign+sgd", _EF_SIGN_SGD, _SGD, "none"),
    # DGC under AdamW: each replica's own Adam momentum, top-k with factor masking, frozen variance
    # (DGC's all-gather exchange, as topk(DGC)+sgd: the same bytes)
    (
        "topk(DGC)",
        {
            "compression": "topk",
            "topk_ratio": 0.01,
            "momentum_correction": True,
            "freeze_variance": True,
            "warmup_steps": 60,
        },
        {},
        "none",
    ),
    # random-k at 25% before AdamW: the same coordinates on every replica, error feedback / unbiased
    ("randk", {"compression": "randk", "topk_ratio": 0.25}, {}, "none"),
    (
        "randk(unbiased)",
        {"compression": "randk", "topk_ratio": 0.25, "error_feedback": False},
        {},
        "none",
    ),
    # ef_sign's compressor on the gradient, then AdamW (error feedback; 40 dense steps first)
    ("ef_sign", {"compression": "ef_sign", "warmup_steps": 40}, {}, "none"),
    # ef_sign under AdamW as DGC is: each replica's own Adam momentum, 1-bit with ef_sign's scale
    # and both error feedbacks, frozen variance (error-compensated 1-bit local-momentum Adam)
    (
        "ef_sign(local_adam)",
        {
            "compression": "ef_sign",
            "momentum_correction": True,
            "freeze_variance": True,
            "warmup_steps": 60,
        },
        {},
        "none",
    ),
]
# --table=small: each method with the optimizer its paper pairs it with, on a 1-layer GPT for 150
# steps (docs/COMPRESSION.md, "Each method with its own optimizer"), the momentum-SGD rows against
# uncompressed momentum SGD at the same settings (--sgd_learning_rate=0.3 there), every other row
# against uncompressed AdamW. topk is Deep Gradient Compression (momentum correction, momentum-free
# SGD, density warm-up) and ef_sign 1-bit compressed momentum SGD; onebit_adam is AdamW with 15
# full-precision steps, then frozen variance and 1-bit momentum; PowerSGD keeps AdamW and sends its
# first 10 steps (the LR warm-up) uncompressed, as PowerSGD's start_iter does.
SMALL_JOB_SETTINGS = [
    ("none", {}, {}, "none"),
    ("none+sgd", {}, _SGD, "none+sgd"),
    ("bf16", {"compression": "bf16"}, {}, "none"),
    ("int8", {"compression": "int8"}, {}, "none"),
    ("powersgd", {"compression": "powersgd", "rank": 2, "warmup_steps": 10}, {}, "none"),
    ("topk(DGC)+sgd", _DGC, _SGD, "none+sgd"),
    ("ef_sign+sgd", _EF_SIGN_SGD, _SGD, "none+sgd"),
    ("onebit_adam", {"compression": "onebit_adam", "warmup_steps": 15}, {}, "none"),
    # 1-bit Adam's scheme with a 2-bit code
    ("twobit_adam", {"compression": "twobit_adam", "warmup_steps": 15}, {}, "none"),
]
TABLES = {"default": COMPRESSION_SETTINGS, "small": SMALL_JOB_SETTINGS}
_TABLE = flags.DEFINE_enum(
    "table",
    "default",
    list(TABLES),
    "--study=compression: the rows: `default` (COMPRESSION_SETTINGS, the recipes tuned on the "
    "default job) or `small` (SMALL_JOB_SETTINGS: each method with its paper's optimizer, the "
    "momentum-SGD rows against uncompressed momentum SGD).",
)
_BOUND = flags.DEFINE_float(
    "max_loss_vs_baseline",
    None,
    "--study=compression: fail (exit 1, after writing the JSON) when a row's final loss is more "
    "than this fraction above its baseline's, e.g. 0.05; unset = report only.",
)
_METHODS = flags.DEFINE_list(
    "methods", [], "--study=compression: run only these rows (labels as printed); default all."
)
_RECIPE = flags.DEFINE_string(
    "recipe",
    "",
    "--study=compression: JSON grad_sync fields laid over the chosen --methods rows (not `none`), "
    "for tuning, e.g. '{\"warmup_steps\": 40}'; the JSON records them in grad_sync.",
)
_BASE_LOSS = flags.DEFINE_float(
    "base_loss",
    0.0,
    "--study=compression, for tuning: take this as `none`'s final loss instead of training it "
    "again (it is still compiled for the bytes); 0 = train it.",
)
_SGD_LR = flags.DEFINE_float(
    "sgd_learning_rate",
    0.15,
    "--study=compression: learning rate of the momentum-SGD runs (the best of 0.05-1.0 measured).",
)


def _compression_rows() -> list:
    """The --table rows --methods and --recipe choose, each (label, grad_sync
    fields, train fields, baseline label)."""
    table = TABLES[_TABLE.value]
    chosen = set(_METHODS.value)
    unknown = chosen - {row[0] for row in table}
    if unknown:
        raise ConfigError(
            f"--methods: unknown {', '.join(sorted(unknown))} in --table={_TABLE.value}; valid: "
            + ", ".join(row[0] for row in table)
        )
    recipe = json.loads(_RECIPE.value) if _RECIPE.value else {}
    rows = []
    for label, fields, train_fields, base_label in table:
        if chosen and label not in chosen | {"none", base_label}:
            continue
        if recipe and label in chosen:
            fields = {**fields, **recipe}
        if train_fields.get("optimizer") == "sgd":
            train_fields = {**train_fields, "learning_rate": _SGD_LR.value}
        rows.append((label, fields, train_fields, base_label))
    return rows


def _compression_config(config, fields: dict, train_fields: dict, steps: int):
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.grad_sync.error_feedback = True
        cfg.train.steps = max(steps, 1)
        for k, v in fields.items():
            cfg.grad_sync[k] = v
        for k, v in train_fields.items():
            cfg.train[k] = v
    return cfg


def _steady_wire_bytes(cfg, m, ds, batch) -> float:
    """Bytes one device sends per step in the steady state, from the compiled HLO: the HLO
    charges a warm-up's dense branch, so the step is compiled once more without the warm-up."""
    from jaxdist import loop, train

    steady = cfg.copy_and_resolve_references()
    with steady.unlocked():
        steady.grad_sync.warmup_steps = 0
    # Not validated: onebit_adam refuses warmup_steps=0 for training (its variance would never be
    # estimated); compiled without the warm-up it is the steady state's program.
    eng = train.build(steady, m, ds)
    compiled = eng.train_step.lower(eng.abstract_state, batch).compile()
    return sum(loop.layout_record(eng, compiled, steady)["collective_bytes_per_step"].values())


def _train_row(engine, compiled, batches, steps: int) -> tuple[float, float]:
    """(median step time in s after 3 steps, mean loss of the last 10 steps) over `steps` steps."""
    import jax
    import numpy as np

    state, times, losses = engine.init(), [], []
    for step in range(steps):
        batch = batches.get(step)
        t0 = time.perf_counter()
        state, mets = compiled(state, batch)
        jax.block_until_ready(mets)
        times.append(time.perf_counter() - t0)
        losses.append(float(mets["loss"]))
    # The last 10 steps: less batch noise than one.
    return statistics.median(times[min(3, len(times) - 1) :]), float(np.mean(losses[-10:]))


_PRECISIONS = flags.DEFINE_list(
    "precisions", ["fp8_all"], "--study=fp8: train.matmul_precision values set against default."
)


def study_fp8(config) -> dict:
    """Final train and held-out loss per train.matmul_precision against `default`."""
    import jax

    from jaxdist import data, mesh

    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    steps = _MAX_STEPS.value if _MAX_STEPS.present else 300
    out = {
        "study": "fp8",
        "device": jax.devices()[0].device_kind,
        "mesh": mesh.mesh_shape(m),
        "model": {k: config.model[k] for k in ("name", "num_layers", "d_model", "seq_len")},
        "compute_dtype": config.train.compute_dtype,
        "global_batch": config.train.batch_size,
        "steps": steps,
        "runs": [],
    }
    print(
        f"{'precision':<12}{'step ms':>9}{'loss':>9}{'vs default':>12}{'eval':>9}{'vs default':>12}"
    )
    base = None
    for precision in ["default", *_PRECISIONS.value]:
        cfg = config.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.train.steps, cfg.train.matmul_precision = steps, precision
        engine, batches = _build(cfg, m, ds)
        compiled = engine.train_step.lower(engine.abstract_state, batches.get(0)).compile()
        step_time, final, eval_loss = _train_eval(engine, compiled, batches, ds, steps)
        base = base or (final, eval_loss)
        run = {
            "precision": precision,
            "step_time_s": step_time,
            "final_loss": final,
            "loss_vs_default": final / base[0] - 1,
            "eval_loss": eval_loss,
            "eval_vs_default": eval_loss / base[1] - 1,
        }
        out["runs"].append(run)
        print(
            f"{precision:<12}{step_time * 1e3:>9.1f}{final:>9.4f}{run['loss_vs_default']:>+12.2%}"
            f"{eval_loss:>9.4f}{run['eval_vs_default']:>+12.2%}",
            flush=True,
        )
    return out


def _train_eval(engine, compiled, batches, ds, steps: int) -> tuple[float, float, float]:
    """`_train_row`'s (step time, final loss), and the mean held-out loss of 8 validation
    batches after training (the same batches for every precision)."""
    import jax
    import numpy as np

    state, times, losses = engine.init(), [], []
    for step in range(steps):
        t0 = time.perf_counter()
        state, mets = compiled(state, batches.get(step))
        jax.block_until_ready(mets)
        times.append(time.perf_counter() - t0)
        losses.append(float(mets["loss"]))
    evals = [float(engine.eval_step(state, batches.get(i, "val"))["loss"]) for i in range(8)]
    step_time = statistics.median(times[min(3, len(times) - 1) :])
    return step_time, float(np.mean(losses[-10:])), float(np.mean(evals))


def study_compression(config) -> dict:
    """Bytes, step time and loss per compressor; --max_steps=0 compiles only (bytes, no loss)."""
    import jax

    from jaxdist import data, loop, mesh

    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    steps = _MAX_STEPS.value
    out = {
        "study": "compression",
        "device": jax.devices()[0].device_kind,
        "mesh": mesh.mesh_shape(m),
        "model": {k: config.model[k] for k in ("num_layers", "d_model", "seq_len")},
        "global_batch": config.train.batch_size,
        "steps": steps,
        "runs": [],
    }
    print(
        f"{'method':<16}{'wire/step':>12}{'ratio':>8}{'step ms':>9}{'loss':>9}{'vs base':>9}  base"
    )
    wire_none, losses_of = None, {}
    for label, fields, train_fields, base_label in _compression_rows():
        cfg = _compression_config(config, fields, train_fields, steps)
        engine, batches = _build(cfg, m, ds)
        compiled = engine.train_step.lower(engine.abstract_state, batches.get(0)).compile()
        if cfg.grad_sync.warmup_steps:
            wire = _steady_wire_bytes(cfg, m, ds, batches.get(0))
        else:
            record = loop.layout_record(engine, compiled, cfg)
            wire = sum(record["collective_bytes_per_step"].values())
        wire_none = wire_none or wire
        run = {
            "method": label,
            "grad_sync": fields,
            "train": train_fields,
            "wire_bytes_per_step": wire,
            "ratio": wire_none / wire,
            "baseline": base_label,
        }
        if steps > 0 and label == "none" and _BASE_LOSS.value > 0:
            losses_of[label] = _BASE_LOSS.value
            run.update(step_time_s=float("nan"), final_loss=_BASE_LOSS.value, loss_vs_baseline=0.0)
        elif steps > 0:
            step_time, final = _train_row(engine, compiled, batches, steps)
            losses_of[label] = final
            run.update(
                step_time_s=step_time,
                final_loss=final,
                loss_vs_baseline=final / losses_of[base_label] - 1,
            )
        out["runs"].append(run)
        timing = (
            f"{run['step_time_s'] * 1e3:>9.1f}{run['final_loss']:>9.3f}"
            f"{run['loss_vs_baseline']:>+9.1%}  {base_label}"
            if steps > 0
            else f"{'-':>9}{'-':>9}{'-':>9}"
        )
        print(f"{label:<16}{wire / 2**20:>10.3f}Mi{run['ratio']:>8.1f}{timing}", flush=True)
    if _BOUND.value is not None and steps > 0:
        out["max_loss_vs_baseline"] = _BOUND.value
        out["over_bound"] = [
            r["method"]
            for r in out["runs"]
            if r["method"] != r["baseline"] and r["loss_vs_baseline"] > _BOUND.value
        ]
    return out


def study_aggregation(config) -> dict:
    import aggregation_study

    return aggregation_study.run(
        config,
        parts=_PARTS.value,
        steps=_STEPS.value,
        warmup=_WARMUP.value,
        taus=[int(t) for t in _TAUS.value],
        target=_TARGET.value,
        max_steps=_MAX_STEPS.value,
        eval_every=_EVAL_EVERY.value,
        planner_config=_PLANNER_CONFIG.value,
        out_path=_OUT.value,
        rows=_rows(),
    )


def _rows() -> list[int] | None:
    if _ROWS.value is None:
        return None
    if not all(r.isdigit() and int(r) >= 1 for r in _ROWS.value):
        raise ConfigError(
            f"--rows={','.join(_ROWS.value)}: row numbers are whole numbers from 1 (e.g. --rows=1,3)"
        )
    return [int(r) for r in _ROWS.value]


_LINKS = flags.DEFINE_list(
    "links",
    ["rate=1gbit", "rate=50mbit"],
    "--study=network: --network values to run on; an inline link's fields after its rate=... "
    "join it (rate=50mbit,rate=50mbit,delay=5ms is two links).",
)
_NETWORK_STEPS = flags.DEFINE_integer("network_steps", 30, "--study=network: steps per run.")
_NETWORK_DEVICES = flags.DEFINE_integer(
    "network_devices",
    2,
    "--study=network: CPU devices per emulated host (jaxdist: one process with this many "
    "devices; DDP rows: this many processes per host).",
)


_NETWORK_HOSTS = flags.DEFINE_integer(
    "network_hosts", 2, "--study=network: emulated hosts (network namespaces) per run."
)


def study_network(config) -> dict:
    del config  # each row is its own launch of scripts/train.py
    import tempfile

    import network_study

    from jaxdist.network import profiles

    methods = _METHODS.value or list(network_study.METHODS)
    target = _TARGET.value if flags.FLAGS["target_loss"].present else None
    with tempfile.TemporaryDirectory(prefix="jaxdist-network-study-") as d:
        return network_study.run(
            profiles.group_links(_LINKS.value),
            methods,
            _NETWORK_STEPS.value,
            target,
            d,
            partial_path=_OUT.value,
            devices=_NETWORK_DEVICES.value,
            hosts=_NETWORK_HOSTS.value,
        )


def _contexts() -> list[int]:
    valid = ("1", "2", "4", "8")
    bad = [c for c in _CONTEXTS.value if c not in valid]
    if bad or not _CONTEXTS.value:
        raise ConfigError(
            f"--contexts={','.join(_CONTEXTS.value)}: each must divide the study's 8 devices; "
            f"valid: {', '.join(valid)} (e.g. --contexts=1,2,4,8)"
        )
    return [int(c) for c in _CONTEXTS.value]


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    from jaxdist import distributed, mesh, xla_flags

    config = _CONFIG.value
    xla_flags.apply(config.runtime.gpu_xla_flags, config.runtime.gpu_memory_fraction)
    spec = distributed.initialize()  # one process: nothing; under scripts/launch.py: joins the job
    mesh.configure_cpu_devices(config.runtime.cpu_devices)
    distributed.gc_after_imports()
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    studies = {
        "overhead": study_overhead,
        "compile": study_compile,
        "batch": study_batch,
        "moments": study_moments,
        "compression": study_compression,
        "aggregation": study_aggregation,
        "network": study_network,
        "fp8": study_fp8,
        "context": lambda c: bench_parallel.study_context(
            c, [int(t) for t in _LENGTHS.value], _STEPS.value, _WARMUP.value, _contexts()
        ),
        "moe": lambda c: bench_parallel.study_moe(
            c, [int(e) for e in _EXPERTS.value], _STEPS.value, _WARMUP.value
        ),
    }
    result = studies[_STUDY.value](config)
    if spec.process_id != 0:  # every process computed the same result; one writes it
        return
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {_OUT.value}")
    if result.get("over_bound"):
        print(
            f"check failed: {', '.join(result['over_bound'])} ended more than "
            f"{result['max_loss_vs_baseline']:.1%} above their baseline's loss "
            "(--max_loss_vs_baseline)",
            file=sys.stderr,
        )
        return 1
    return None


if __name__ == "__main__":
    benchlib.run_main(main)
