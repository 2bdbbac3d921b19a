"""Pipeline schedules side by side: lock-step cost, per-device temp memory, collectives, step time.

    python scripts/bench_pipeline.py                       # p=4, m in 4 8 16 32, all schedules
    python scripts/bench_pipeline.py --ms=4,8 --schedules=1f1b --out=runs/bench/pipe.json

The microbatch size is fixed, so the global batch grows with m. On a CPU-only machine it simulates
the devices it needs. Prints a markdown table and writes the rows as JSON.

The lock-step cost is read from the compiled step (`jaxdist.pipeline.cost`): the sum over ticks of
the slowest stage's dot FLOPs, plus the work outside the tick loop, against the ideal (the
unpipelined model's FLOPs / devices). It is what a real pipeline's time follows, unlike the step
time on simulated CPU devices, which measures the total work of all stages on shared cores.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_P = flags.DEFINE_integer("p", 4, "Pipeline stages (mesh.pipeline).")
_DATA = flags.DEFINE_integer("data", 1, "Data-parallel replicas (mesh.data).")
_FSDP = flags.DEFINE_integer("fsdp", 1, "FSDP shards (mesh.fsdp).")
_ONCE = flags.DEFINE_bool(
    "fsdp_gather_once", False, "pipeline.fsdp_gather_once: FSDP weights gathered once per step."
)
_MS = flags.DEFINE_list("ms", ["4", "8", "16", "32"], "Microbatch counts.")
_SCHEDULES = flags.DEFINE_list("schedules", None, "Schedules (default: every pipeline.SCHEDULES).")
_V = flags.DEFINE_integer("virtual_stages", 2, "Virtual stages for interleaved.")
_MB = flags.DEFINE_integer("microbatch_size", 1, "Examples per microbatch per replica.")
_LAYERS = flags.DEFINE_integer("num_layers", 8, "GPT layers.")
_D = flags.DEFINE_integer("d_model", 128, "GPT width.")
_T = flags.DEFINE_integer("seq_len", 128, "Sequence length.")
_REMAT = flags.DEFINE_string("remat", "none", "train.remat.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per row (median).")
_OUT = flags.DEFINE_string("out", "runs/bench/pipeline.json", "JSON results file.")


def pipeline_table(
    p: int = 4,
    ms: Sequence[int] = (4, 8, 16, 32),
    schedules: Sequence[str] | None = None,
    *,
    steps: int = 3,
    **shape: Any,
) -> list[dict[str, Any]]:
    """Compiles and times the train step of a small GPT for every (schedule, m) on p stages.

    The microbatch size is fixed, so the global batch grows with m: 1f1b's temp memory should stay
    flat while gpipe's grows. Needs p · data · fsdp devices (simulated CPU devices are fine). `schedules`:
    names from `jaxdist.pipeline.SCHEDULES`, all of them when None. `shape`: the keyword
    arguments of `_config` (virtual_stages, microbatch_size, num_layers, d_model, seq_len, data,
    remat, fsdp, fsdp_gather_once).

    Returns:
      One dict per (schedule, m): `temp_bytes` per device (compiled memory analysis),
      `bubble_fraction` (schedule tables), the lock-step cost (`lockstep_flops`, `ideal_flops`,
      `lockstep_vs_ideal`, `branch_flops` for switching schedules; `jaxdist.pipeline.cost`),
      `collective_bytes` (kind -> bytes per device per step) and `all_reduces` (all-reduce
      executions per step) from the HLO, `step_time_s` (median of `steps` timed steps after one
      warm-up; none when `steps` is 0), `ticks`, `batch_size`, `tokens_per_s`.
    """
    from jaxdist import pipeline

    return [
        _row(_config(p, m, name, **shape), steps)
        for name in schedules or pipeline.SCHEDULES
        for m in ms
    ]


def _config(
    p: int,
    m: int,
    schedule: str,
    *,
    virtual_stages: int = 2,
    microbatch_size: int = 1,
    num_layers: int = 8,
    d_model: int = 128,
    seq_len: int = 128,
    data: int = 1,
    remat: str = "none",
    fsdp: int = 1,
    fsdp_gather_once: bool = False,
):
    """The benchmark's config: a GPT on p stages × data × fsdp, m microbatches of fixed size."""
    from jaxdist import config as config_lib

    c = config_lib.base_config()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = 1
    c.mesh.pipeline, c.mesh.data, c.mesh.fsdp = p, data, fsdp
    c.model.update(num_layers=num_layers, d_model=d_model, num_heads=4, seq_len=seq_len)
    c.train.batch_size = m * microbatch_size * data * fsdp
    c.train.remat = remat
    c.data.max_bytes = 400_000
    c.pipeline.update(schedule=schedule, microbatches=m, virtual_stages=virtual_stages)
    c.pipeline.fsdp_gather_once = fsdp_gather_once
    return c


