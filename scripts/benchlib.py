"""What the benchmark scripts share: timing, spread, the hand-written step they compare with, and
the GEMM census of a compiled HLO module.

No flags are defined here, so `bench.py` and `bench_gpu.py` can both import it.
"""

from __future__ import annotations

import re
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


# FP8 GEMMs as XLA's GPU backend emits them: cuBLASLt's FP8 matmul custom call (e4m3 / e5m2
# operands with their scales), or a Triton GEMM fusion whose dot takes FP8 operands (the autotuner
# picks Triton for some shapes: seen on jax 0.11.2 / H100 for gpt_1b's MLP down-projection).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion")


def _triton_gemms(hlo: str) -> tuple[int, int]:
    """(Triton GEMM fusions, those whose fused computation has a dot with an FP8 operand)."""
    f8_values = set(re.findall(r"%([\w.-]+) = f8e(?:4m3fn|5m2)\[", hlo))  # one pass, not per dot
    f8_dot_computations, name = set(), None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.-]+) \(.*\) -> .* \{$", line)
        if header:
            name = header.group(1)
        elif name and " dot(" in line:
            params = re.findall(r"%([\w.-]+)", line.split(" dot(", 1)[1].split(")", 1)[0])
            if f8_values.intersection(params):
                f8_dot_computations.add(name)
    total = f8 = 0
    for line in hlo.splitlines():
        if " fusion(" in line and any(f'"kind":"{k}"' in line for k in TRITON_GEMM_KINDS):
            total += 1
            called = re.search(r"calls=%([\w.-]+)", line)
            f8 += bool(called and called.group(1) in f8_dot_computations)
    return total, f8


def gemm_counts(hlo: str) -> dict[str, int]:
    """GEMMs in a compiled HLO module's text: FP8 cuBLASLt custom calls, the other cuBLAS GEMM
    custom calls, XLA's Triton GEMM fusions (and how many of them multiply FP8 operands), and
    FP8 GEMMs of either kind."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    fp8 = sum(t == FP8_GEMM_TARGET for t in targets)
    triton, triton_fp8 = _triton_gemms(hlo)
    return {
        "fp8_cublaslt": fp8,
        "cublas_other": sum(t in GEMM_TARGETS for t in targets),
        "triton_gemm": triton,
        "fp8_triton": triton_fp8,
        "fp8_gemms": fp8 + triton_fp8,
    }


def f8_census(hlo: str) -> dict[str, int]:
    """Instructions of a compiled HLO module whose result is FP8, by opcode (converts into FP8,
    fusions, custom calls, ...) and the instructions that take an FP8 operand: where the FP8
    values went when no FP8 GEMM came out."""
    made: dict[str, int] = {}
    used: dict[str, int] = {}
    f8 = re.compile(r"f8e(4m3fn|5m2)\[")
    rows = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%?[\w.-]+) = (.+?) ([a-z][\w-]*)\((.*)", line)
        if m:
            rows.append(m.groups())
    f8_names = {name.lstrip("%") for name, result, _, _ in rows if f8.search(result)}
    for _, result, op, operands in rows:
        if f8.search(result):
            made[op] = made.get(op, 0) + 1
        elif f8.search(operands) or any(
            n in f8_names for n in re.findall(r"%([\w.-]+)", operands.split("),", 1)[0])
        ):
            used[op] = used.get(op, 0) + 1
    return {"results": made, "consumers": used}
