"""The `layout` record: what the compiled train step is and costs per device.

Memory from `compiled.memory_analysis()`, collective bytes and phases from the compiled HLO
(`jaxdist.metrics`, `jaxdist.hlo_cost`), the pipeline's lock-step cost, tokens and FLOPs per step:
written once per run to `metrics.jsonl` (and again when a resumed run's program changed).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist import hlo_cost, metrics, pipeline, train
from jaxdist import mesh as mesh_lib


def layout_record(engine: train.Engine, compiled, config) -> dict[str, Any]:
    """What the compiled step costs per device: memory (memory_analysis) and collective bytes (HLO)."""
    st = engine.abstract_state
    mem = compiled.memory_analysis()
    local_steps = config.grad_sync.local_steps if "local" in st else 1
    shard_bytes = lambda tree: sum(
        int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )
    hlo_text = compiled.as_text()  # one text, read once by the questions below
    processes = [d.process_index for d in engine.mesh.devices.flat]
    phases, busiest = metrics.collective_phases(
        hlo_text,
        mesh_lib.mesh_shape(engine.mesh),
        processes,
        conditional_period=local_steps,
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
            hlo_text, conditional_period=local_steps
        ),
        # Per phase (kind × mesh axes × tier): op executions per step and the busiest device's
        # sent + received bytes (a parameter server's hot spot); their per-step total below.
        "collective_phases": phases,
        "busiest_device_bytes_per_step": busiest,
        **_cross_process(hlo_text, processes, local_steps),
        "global_batch": config.train.batch_size,
        "grad_accum": config.train.grad_accum,
        "compute_dtype": config.train.compute_dtype,
        "remat": config.train.remat,
    }
    # compressor / local SGD / staleness / streaming DiLoCo state
    for key in ("grad_sync", "local", "in_flight", "outer_pending"):
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
        # The table bubble assumes unit-time ticks; the lock-step cost is what the program runs.
        record["pipeline"] = {**engine.schedule.describe(), **pipeline.step_cost(engine, compiled)}
        record["bubble_fraction"] = engine.schedule.bubble_fraction
    family = engine.family
    if family.tokens_per_example is not None:
        tokens = family.tokens_per_example(config.model)
        record["tokens_per_step"] = config.train.batch_size * tokens
    if family.flops_per_token is not None:
        record["flops_per_token"] = family.flops_per_token(config.model, st["params"])
    return record


def _cross_process(hlo_text: str, processes: list[int], local_steps: int) -> dict[str, Any]:
    """What each process sends to other processes per step (its host's link, one process per
    host), in bytes and in gloo's messages; and, where it differs, the same with each
    conditional's cheapest branch (e.g. 1-bit Adam's compressed exchange once its full-precision
    warm-up branch is no longer taken)."""
    sent, messages = hlo_cost.cross_host_traffic(hlo_text, processes, local_steps)
    out: dict[str, Any] = {
        "cross_process_bytes_per_step": sent,
        "cross_process_messages_per_step": messages,
    }
    cheap = hlo_cost.cross_host_traffic(hlo_text, processes, local_steps, "cheapest")
    if cheap[0] != sent:
        out["cross_process_cheapest_branch"] = {
            "bytes_per_step": cheap[0],
            "messages_per_step": cheap[1],
        }
    return out


def layout_changed(workdir: str, record: dict[str, Any]) -> bool:
    """Whether a resumed run's program differs from the last `layout` record (an elastic restart on
    fewer devices, another mesh): it then gets a record of its own."""
    last = None
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            for line in f:
                if '"kind": "layout"' in line:
                    last = json.loads(line)
    except (OSError, json.JSONDecodeError):
        return True
    keys = ("mesh", "devices", "processes", "bytes_per_device", "collective_bytes_per_step")
    return last is None or any(last.get(k) != record.get(k) for k in keys)
