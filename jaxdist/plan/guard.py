"""The memory guard the training loop calls: refuse a run far over device memory, and the layout record's prediction."""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxdist.errors import ConfigError
from jaxdist.plan.hardware import GiB
from jaxdist.plan.model import not_modelled
from jaxdist.plan.predict import predict

REFUSE_FACTOR = 1.5  # refuse a run whose predicted peak exceeds this multiple of device memory


def device_memory_bytes() -> tuple[float, str] | None:
    """Memory of one local device (bytes) and where the figure comes from; None if unknown.

    An accelerator reports its own limit (`memory_stats()["bytes_limit"]`). CPU devices share the
    host's physical memory (`os.sysconf`), so each simulated CPU device gets its share of it.
    """
    devices = jax.local_devices()
    if devices[0].platform == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
        n = len(devices)
        share = f" / {n} CPU devices" if n > 1 else ""
        return host / n, f"host memory {host / GiB:.1f} GiB{share}"
    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        return None
    return (float(limit), f"{devices[0].device_kind} memory") if limit else None


def layout_prediction(config, engine) -> dict[str, Any]:
    """The planner's per-device memory for the `layout` record (`predicted_bytes_per_device`).

    Every family that declares its accounting (`models.api.PlanCost`) is modelled; for one that
    does not, the record's `planner` line says so. Local SGD keeps an outer state plus a copy of
    the model and optimizer per replica, which the planner does not model: no prediction then.
    """
    if "local" in engine.abstract_state:
        return {}
    if (why := not_modelled(config.model.name)) is not None:
        return {"planner": why}
    predicted = predict(config, num_devices=engine.mesh.size).memory
    return {
        "predicted_bytes_per_device": {
            k: int(predicted[k]) for k in ("params", "opt_state", "temp")
        }
    }


def refuse_if_far_over_memory(config, num_devices: int, factor: float = REFUSE_FACTOR) -> None:
    """ConfigError when the predicted per-device peak is over `factor` × the device's memory.

    Runs before anything is built or compiled, so an impossible run costs seconds and leaves
    nothing behind. A family without `PlanCost` is not modelled (it passes; the `layout`
    record's planner line says so), nor are local SGD's per-replica copies (it passes too).
    """
    if not_modelled(config.model.name) is not None or config.grad_sync.local_steps != 1:
        return
    device = device_memory_bytes()
    if device is None:
        return
    capacity, source = device
    memory = predict(config, num_devices=num_devices).memory
    total = memory["total"]
    if total <= factor * capacity:
        return
    m = config.model
    raise ConfigError(
        f"predicted memory per device {total / GiB:.1f} GiB (params {memory['params'] / GiB:.1f}, "
        f"optimizer {memory['opt_state'] / GiB:.1f}, temp {memory['temp'] / GiB:.1f} GiB; "
        f"jaxdist/plan/) is {total / capacity:.1f}× the {capacity / GiB:.1f} GiB of one device "
        f"({source}), over the {factor}× limit; make the model smaller (model.vocab_size="
        f"{m.vocab_size}, model.d_model={m.d_model}, model.num_layers={m.num_layers}, "
        f"model.seq_len={m.seq_len}), train.batch_size={config.train.batch_size} smaller, or "
        "shard over more devices (mesh.fsdp, mesh.tensor)"
    )
