"""Many `scripts/train.py` runs in one (multi-process) JAX job, one after another.

    python scripts/launch.py --num_processes=2 --devices_per_process=4 -- \
        python tests/multijob.py JOBS.json

JOBS.json is a list of {"workdir": DIR, "flags": ["--config.a.b=V", ...]}, optionally with
"emulated_hosts": H or "first_gradient": true. Each job runs as `python scripts/train.py --workdir=DIR FLAGS` would: the
same config file and overrides, the same `loop.run` with the planner's check and layout extras,
so it writes the same metrics.jsonl, config.json and checkpoints. What the jobs share is what a
test paid once per launch before: the interpreter, the imports, `jax.distributed.initialize` and
the backend (tests/test_allreduce_multihost.py runs its 2-process checks as one launch).

With "emulated_hosts": H (one process) the job instead runs with `mesh.dcn_data` = H emulated
on one process and writes DIR/emulated.json (`emulate`); with "first_gradient" it runs one step
of the same compiled train step and writes only step 0's reduced gradient, DIR/in_flight.npz
(`first_gradient`): no evaluation, no checkpoint, whose compiles (orbax's per-array slices)
cost more than the step.
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


def compiled_step(config, mesh_cfg):
    """(engine, batches, compiled train step) of `config` on the mesh `mesh_cfg` describes, built
    as `loop.run` builds them (no checkpointer, no evaluation)."""
    import jax
    import jax.numpy as jnp

    from jaxdist import config as config_lib
    from jaxdist import data, mesh, train

    config_lib.validate(config, jax.device_count())
    t = config.train
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    engine = train.build(config, mesh.make_mesh(mesh_cfg), ds)
    batches = data.Batches(
        ds,
        batch_size=t.batch_size,
        seq_len=config.model.seq_len,
        seed=t.seed,
        shardings=engine.batch_shardings,
    )
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32}
    abstract = engine.abstract_batch(batches.global_shapes(), dtypes)
    return engine, batches, engine.train_step.lower(engine.abstract_state, abstract).compile()


def emulate(config, workdir: str, hosts: int) -> None:
    """`train.steps` steps of `config` on one process with its `mesh.dcn_data` = `hosts` hosts
    emulated, as scripts/aggregation_study.py runs them: the mesh is built without `dcn_data`
    (one process has no hosts to split), the engine with it (`hierarchical` reads its hosts from
    the field). Writes WORKDIR/emulated.json: the losses by step and the compiled step's phases
    with the devices of `data` split into `hosts` consecutive hosts (`emulated_hosts`)."""
    from aggregation_study import emulated_hosts

    from jaxdist import hlo_cost, mesh

    engine, batches, compiled = compiled_step(config, {**config.mesh.to_dict(), "dcn_data": 1})
    m = engine.mesh
    phases, busiest = hlo_cost.collective_phases(
        compiled.as_text(), mesh.mesh_shape(m), emulated_hosts(m, hosts)
    )
    state, losses = engine.init(), {}
    for step in range(config.train.steps):
        state, metrics = compiled(state, batches.get(step))
        losses[step + 1] = float(metrics["loss"])
    os.makedirs(workdir, exist_ok=True)
    out = {"losses": losses, "collective_phases": phases, "busiest_device_bytes_per_step": busiest}
    with open(os.path.join(workdir, "emulated.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)


def first_gradient(config, workdir: str) -> None:
    """Step 0's reduced gradient: one step with `grad_sync.staleness` = 1 leaves it in flight.
    Process 0 writes it as WORKDIR/in_flight.npz, keyed by checkpoint path (`in_flight/...`, what
    `checkpoint.read_arrays(prefix="in_flight")` of a checkpoint after that step gives)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxdist import checkpoint

    assert config.grad_sync.staleness == 1, "first_gradient needs grad_sync.staleness=1"
    engine, batches, compiled = compiled_step(config, config.mesh)
    state, _ = compiled(engine.init(), batches.get(0))
    in_flight = multihost_utils.process_allgather(engine.to_user(state)["in_flight"], tiled=True)
    flat = jax.tree_util.tree_flatten_with_path(in_flight)[0]
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        arrays = {checkpoint.path_str(("in_flight", *kp)): np.asarray(x) for kp, x in flat}
        np.savez(os.path.join(workdir, "in_flight.npz"), **arrays)


def main(jobs_file: str) -> None:
    with open(jobs_file, encoding="utf-8") as f:
        jobs = json.load(f)
    configs = [job_config(j["flags"]) for j in jobs]
    from jaxdist import distributed, mesh

    distributed.initialize()
    mesh.configure_cpu_devices(configs[0].runtime.cpu_devices)
    from jaxdist import loop, plan

    distributed.gc_after_imports()  # as scripts/train.py does once its imports are done
    for job, config in zip(jobs, configs, strict=True):
        if job.get("emulated_hosts"):
            emulate(config, job["workdir"], int(job["emulated_hosts"]))
        elif job.get("first_gradient"):
            first_gradient(config, job["workdir"])
        else:
            loop.run(
                config,
                job["workdir"],
                checks=[plan.refuse_if_far_over_memory],
                layout_extras=[plan.layout_prediction],
            )


if __name__ == "__main__":
    main(sys.argv[1])
