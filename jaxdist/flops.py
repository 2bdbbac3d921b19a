"""FLOPs and MFU: each device's dense peak, and model FLOPs utilization in one function.

The FLOPs a model family does per token come from the family itself (`models.api`, e.g. the
6N + 12LdT training estimate `decoder_flops_per_token`); this module only knows the devices.
"""

from __future__ import annotations

from typing import Any

from models.api import decoder_flops_per_token as model_flops_per_token

# Dense bf16 peak FLOP/s per device, keyed by a substring of `jax.Device.device_kind`. JAX reports
# TPU v5e as "TPU v5 lite", v5p as "TPU v5" and v6e as "TPU v6 lite"; the longest matching key wins.
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None on CPU and for devices not in ``PEAK_FLOPS``.

    Args:
      device: a ``jax.Device`` or its ``device_kind`` string.
    """
    if isinstance(device, str):
        kind = device
    else:
        if getattr(device, "platform", None) == "cpu":
            return None
        kind = getattr(device, "device_kind", "")
    matches = [key for key in PEAK_FLOPS if key.lower() in kind.lower()]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the devices' summed peak.

    Args:
      tokens_per_s: global training throughput, tokens per second.
      flops_per_token: from ``model_flops_per_token``.
      num_devices: devices the step runs on.
      peak: peak FLOP/s of one device (``peak_flops``).
    """
    if num_devices <= 0 or peak <= 0:
        raise ValueError(f"mfu needs num_devices > 0 and peak > 0, got {num_devices} and {peak}")
    return tokens_per_s * flops_per_token / (num_devices * peak)


__all__ = ["PEAK_FLOPS", "mfu", "model_flops_per_token", "peak_flops"]