def _row(c, steps: int) -> dict[str, Any]:
    """One `pipeline_table` row: compile the train step of config `c`, read it, time it."""
    import jax

    from jaxdist import config as config_lib
    from jaxdist import data as data_lib
    from jaxdist import mesh as mesh_lib
    from jaxdist import metrics, pipeline, train

    devices = jax.devices()[: c.mesh.pipeline * c.mesh.data * c.mesh.fsdp]
    config_lib.validate(c, len(devices))
    seq_len = c.model.seq_len
    ds = data_lib.load(c.data, seq_len=seq_len, vocab_size=c.model.vocab_size)
    eng = train.build(c, mesh_lib.make_mesh(c.mesh, devices=devices), ds)
    batches = data_lib.Batches(
        ds, batch_size=c.train.batch_size, seq_len=seq_len, seed=0, shardings=eng.batch_shardings
    )
    batch, state = batches.get(0), eng.init()
    compiled = eng.train_step.lower(state, batch).compile()
    text = compiled.as_text()
    times = []
    for k in range(steps + 1 if steps else 0):
        t0 = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(out)
        if k:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    step = statistics.median(times) if times else float("nan")
    ops = metrics.collective_ops(text)
    return {
        "schedule": c.pipeline.schedule,
        "stages": c.mesh.pipeline,
        "microbatches": c.pipeline.microbatches,
        "virtual_stages": eng.schedule.virtual_stages,
        "batch_size": c.train.batch_size,
        "ticks": eng.schedule.ticks,
        "bubble_fraction": eng.schedule.bubble_fraction,
        "remat": c.train.remat,
        "fsdp": c.mesh.fsdp,
        "fsdp_gather_once": c.pipeline.fsdp_gather_once,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        **pipeline.step_cost(eng, compiled),
        "collective_bytes": metrics.collective_bytes(text),
        "all_reduces": sum(o.count for o in ops if o.kind == "all-reduce"),
        "step_time_s": step,
        "tokens_per_s": c.train.batch_size * seq_len / step,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `pipeline_table` rows: each schedule's memory relative to its first m, its
    lock-step cost relative to the ideal and to gpipe's at the same m (when gpipe was run)."""
    base, gpipe = {}, {}
    for r in rows:
        base.setdefault(r["schedule"], r["temp_bytes"])
        if r["schedule"] == "gpipe":
            gpipe[r["microbatches"]] = r["lockstep_flops"]
    lines = [
        "| schedule | m | ticks | bubble | lock-step / ideal | vs gpipe | temp / device | vs first m "
        "| wire / step | all-reduces | step time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_gpipe = (
            r["lockstep_flops"] / gpipe[r["microbatches"]] if r["microbatches"] in gpipe else None
        )
        lines.append(
            f"| {r['schedule']}{' v=' + str(r['virtual_stages']) if r['virtual_stages'] > 1 else ''}"
            f" | {r['microbatches']} | {r['ticks']} | {r['bubble_fraction']:.3f}"
            f" | {r['lockstep_vs_ideal']:.2f} | {'' if vs_gpipe is None else f'{vs_gpipe:.2f}×'}"
            f" | {r['temp_bytes'] / 2**20:.2f} MiB | {r['temp_bytes'] / base[r['schedule']]:.2f}×"
            f" | {sum(r['collective_bytes'].values()) / 2**20:.2f} MiB | {r['all_reduces']}"
            f" | {r['step_time_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    from jaxdist import mesh as mesh_lib

    if not mesh_lib.accelerator_present():
        mesh_lib.configure_cpu_devices(max(8, _P.value * _DATA.value * _FSDP.value))
    rows = pipeline_table(
        _P.value,
        [int(m) for m in _MS.value],
        _SCHEDULES.value,
        virtual_stages=_V.value,
        microbatch_size=_MB.value,
        num_layers=_LAYERS.value,
        d_model=_D.value,
        seq_len=_T.value,
        steps=_STEPS.value,
        data=_DATA.value,
        remat=_REMAT.value,
        fsdp=_FSDP.value,
        fsdp_gather_once=_ONCE.value,
    )
    print(format_table(rows))
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
