"""What a compressor is: a `CompressorSpec` (its fields, abilities, checks and planner costs).

Every `grad_sync.compression` name is one frozen `CompressorSpec`, declared next to its code (one
file per method family) and listed once in `registry.py`. Everything else asks the spec:
`config.validate` (through `registry.check`) its fields and abilities, the strategies its
preconditioner, `allreduce` its per-hop codec, the planner its cost hooks, and the tests in
tests/test_compression_registry.py run every registered spec through the same checks.

Field defaults and rules live in one table, jaxdist/compression_fields.py (the config schema builds
its `grad_sync` defaults from it): a spec names the fields it reads, `field` reads them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import optax

from jaxdist import hlo_cost
from jaxdist.compression.replica import AxisName
from jaxdist.compression_fields import COMPRESSION_FIELDS


def field(grad_sync_cfg: Any, name: str) -> Any:
    """A compressor's `grad_sync` field from a ConfigDict or a plain dict, with its default
    (jaxdist/compression_fields.py).

    Raises:
      KeyError: `name` is not in `COMPRESSION_FIELDS`.
    """
    if isinstance(grad_sync_cfg, dict):
        return grad_sync_cfg.get(name, COMPRESSION_FIELDS[name].default)
    return getattr(grad_sync_cfg, name, COMPRESSION_FIELDS[name].default)


class TrainFields(NamedTuple):
    """The `train` fields a compressor reads (its momentum or Adam betas) and the layer axes."""

    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.95
    batch_dims: Any = None


class Codec(NamedTuple):
    """What one hop of a compressed ring puts on the wire (jaxdist/allreduce.py `ring_per_hop`)."""

    encode: Callable[[jax.Array], jax.Array]  # f32 [k] -> the payload
    decode: Callable[[jax.Array, int], jax.Array]  # (the payload, k) -> f32 [k]
    block: int  # k is a multiple of this: the buffer is padded to N * block


# (grad_bytes, replicas, grad_sync config, shape) -> bytes; see `CompressorSpec.wire_bytes`.
WireBytes = Callable[[float, int, Any, "Sequence[int] | None"], float]


def ring(kind: str, nbytes: float, replicas: int) -> float:
    """Bytes one device sends for one collective over the replicas, ring-costed as
    `metrics.collective_bytes` charges the compiled HLO (`hlo_cost.ring_wire_bytes`)."""
    return hlo_cost.ring_wire_bytes(kind, nbytes, replicas)


def dense_wire_bytes(grad_bytes: float, replicas: int, cfg: Any = None, shape=None) -> float:
    """An f32 all-reduce of the tensor: `none`'s cost, and the reference of every ratio."""
    del cfg, shape
    return ring("all-reduce", grad_bytes, replicas)


