"""Many `scripts/train.py` runs in one (multi-process) JAX job, one after another.

    python scripts/launch.py --num_processes=2 --devices_per_process=4 -- \
        python tests/multijob.py JOBS.json

JOBS.json is a list of {"workdir": DIR, "flags": ["--config.a.b=V", ...]}, optionally with
"emulated_hosts": H. Each job runs as `python scripts/train.py --workdir=DIR FLAGS` would: the
same config file and overrides, the same `loop.run` with the planner's check and layout extras,
so it writes the same metrics.jsonl, config.json and checkpoints. What the jobs share is what a
test paid once per launch before: the interpreter, the imports, `jax.distributed.initialize` and
the backend (tests/test_allreduce_multihost.py runs its 2-process checks as one launch).

With "emulated_hosts": H (one process) the job instead runs with `mesh.dcn_data` = H emulated
on one process and writes DIR/emulated.json (`emulate`).
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.py")


def job_config(flag_args: list[str]):
    """The config `scripts/train.py FLAG_ARGS` would run (ml_collections' own override parser)."""
    from absl import flags
    from ml_collections import config_flags

    from jaxdist import config as config_lib

    config_lib.check_override_names([a for a in flag_args if a.startswith("--config.")])
    values = flags.FlagValues()
    argv = ["multijob", *flag_args]
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def emulate(config, workdir: str, hosts: int) -> None:
    """`train.steps` steps of `config` on one process with its `mesh.dcn_data` = `hosts` hosts
    emulated, as scripts/aggregation_study.py runs them: the mesh is built without `dcn_data`
    (one process has no hosts to split), the engine with it (`hierarchical` reads its hosts from
    the field). Writes WORKDIR/emulated.json: the losses by step and the compiled step's phases
    with the devices of `data` split into `hosts` consecutive hosts (`emulated_hosts`)."""
    import jax
    import jax.numpy as jnp
    from aggregation_study import emulated_hosts

    from jaxdist import config as config_lib
    from jaxdist import data, hlo_cost, mesh, train

    config_lib.validate(config, jax.device_count())
    flat = {**config.mesh.to_dict(), "dcn_data": 1}
    m = mesh.make_mesh(flat)
    t = config.train
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    engine = train.build(config, m, ds)
    batches = data.Batches(
        ds,
        batch_size=t.batch_size,
        seq_len=config.model.seq_len,
        seed=t.seed,
        shardings=engine.batch_shardings,
    )
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32}
    abstract = engine.abstract_batch(batches.global_shapes(), dtypes)
    compiled = engine.train_step.lower(engine.abstract_state, abstract).compile()
    phases, busiest = hlo_cost.collective_phases(
        compiled.as_text(), mesh.mesh_shape(m), emulated_hosts(m, hosts)
    )
    state, losses = engine.init(), {}
    for step in range(t.steps):
        state, metrics = compiled(state, batches.get(step))
        losses[step + 1] = float(metrics["loss"])
    os.makedirs(workdir, exist_ok=True)
    out = {"losses": losses, "collective_phases": phases, "busiest_device_bytes_per_step": busiest}
    with open(os.path.join(workdir, "emulated.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)


def main(jobs_file: str) -> None:
    with open(jobs_file, encoding="utf-8") as f:
        jobs = json.load(f)
    configs = [job_config(j["flags"]) for j in jobs]
    from jaxdist import distributed, mesh

    distributed.initialize()
    mesh.configure_cpu_devices(configs[0].runtime.cpu_devices)
    from jaxdist import loop, plan

    for job, config in zip(jobs, configs, strict=True):
        if job.get("emulated_hosts"):
            emulate(config, job["workdir"], int(job["emulated_hosts"]))
            continue
        loop.run(
            config,
            job["workdir"],
            checks=[plan.refuse_if_far_over_memory],
            layout_extras=[plan.layout_prediction],
        )


if __name__ == "__main__":
    main(sys.argv[1])
