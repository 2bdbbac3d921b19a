"""The device mesh: six named axes sized from `config.mesh`.

Axis order is (data, fsdp, expert, context, tensor, pipeline) from slowest- to fastest-varying device
index, so `tensor`, the axis with the most traffic per step, spans neighbouring devices (NVLink / ICI),
`expert` all-to-alls and `context` ring hops stay close, and `data`, the axis with the least, spans
hosts when `dcn_*` sizes are set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxdist.errors import ConfigError
from jaxdist.recipes import accelerator_present  # noqa: F401 (re-exported: scripts ask the mesh)
from jaxdist.schema import MESH_AXES, resolve_mesh_shape


def configure_cpu_devices(n: int) -> None:
    """Simulates `n` CPU devices; must run before any JAX backend starts. 0 leaves JAX's default."""
    n = int(os.environ.get("JAXDIST_CPU_DEVICES", n) or 0)
    if n > 0:
        jax.config.update("jax_num_cpu_devices", n)


def check_backend(config) -> None:
    """Refuses, before anything compiles, settings the started backend cannot run.

    Raises:
      ConfigError: `model.attention='cudnn'` on devices that are not NVIDIA GPUs.
    """
    if config.model.get("attention") == "cudnn":
        platforms = sorted({d.platform for d in jax.devices()})
        if platforms != ["gpu"]:
            raise ConfigError(
                "model.attention='cudnn' needs NVIDIA GPUs with cuDNN, but this run's devices are "
                f"{'/'.join(platforms)}; use 'xla', or 'auto' (cuDNN flash attention where it applies)"
            )


def make_mesh(mesh_cfg: Mapping[str, Any], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the (data, fsdp, expert, context, tensor, pipeline) mesh.

    Args:
      mesh_cfg: `config.mesh`: a size per axis (one may be -1) and optional `dcn_<axis>` sizes, the
        part of each axis that spans hosts (processes) rather than devices within one.
      devices: defaults to all devices.

    Raises:
      ConfigError: sizes that do not multiply to the device count, or dcn sizes that do not match the
        number of processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    dcn = tuple(int(mesh_cfg.get(f"dcn_{a}", 1)) for a in MESH_AXES)
    if np.prod(dcn) > 1:
        num_hosts = len({d.process_index for d in devices})
        if np.prod(dcn) != num_hosts:
            raise ConfigError(
                "mesh.dcn_*: the dcn sizes multiply to "
                f"{int(np.prod(dcn))} but the devices span {num_hosts} processes; make them equal"
            )
        ici = tuple(s // d for s, d in zip(shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Axis → size for records and reports: data, fsdp, tensor, pipeline always; `expert` and
    `context` only where they are > 1 (a record of a run without them reads as before)."""
    return {
        name: int(size)
        for name, size in mesh.shape.items()
        if name in ("data", "fsdp", "tensor", "pipeline") or size > 1
    }