def no_bytes(grad_bytes: float, replicas: int, cfg: Any = None) -> float:
    """A cost hook for what a compressor does not spend (state bytes, FLOPs)."""
    del grad_bytes, replicas, cfg
    return 0.0


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    """One `grad_sync.compression` name: how to build it, what it accepts, what it costs.

    Attributes:
      name: the `grad_sync.compression` value.
      build: `(axis_name, grad_sync config, TrainFields) -> optax.GradientTransformation`, the
        compressor; it runs inside the data-parallel shard_map and must return a mean gradient
        typed invariant over `axis_name` (jaxdist/compression/replica.py, the contract).
      summary: one line for docs and error messages.
      fields: the `grad_sync` fields it reads besides `compression` (each a schema field with a
        rule in jaxdist/compression_fields.py; `registry.check` applies those rules).
      error_feedback: what it does not send it keeps (state fields `residual_fields`) and adds
        back next step, so the sum of what is sent follows the sum of the gradients; with
        `grad_sync.error_feedback` where the field is read, always where it is not.
      residual_fields: state fields holding compression error (for `residual_norm`, the
        conservation test and elastic resizes: "worker"/"residual" per replica, "server" one
        shard per replica).
      momentum_corrected: where it accepts `grad_sync.momentum_correction` (the optimizer's
        momentum moves inside it), what that makes of it ("DGC", "1-bit momentum SGD"); "" where
        it does not.
      freezes_variance: accepts `grad_sync.freeze_variance` (Adam with its variance frozen after
        `warmup_steps`, chained as the preconditioner).
      preconditioner: `(grad_sync config, TrainFields) -> optax transform` where the compressor
        always replaces Adam's moments (1-bit Adam and its variants), else None. Such a compressor
        syncs Adam's momentum b1 m + (1 - b1) g rather than the gradient.
      deprecated_for: the new name, where this one is an old name still accepted with a warning.
      per_hop: `grad_sync config -> Codec` where `grad_sync.algorithm='ring'` (and 'hierarchical'
        across hosts) can run it at every hop, else None.
      local_adam: where `momentum_correction` with `freeze_variance` (under AdamW) runs 1-bit
        Adam's scheme with each replica's own momentum (DGC under AdamW, 1-bit local Adam):
        `grad_sync config -> onebit_adam keyword arguments` of its exchange, else None.
      per_hop_unsupported: `grad_sync config -> [field, ...]` set fields the per-hop form ignores
        (refused by `allreduce.check`).
      check: extra rules of its own, `grad_sync config -> None`, raising ConfigError.
      wire_bytes: `wire_bytes(grad_bytes, replicas, cfg, shape=None) -> float`: the bytes one
        device sends per step to reduce ONE tensor (one layer of a stacked tensor, the device's
        shard of it) whose f32 gradient is `grad_bytes` bytes, over `replicas` data-parallel
        replicas, with the `grad_sync` config `cfg`, ring-costed as `metrics.collective_bytes`
        reads the compiled HLO (all-reduce 2(N-1)/N S, all-gather and all-to-all (N-1)/N S). The
        steady state: after any warm-up (a dense warm-up compiles as a branch the HLO reader
        charges at its dense cost). `shape` (the tensor's shape, without stacked-layer axes)
        where the method depends on it (PowerSGD's matrix view; without it a square matrix is
        assumed). The planner sums it over tensors; `total_wire_bytes` does the same.
      state_bytes: `(grad_bytes, replicas, cfg) -> float`, bytes of per-device state it keeps
        for that tensor (residuals, momenta, factors): memory the planner adds to the optimizer.
      extra_flops: `(grad_bytes, replicas, cfg) -> float`, an estimate of the floating-point
        operations per step its compression adds for that tensor (not measured; ordering only).
      dense_estimate: what it hands the optimizer is a dense estimate of the whole mean gradient
        (the casts; PowerSGD's low-rank product). False for sparse and sign codes and for the
        Adam family that syncs momentum: an optimizer that transforms the whole gradient (Muon's
        orthogonalisation, jaxdist/optim.py) refuses those.
      example: `grad_sync` fields the registry-driven tests run it with (besides `compression`),
        chosen so that it compresses (e.g. past any warm-up) and passes `config.validate`.
    """

    name: str
    build: Callable[[AxisName, Any, TrainFields], optax.GradientTransformation]
    summary: str
    wire_bytes: WireBytes
    fields: tuple[str, ...] = ()
    error_feedback: bool = False
    residual_fields: tuple[str, ...] = ()
    momentum_corrected: str = ""
    freezes_variance: bool = False
    preconditioner: Callable[[Any, TrainFields], optax.GradientTransformation] | None = None
    deprecated_for: str | None = None
    per_hop: Callable[[Any], Codec] | None = None
    local_adam: Callable[[Any], dict[str, Any]] | None = None
    per_hop_unsupported: Callable[[Any], list[str]] = lambda cfg: []
    check: Callable[[Any], None] = lambda cfg: None
    state_bytes: Callable[[float, int, Any], float] = no_bytes
    extra_flops: Callable[[float, int, Any], float] = no_bytes
    example: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dense_estimate: bool = True


def total_wire_bytes(
    spec: CompressorSpec, shapes: Sequence[Sequence[int]], replicas: int, cfg: Any
) -> float:
    """`spec.wire_bytes` summed over tensors of these shapes (f32 gradients, one layer each)."""
    return sum(
        spec.wire_bytes(4.0 * math.prod(s), replicas, cfg, tuple(int(d) for d in s)) for s in shapes
    )
