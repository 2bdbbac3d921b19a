"""What the benchmark scripts share: timing, spread, and the hand-written step they compare with.

No flags are defined here, so `bench.py` and `bench_gpu.py` can both import it.
"""

from __future__ import annotations

import statistics
import sys
import time


def timed(fn, state, batch, steps: int, warmup: int):
    """Runs `fn(state, batch)` `warmup` times untimed, then `steps` times, each step synchronised.

    Returns the final state and the wall time of each timed step in seconds.
    """
    import jax

    m = None
    for _ in range(warmup):
        state, m = fn(state, batch)
    jax.block_until_ready((state, m))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = fn(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    return state, times


def stats(times: list[float]) -> dict[str, float]:
    """Median and 10th/90th percentile of step times (seconds)."""
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_s": statistics.median(times), "p10_s": q[0], "p90_s": q[-1], "n": len(times)}


def build(config, m, ds):
    """Validates `config` and builds its Engine and deterministic batches on mesh `m`."""
    import jax

    from jaxdist import config as config_lib
    from jaxdist import data, mesh, train

    config_lib.validate(config, jax.device_count())
    mesh.check_backend(config)
    engine = train.build(config, m, ds)
    batches = data.Batches(
        ds,
        batch_size=config.train.batch_size,
        seq_len=config.model.seq_len,
        seed=0,
        shardings=engine.batch_shardings,
        packing=config.data.packing,
    )
    return engine, batches


def hand_written_step(engine):
    """The same model and optimizer as plain JAX: cast to the compute dtype, value_and_grad with the
    same remat policy, optax update, jit with donation. No accumulation, guard or metrics."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist import sharding

    mesh, shardings, t = engine.mesh, engine.state_shardings, engine.config.train
    dtype = jnp.dtype(t.compute_dtype)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def loss_fn(params, batch):
        with sharding.activation_rules(mesh):
            model = engine.merge(jax.tree.map(cast, params))
            return model.loss(batch, remat=t.remat)[0]

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = engine.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return jax.jit(
        step,
        in_shardings=(shardings, engine.batch_shardings),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def run_main(main) -> None:
    """`absl.app.run(main)`, with a `ConfigError` printed as one `error:` line and exit code 2."""
    from absl import app

    from jaxdist.errors import run_command

    sys.exit(run_command(app.run, main))
