"""Layouts: one way to run the step (mesh sizes, microbatching, remat), and every one a config allows."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable, Sequence

from jaxdist import config as config_lib
from jaxdist.errors import ConfigError
from jaxdist.plan.hardware import Hardware
from jaxdist.plan.model import model_info
from models.api import remat_names


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the step: mesh sizes, microbatching and remat policy."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    grad_accum: int = 1
    microbatches: int = 1  # pipeline microbatches (only read when pipeline > 1)
    remat: str = "none"
    expert: int = 1
    context: int = 1

    @property
    def mesh(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in config_lib.MESH_AXES}

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipeline * self.expert * self.context

    @property
    def name(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in config_lib.MESH_AXES if getattr(self, a) > 1]
        return "×".join(parts) or "single"

    @property
    def micro(self) -> str:
        """Microbatching in words: `accum 4`, `pp m=8`, or `1`."""
        out = []
        if self.grad_accum > 1:
            out.append(f"accum {self.grad_accum}")
        if self.pipeline > 1:
            out.append(f"pp m={self.microbatches}")
        return ", ".join(out) or "1"


def _set_fields(c, layout: Layout) -> None:
    for a in config_lib.MESH_AXES:
        c.mesh[a] = getattr(layout, a)
        c.mesh[f"dcn_{a}"] = 1
    c.train.grad_accum = layout.grad_accum
    c.train.remat = layout.remat
    c.pipeline.microbatches = layout.microbatches if layout.pipeline > 1 else 1


def layout_of(config, num_devices: int) -> Layout:
    """The layout a config asks for on `num_devices` (the `-1` axis resolved)."""
    mesh = config_lib.resolve_mesh_shape(config.mesh, num_devices)
    return Layout(
        **mesh,
        grad_accum=int(config.train.grad_accum),
        microbatches=int(config.pipeline.microbatches) if mesh["pipeline"] > 1 else 1,
        remat=str(config.train.remat),
    )


def factorizations(n: int, k: int) -> Iterable[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in factorizations(n // d, k - 1):
                yield (d, *rest)


def powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def mesh_shapes(config, n: int, context: bool) -> Iterable[tuple[int, ...]]:
    """(data, fsdp, tensor, pipeline, expert, context) with product n: `expert` over the divisors
    of model.num_experts, `context` over powers of two if the family runs context attention
    (`context`: its `PlanCost.context_parallel`); the rest all ordered factorizations of what is
    left."""
    m = config.model
    experts = int(m.get("num_experts", 0) or 0)
    expert_sizes = [e for e in range(1, experts + 1) if experts % e == 0] if experts else [1]
    context_sizes = powers_of_two(n) if context else [1]
    for e in expert_sizes:
        for c in context_sizes:
            if n % (e * c) == 0:
                for d, f, t, p in factorizations(n // (e * c), 4):
                    yield d, f, t, p, e, c


def enumerate_layouts(
    config,
    num_devices: int,
    *,
    remats: Sequence[str] | None = None,
    max_grad_accum: int = 16,
    max_microbatches: int = 64,
    pipeline: bool = True,
    context: bool | None = None,
) -> list[Layout]:
    """Every layout `jaxdist.config.validate` accepts for this config on `num_devices`.

    Mesh sizes are all ordered factorizations of the device count into (data, fsdp, tensor,
    pipeline), times `expert` and `context` sizes where the model has them (`mesh_shapes`);
    grad_accum runs over powers of two up to `max_grad_accum`; pipeline microbatches over
    p·2^k up to `max_microbatches`; remat over `remats` (default: every policy). Each candidate is
    set on one working copy of the config and checked by `validate` itself, so the planner accepts
    exactly what training accepts. `context`: whether the family runs context attention (None:
    ask its `PlanCost`).
    """
    remats = tuple(remats or remat_names())
    work = copy.deepcopy(config)
    if work.data.source not in ("stdlib", "digits"):
        work.data.source = "stdlib"  # the corpus is irrelevant to the layout; skip its file checks
    unknown = [r for r in remats if r not in remat_names()]
    if unknown:
        raise ConfigError(
            f"remat policies {unknown} are not valid; choose from {', '.join(remat_names())}"
        )
    if context is None:
        context = model_info(config).cost.context_parallel
    out = []
    for d, f, t, p, e, c in mesh_shapes(config, num_devices, context):
        if p > 1 and not pipeline:
            continue
        accums = powers_of_two(max_grad_accum) if p == 1 else [1]
        for accum in accums:
            mbs = [p * k for k in powers_of_two(max(1, max_microbatches // p))] if p > 1 else [1]
            for mb in mbs:
                # remat changes no divisibility rule: one validate per (mesh, accum, microbatches)
                _set_fields(work, Layout(d, f, t, p, accum, mb, remats[0], e, c))
                try:
                    config_lib.validate(work, num_devices)
                except ConfigError:
                    continue
                out.extend(Layout(d, f, t, p, accum, mb, remat, e, c) for remat in remats)
    return out


def hosts_of(layout: Layout, hw: Hardware) -> tuple[dict[str, int], dict[str, int]]:
    """(devices of each axis inside one host, hosts each axis spans). Axes are laid out data
    (slowest) → pipeline (fastest), as `jaxdist.mesh.make_mesh` does, so hosts cut the slow axes."""
    local, stride = {}, 1
    for a in reversed(config_lib.MESH_AXES):
        n = getattr(layout, a)
        room = hw.devices_per_host // stride if stride < hw.devices_per_host else 1
        local[a] = math.gcd(n, max(room, 1))
        stride *= n
    return local, {a: getattr(layout, a) // local[a] for a in config_lib.MESH_AXES}
