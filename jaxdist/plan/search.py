"""The layout search: predict every valid layout for a device count, rank them, recommend one; weak scaling."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jaxdist import config as config_lib
from jaxdist.errors import ConfigError
from jaxdist.plan.hardware import GiB, Hardware, hardware
from jaxdist.plan.layouts import Layout, enumerate_layouts, hosts_of, mesh_shapes, powers_of_two
from jaxdist.plan.model import ModelInfo, model_info
from jaxdist.plan.predict import Prediction, predict
from models.api import remat_names


@dataclasses.dataclass
class Plan:
    """Every valid layout for one model on one cluster, ranked: fitting ones first, then by step
    time, then by communication time, then by memory; `recommended` is the first that fits, or
    None if none does."""

    num_devices: int
    hardware: Hardware
    model: dict[str, Any]
    predictions: list[Prediction]
    rejected: int  # candidates `config.validate` refused

    @property
    def recommended(self) -> Prediction | None:
        return next((p for p in self.predictions if p.fits), None)

    def table(self, top: int | None = 10) -> str:
        """The ranked layouts as a text table (at most `top` rows; None = all)."""
        rows = self.predictions if top is None else self.predictions[:top]
        head = (
            f"{'#':>3}  {'layout':<34} {'micro':<14} {'remat':<13} {'mem/device':>10} "
            f"{'fits':<4} {'step (s)':>9} {'tokens/s':>10} {'MFU':>6}"
        )
        lines = [head, "-" * len(head)]
        for i, p in enumerate(rows, 1):
            lines.append(
                f"{i:>3}  {p.layout.name:<34} {p.layout.micro:<14} {p.layout.remat:<13} "
                f"{p.memory['total'] / GiB:>6.2f} GiB {'yes' if p.fits else 'NO':<4} "
                f"{p.step_s:>9.4f} {p.tokens_per_s:>10.4g} {100 * p.mfu:>5.1f}%"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        best = self.recommended
        hw = self.hardware
        fitting = sum(p.fits for p in self.predictions)
        head = (
            f"{self.model['params'] / 1e9:.3g}B-parameter {self.model['label']} on "
            f"{self.num_devices} × {hw.name} "
            f"({hw.memory_bytes / GiB:.0f} GiB/device, {hw.devices_per_host}/host): "
            f"{len(self.predictions)} valid layouts, {fitting} fit"
        )
        if best is None:
            return head + "\nno layout fits in memory: use more devices, remat, or a smaller batch"
        return head + (
            f"\nrecommended: {best.layout.name} ({best.layout.micro}, remat={best.layout.remat}): "
            f"{best.memory['total'] / GiB:.2f} GiB/device, {best.step_s:.4f} s/step, "
            f"{best.tokens_per_s:.4g} tokens/s, MFU {100 * best.mfu:.1f}%"
            f"\n  flags: {config_flags_for(best.layout, hw)}"
        )

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        rows = self.predictions if top is None else self.predictions[:top]
        best = self.recommended
        return {
            "devices": self.num_devices,
            "hardware": dataclasses.asdict(self.hardware),
            "model": self.model,
            "valid_layouts": len(self.predictions),
            "fitting_layouts": sum(p.fits for p in self.predictions),
            "rejected_by_validate": self.rejected,
            "recommended": None if best is None else best.to_json(),
            "recommended_flags": None
            if best is None
            else config_flags_for(best.layout, self.hardware),
            "ranked": [p.to_json() for p in rows],
        }


def config_flags_for(layout: Layout, hw: Hardware) -> str:
    """The `--config.*` overrides that run `layout` (dcn sizes where an axis spans hosts)."""
    _, hosts = hosts_of(layout, hw)
    parts = [f"--config.mesh.{a}={getattr(layout, a)}" for a in config_lib.MESH_AXES]
    parts += [f"--config.mesh.dcn_{a}={h}" for a, h in hosts.items() if h > 1]
    parts.append(f"--config.train.grad_accum={layout.grad_accum}")
    parts.append(f"--config.train.remat={layout.remat}")
    if layout.pipeline > 1:
        parts.append(f"--config.pipeline.microbatches={layout.microbatches}")
    return " ".join(parts)


def _rank_key(p: Prediction) -> tuple:
    # Ties in step time (all communication hidden under compute) go to the layout that
    # communicates least, which leaves the most slack if overlap is worse than modelled.
    return (not p.fits, p.step_s, p.comm_s, p.memory["total"])


def plan(
    config,
    num_devices: int,
    hw: str | Hardware,
    *,
    remats: Sequence[str] | None = None,
    max_grad_accum: int = 16,
    max_microbatches: int = 64,
    compression_ratio: float = 1.0,
    model: ModelInfo | None = None,
) -> Plan:
    """Predicts every valid layout of `config` on `num_devices` devices of `hw` and ranks them.

    Raises:
      ConfigError: the family declares no `plan_cost`, or no layout passes `config.validate`.
    """
    hw = hardware(hw)
    if num_devices < 1:
        raise ConfigError(f"devices={num_devices} must be >= 1")
    model = model or model_info(config)
    total = sum(
        1
        for _ in _candidates(
            config, num_devices, max_grad_accum, max_microbatches, remats, model.cost
        )
    )
    layouts = enumerate_layouts(
        config,
        num_devices,
        remats=remats,
        max_grad_accum=max_grad_accum,
        max_microbatches=max_microbatches,
        context=model.cost.context_parallel,
    )
    if not layouts:
        raise ConfigError(
            f"no (data, fsdp, tensor, pipeline, expert, context) layout of {num_devices} devices "
            "is valid for this "
            f"config (train.batch_size={config.train.batch_size}, model.d_model="
            f"{model.d_model}, model.num_layers={model.num_layers}); "
            "change the batch size or the device count"
        )
    preds = [
        predict(config, lay, hw, model=model, compression_ratio=compression_ratio)
        for lay in layouts
    ]
    preds.sort(key=_rank_key)
    info = {
        "params": model.num_params,
        "layers": model.num_layers,
        "d_model": model.d_model,
        "family": model.family,
        "label": model.cost.label,
        "vocab": model.vocab_size,
        "seq_len": model.seq_len,
        "global_batch": int(config.train.batch_size),
        "compute_dtype": str(config.train.compute_dtype),
        "optimizer": str(config.train.optimizer),
        "flops_per_token": model.flops_per_token(),
    }
    return Plan(num_devices, hw, info, preds, total - len(layouts))


def _candidates(config, n: int, max_accum: int, max_mb: int, remats, cost) -> Iterable[tuple]:
    remats = tuple(remats or remat_names())
    for _, _, _, p, _, _ in mesh_shapes(config, n, cost.context_parallel):
        accums = len(powers_of_two(max_accum)) if p == 1 else 1
        mbs = len(powers_of_two(max(1, max_mb // p))) if p > 1 else 1
        for _ in range(accums * mbs * len(remats)):
            yield ()


SCALING_DEVICES = tuple(2**k for k in range(3, 13))  # 8 … 4096


def scaling(
    config,
    hw: str | Hardware,
    *,
    device_counts: Sequence[int] = SCALING_DEVICES,
    per_device_batch: int = 1,
    model: ModelInfo | None = None,
    max_grad_accum: int = 4,
    max_microbatches: int = 32,
) -> list[dict[str, Any]]:
    """Weak scaling: the best fitting layout at each device count, global batch = devices ×
    `per_device_batch` sequences.

    Efficiency at n devices is tokens/s per device relative to the smallest count's. Counts where
    nothing fits (or nothing is valid) are reported with `layout: None`.
    """
    hw = hardware(hw)
    model = model or model_info(config)
    work = copy.deepcopy(config)
    out: list[dict[str, Any]] = []
    base = None
    for n in device_counts:
        work.train.batch_size = n * per_device_batch
        try:
            pl = plan(
                work,
                n,
                hw,
                model=model,
                max_grad_accum=max_grad_accum,
                max_microbatches=max_microbatches,
            )
            best = pl.recommended
        except ConfigError:
            best = None
        row: dict[str, Any] = {"devices": n, "global_batch": n * per_device_batch}
        if best is None:
            row.update(layout=None, efficiency=None, mfu=None)
        else:
            per_dev = best.tokens_per_s / n
            base = base or per_dev
            row.update(
                layout=best.layout.name,
                micro=best.layout.micro,
                remat=best.layout.remat,
                step_time_s=best.step_s,
                tokens_per_s=best.tokens_per_s,
                mfu=best.mfu,
                memory_gib=best.memory["total"] / GiB,
                efficiency=per_dev / base,
            )
        out.append(row)
    return out
