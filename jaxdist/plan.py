"""Cost model and mesh planner for the GPT: per-device memory and step time for every layout.

`predict(config, layout, hardware)` says what one layout costs; `plan(config, num_devices,
hardware)` enumerates every valid (data, fsdp, tensor, pipeline) × grad_accum / pipeline
microbatches × remat for a device count, predicts each, marks the ones that do not fit, ranks them
and recommends one; `scaling(...)` does that from 8 to 4096 devices for a scaling-efficiency plot.

Nothing here re-states the sharding: parameter and optimizer-state shapes come from `jax.eval_shape`
of the real model and optimizer (the `gpt` family, `jaxdist.optim`), their per-device shards from
`jaxdist.sharding.logical_to_spec` with the same STORAGE_RULES / COMPUTE_RULES the engine compiles
with (on an `AbstractMesh`, so 4096 devices need no devices), and layout validity from
`jaxdist.config.validate` on a copy of the config. The collectives are the ones XLA emits for this
model (read off the compiled HLO of small layouts; see docs/PLANNER.md for each term):

* tensor parallel (group = tensor axis), per microbatch: all-reduce of the [b, T, D] activations
  after the vocab-parallel embedding lookup, after attention and after the MLP (2 per layer
  forward), of the input gradients of the column-parallel QKV and up-projections (2 per layer
  backward; +1 with `remat=full`, which recomputes the attention output's all-reduce), of the head's
  input gradient, and three [b, T] float32 all-reduces for the vocab-sharded cross-entropy.
* FSDP (group = fsdp axis): each layer's weights are all-gathered to their compute sharding once per
  layer and microbatch in the forward, again in the backward under any remat policy (the gathered
  weight is no dot output, so no policy saves it); the embedding, final norm and head once per step.
* gradient sync (group = data × fsdp): every gradient byte (compute-shard size) per microbatch,
  inside the layer loop. XLA:CPU emits all-reduce + dynamic-slice for the reduce-scatter; GPU/TPU
  emit reduce-scatter over fsdp and all-reduce over data of the shard (`Hardware.native_reduce_scatter`).
* pipeline (gpipe/interleaved as `jaxdist.pipeline` runs them): every stage runs its layers at
  every tick (idle ticks too), so its tensor-parallel and FSDP collectives count per tick; stage
  activations go to the next stage by collective-permute every tick forward and backward; the batch
  moves into and out of the stages once per step; stage gradients are synchronised once.

Collective bytes are costed with `jaxdist.hlo_cost.ring_wire_bytes`, the same ring costs the layout
record reads from the HLO, so a prediction and a compiled step compare term by term.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh

from jaxdist import compression, flops, hlo_cost, pipeline, sharding
from jaxdist import config as config_lib
from jaxdist.errors import ConfigError
from models.api import abstract_model, remat_names

GiB = 1024**3

# --------------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of cluster, as the cost model sees it.

    Attributes:
      name: profile name.
      peak_flops: dense peak FLOP/s of one device in the compute dtype.
      memory_bytes: memory of one device, bytes.
      intra_bandwidth: bytes/s one device sends (per direction) to devices of its own host / fast
        domain (NVLink, TPU ICI).
      intra_latency: seconds per step of a collective inside a host.
      inter_bandwidth: bytes/s one device sends to other hosts (its share of the host's NICs).
      inter_latency: seconds per step of a collective across hosts.
      devices_per_host: devices sharing the fast interconnect.
      matmul_efficiency: fraction of `peak_flops` a training step's matmuls reach (calibrated).
      overlap: fraction of the compute time under which FSDP gathers and gradient sync can hide
        (XLA's async collectives / latency-hiding scheduler); tensor- and pipeline-parallel
        transfers sit on the critical path and never hide.
      native_reduce_scatter: whether the backend emits reduce-scatter (GPU, TPU) rather than
        all-reduce + dynamic-slice (XLA:CPU) for gradients of FSDP-sharded parameters.
      bf16_collectives: whether bf16 collectives run in bf16 (GPU, TPU); XLA:CPU promotes them to
        float32.
      bf16_activations: whether bf16 compute keeps its activations in bf16 (GPU, TPU); XLA:CPU
        computes bf16 operations in float32, so its activations are float32 (next to the bf16
        copies of the weights).
      usable_fraction: share of `memory_bytes` a step may use (allocator, runtime and fragmentation
        take the rest); a layout fits if its predicted peak is below it.
      attention_efficiency: fraction of `peak_flops` fused (flash) attention reaches, counted in
        model FLOPs (12·L·d·T per token); 0 = `matmul_efficiency`.
      hbm_bandwidth: bytes/s of device memory for the step's elementwise work (norms, RoPE,
        activations, residuals, the loss over the vocabulary, unfused attention scores); 0 = not
        modelled (the CPU profile: there that time is folded into `matmul_efficiency`).
      fused_attention: whether `model.attention=auto` runs fused flash attention (cuDNN on GPUs).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    devices_per_host: int
    matmul_efficiency: float
    overlap: float = 0.0
    native_reduce_scatter: bool = True
    bf16_collectives: bool = True
    bf16_activations: bool = True
    usable_fraction: float = 0.9
    attention_efficiency: float = 0.0
    hbm_bandwidth: float = 0.0
    fused_attention: bool = False


PROFILES: dict[str, Hardware] = {
    # 8×H100 SXM per node: NVLink 4 at ~450 GB/s per direction per GPU, one 400 Gb/s InfiniBand NIC
    # per GPU (50 GB/s). Compute constants measured on one H100 (docs/PERFORMANCE.md, "GPU"): the
    # profiler's matmul kernels ran gpt_1b's 6·N·tokens at 0.75 of the dense peak, cuDNN flash
    # attention its 12·L·d·T·tokens at 0.65, and the rest of the step moved bytes at ~3.0 TB/s.
    "h100_nvlink_ib": Hardware(
        name="h100_nvlink_ib",
        peak_flops=flops.PEAK_FLOPS["H100"],
        memory_bytes=80e9,
        intra_bandwidth=450e9,
        intra_latency=3e-6,
        inter_bandwidth=50e9,
        inter_latency=8e-6,
        devices_per_host=8,
        matmul_efficiency=0.75,
        overlap=0.8,
        attention_efficiency=0.65,
        hbm_bandwidth=3.0e12,
        fused_attention=True,
    ),
    # 8×A100 80GB per node with NVLink (~240 GB/s effective per direction), nodes joined by one
    # 100 Gb/s Ethernet link shared by the 8 GPUs (1.56 GB/s each), TCP latencies.
    "cloud_ethernet": Hardware(
        name="cloud_ethernet",
        peak_flops=flops.PEAK_FLOPS["A100"],
        memory_bytes=80e9,
        intra_bandwidth=240e9,
        intra_latency=5e-6,
        inter_bandwidth=100e9 / 8 / 8,
        inter_latency=30e-6,
        devices_per_host=8,
        matmul_efficiency=0.5,
        overlap=0.5,
    ),
    # A TPU v5p pod: 95 GB HBM, ICI across the whole slice (up to 8960 chips, so every layout here
    # stays on ICI; ~200 GB/s usable per direction along a ring), DCN beyond it.
    "tpu_v5p_pod": Hardware(
        name="tpu_v5p_pod",
        peak_flops=flops.PEAK_FLOPS["TPU v5p"],
        memory_bytes=95e9,
        intra_bandwidth=200e9,
        intra_latency=2e-6,
        inter_bandwidth=6.25e9,
        inter_latency=20e-6,
        devices_per_host=8960,
        matmul_efficiency=0.55,
        overlap=0.8,
    ),
    # This machine: 2 shared AMD EPYC cores simulating 8 devices in one process. Modest numbers;
    # collectives are memory copies. Matches XLA:CPU's lowering (all-reduce for reduce-scatter,
    # float32 collectives).
    "cpu_here": Hardware(
        name="cpu_here",
        peak_flops=50e9,
        memory_bytes=16 * GiB,
        intra_bandwidth=5e9,
        intra_latency=20e-6,
        inter_bandwidth=5e9,
        inter_latency=20e-6,
        devices_per_host=8,
        matmul_efficiency=0.3,
        overlap=0.0,
        native_reduce_scatter=False,
        bf16_collectives=False,
        bf16_activations=False,
    ),
}


# 8×H200 per node: the H100 profile (its compute constants are the H100's, not re-measured on an
# H200) with 141 GB of memory at ~4.3 TB/s.
PROFILES["h200_nvlink_ib"] = dataclasses.replace(
    PROFILES["h100_nvlink_ib"], name="h200_nvlink_ib", memory_bytes=141e9, hbm_bandwidth=4.3e12
)


def hardware(name: str | Hardware) -> Hardware:
    """A built-in profile by name (or the profile itself)."""
    if isinstance(name, Hardware):
        return name
    if name not in PROFILES:
        raise ConfigError(
            f"hardware={name!r} is not a profile; choose one of {', '.join(PROFILES)}"
        )
    return PROFILES[name]


# --------------------------------------------------------------------------------------------------
# The model, abstractly
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: its path, global shape, logical axes and bytes per element."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    itemsize: int

    @property
    def stacked(self) -> bool:
        return bool(self.axes) and self.axes[0] == "layers"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the cost model needs of a GPT config, read from `jax.eval_shape` (nothing allocated).

    Attributes:
      params: every parameter leaf, in tree order.
      opt: every optimizer-state leaf as (shape, itemsize, index of the parameter whose sharding it
        takes, or -1 for replicated leaves such as step counts), as `train.build` maps them.
    """

    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    vocab_size: int
    seq_len: int
    params: tuple[Leaf, ...]
    opt: tuple[tuple[tuple[int, ...], int, int], ...]
    flops: float  # model FLOPs per token, the family's `flops_per_token`
    idle_params: int = 0  # MoE: expert weights a token does not pass through (1 − k/E of them)

    @property
    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def embed_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params if p.path == "embed")

    def flops_per_token(self) -> float:
        """Model FLOPs per token as the layout record counts them (6N' + 12·L·D·T, N' without the
        embedding table)."""
        return self.flops


def model_info(config) -> ModelInfo:
    """Parameter and optimizer-state leaves of the configured GPT, exactly as `train.build` sees them."""
    import optax

    import models
    from jaxdist import optim

    m = config.model
    if m.name not in ("gpt", "llama"):
        raise ConfigError(
            f"the planner models the GPT and Llama families; model.name={m.name!r} is not supported"
        )
    family = models.get(m.name)
    abstract = abstract_model(family.make(m, None))
    abstract_params, param_axes = abstract.params, abstract.axes
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    axes = jax.tree.leaves(param_axes, is_leaf=sharding.is_axes)
    leaves = tuple(
        Leaf(
            "/".join(str(getattr(k, "key", k)) for k in path),
            tuple(int(d) for d in x.shape),
            ax,
            np.dtype(x.dtype).itemsize,
        )
        for (path, x), ax in zip(flat, axes, strict=True)
    )
    tx, _ = optim.build(config.train, param_axes)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    index = jax.tree.unflatten(treedef, [np.int64(i) for i in range(len(leaves))])
    owner = optax.tree_map_params(
        tx,
        lambda _, i: i,
        abstract_opt,
        index,
        transform_non_params=lambda _: np.int64(-1),
        is_leaf=lambda x: isinstance(x, np.int64),
    )
    opt = tuple(
        (tuple(int(d) for d in x.shape), np.dtype(x.dtype).itemsize, int(i))
        for x, i in zip(jax.tree.leaves(abstract_opt), jax.tree.leaves(owner), strict=True)
    )
    mlp, idle = m.mlp_dim or 4 * m.d_model, 0
    if m.get("num_experts", 0):  # a token's MLP activations: k experts' (+ the shared one's)
        k, experts = m.experts_per_token, m.num_experts
        expert_elems = sum(math.prod(x.shape) for x in leaves if "experts" in x.axes)
        idle = round(expert_elems * (1 - k / experts))
        mlp = mlp * (k + bool(m.moe_shared_expert))
    return ModelInfo(
        num_layers=m.num_layers,
        d_model=m.d_model,
        num_heads=m.num_heads,
        mlp_dim=mlp,
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        params=leaves,
        opt=opt,
        flops=family.flops_per_token(m, abstract_params),
        idle_params=idle,
    )


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


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


def _factorizations(n: int, k: int) -> Iterable[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d, *rest)


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def _mesh_shapes(config, n: int) -> Iterable[tuple[int, ...]]:
    """(data, fsdp, tensor, pipeline, expert, context) with product n: `expert` over the divisors
    of model.num_experts, `context` over powers of two for the Llama family (the only one with
    context attention); the rest all ordered factorizations of what is left."""
    m = config.model
    experts = int(m.get("num_experts", 0) or 0)
    expert_sizes = [e for e in range(1, experts + 1) if experts % e == 0] if experts else [1]
    context_sizes = _powers_of_two(n) if m.name == "llama" else [1]
    for e in expert_sizes:
        for c in context_sizes:
            if n % (e * c) == 0:
                for d, f, t, p in _factorizations(n // (e * c), 4):
                    yield d, f, t, p, e, c


def enumerate_layouts(
    config,
    num_devices: int,
    *,
    remats: Sequence[str] | None = None,
    max_grad_accum: int = 16,
    max_microbatches: int = 64,
    pipeline: bool = True,
) -> list[Layout]:
    """Every layout `jaxdist.config.validate` accepts for this config on `num_devices`.

    Mesh sizes are all ordered factorizations of the device count into (data, fsdp, tensor,
    pipeline), times `expert` and `context` sizes where the model has them (`_mesh_shapes`);
    grad_accum runs over powers of two up to `max_grad_accum`; pipeline microbatches over
    p·2^k up to `max_microbatches`; remat over `remats` (default: every policy). Each candidate is
    set on one working copy of the config and checked by `validate` itself, so the planner accepts
    exactly what training accepts.
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
    out = []
    for d, f, t, p, e, c in _mesh_shapes(config, num_devices):
        if p > 1 and not pipeline:
            continue
        accums = _powers_of_two(max_grad_accum) if p == 1 else [1]
        for accum in accums:
            mbs = [p * k for k in _powers_of_two(max(1, max_microbatches // p))] if p > 1 else [1]
            for mb in mbs:
                # remat changes no divisibility rule: one validate per (mesh, accum, microbatches)
                _set_fields(work, Layout(d, f, t, p, accum, mb, remats[0], e, c))
                try:
                    config_lib.validate(work, num_devices)
                except ConfigError:
                    continue
                out.extend(Layout(d, f, t, p, accum, mb, remat, e, c) for remat in remats)
    return out


# --------------------------------------------------------------------------------------------------
# Predictions
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommTerm:
    """One collective of the step: what it moves, over which mesh axes, how often.

    `payload` is S of `hlo_cost.ring_wire_bytes` for one execution; `count` executions per step.
    `hidden` terms (FSDP gathers, gradient sync) may overlap compute; the others may not.
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    group: int
    payload: float
    count: int
    hidden: bool

    @property
    def wire_bytes(self) -> float:
        return hlo_cost.ring_wire_bytes(self.kind, self.payload, self.group) * self.count


@dataclasses.dataclass
class Prediction:
    """Predicted per-device memory (bytes) and step time (seconds) of one layout.

    memory: params, opt_state, batch, state_scalars, arguments (their sum: the compiled step's
      argument bytes), grads, activations, other_temp (weights the backward holds, saved or
      gathered; logits; bf16 casts), temp (their sum, cf. memory_analysis().temp_size_in_bytes),
      total (arguments + temp: the predicted peak per device).
    """

    layout: Layout
    hardware: str
    memory: dict[str, float]
    terms: list[CommTerm]
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble: float
    step_s: float
    tokens_per_step: int
    model_flops_per_step: float
    mfu: float
    fits: bool
    hosts: dict[str, int]
    # with a pipeline: dot FLOPs per device per step with every tick charged its slowest stage's
    # branch, as the layout record's `pipeline.lockstep_flops` reads them from the compiled step
    lockstep_flops: float | None = None

    @property
    def collective_bytes(self) -> dict[str, float]:
        """Bytes one device sends per step per collective kind, as `hlo_cost.collective_bytes`."""
        out: dict[str, float] = {}
        for t in self.terms:
            w = t.wire_bytes
            if w > 0:
                out[t.kind] = out.get(t.kind, 0.0) + w
        return {k: out[k] for k in hlo_cost.COLLECTIVE_KINDS if k in out}

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.layout),
            "name": self.layout.name,
            "hardware": self.hardware,
            "memory_bytes": self.memory,
            "fits": self.fits,
            "step_time_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "bubble_fraction": self.bubble,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "collective_bytes_per_step": self.collective_bytes,
            "hosts_per_axis": self.hosts,
            "terms": [dataclasses.asdict(t) | {"wire_bytes": t.wire_bytes} for t in self.terms],
        }


def _mesh(layout: Layout) -> AbstractMesh:
    return AbstractMesh(
        tuple(getattr(layout, a) for a in config_lib.MESH_AXES), config_lib.MESH_AXES
    )


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_elems(shape: Sequence[int], spec, sizes: dict[str, int]) -> int:
    n = 1
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        n *= dim // math.prod(sizes[a] for a in _entry_axes(entry))
    return n


def _spec_axes(spec) -> set[str]:
    return {a for entry in spec for a in _entry_axes(entry)}


def _hosts(layout: Layout, hw: Hardware) -> tuple[dict[str, int], dict[str, int]]:
    """(devices of each axis inside one host, hosts each axis spans). Axes are laid out data
    (slowest) → pipeline (fastest), as `jaxdist.mesh.make_mesh` does, so hosts cut the slow axes."""
    local, stride = {}, 1
    for a in reversed(config_lib.MESH_AXES):
        n = getattr(layout, a)
        room = hw.devices_per_host // stride if stride < hw.devices_per_host else 1
        local[a] = math.gcd(n, max(room, 1))
        stride *= n
    return local, {a: getattr(layout, a) // local[a] for a in config_lib.MESH_AXES}


def _term_time(term: CommTerm, local: dict[str, int], hw: Hardware) -> float:
    """Hierarchical ring: the part of the group inside a host on the fast link, the rest across
    hosts on the slow one. Bandwidth terms are ring costs (`hlo_cost.ring_wire_bytes`) at each level
    and add up to the flat ring's bytes; latency is a ring inside a host and a tree (log2 of the
    hosts) across them, as NCCL and TPU runtimes do at scale."""
    if term.group <= 1 or term.count == 0:
        return 0.0
    k = math.prod(local[a] for a in term.axes)
    m = term.group // k
    steps = 2 if term.kind == "all-reduce" else 1
    if term.kind == "collective-permute":
        bw, lat = (
            (hw.inter_bandwidth, hw.inter_latency)
            if m > 1
            else (hw.intra_bandwidth, hw.intra_latency)
        )
        return term.count * (lat + term.payload / bw)
    t = 0.0
    if k > 1:
        t += hlo_cost.ring_wire_bytes(term.kind, term.payload, k) / hw.intra_bandwidth
        t += steps * (k - 1) * hw.intra_latency
    if m > 1:
        t += hlo_cost.ring_wire_bytes(term.kind, term.payload / k, m) / hw.inter_bandwidth
        t += steps * math.ceil(math.log2(m)) * hw.inter_latency
    return term.count * t


# Activations the backward keeps per token of one layer, in elements, split into the part
# replicated over the tensor axis ([b, T, D] residual stream, norms), the part divided by it (heads,
# MLP units) and the attention scores (divided by it too, always float32: jax.nn.dot_product_attention
# computes logits and softmax in float32), per remat policy, as XLA:CPU's buffer assignment shows
# them for this model (D d_model, F mlp width, NT = heads × length scores per query; they agree
# with what `jax.vjp` of the layer scan saves):
#   none:          6 [b,T,D] (x, norms, residual sums)   | q, k, v, o (4 D), 2 [b,T,F] (GELU's
#                                                          input and output) | scores, probs (2 NT)
#   dots:          x, attention out (2 D)                | qkv, o (4 D), up (F) | scores (NT)
#   dots_no_batch: x, attention out (2 D)                | qkv (3 D), up (F)    | —
#   full:          x (D)                                 | —                    | —
# Flash attention (`model.attention="cudnn"`) keeps no scores. The GELU's backward recomputes its
# tanh from its input (models/gpt.py `_gelu`), so no tanh pieces are kept on any backend.
def _context_expert_terms(add, config, sizes: dict[str, int], tokens: int, dt: int, reps: int):
    """Context and expert parallelism's collectives per step. `tokens`: one microbatch's tokens on
    a device's data shard (before the context split); `dt`: bytes per value on the wire; `reps`:
    layer executions per step. What the compiled step holds (tests/test_context.py,
    tests/test_moe.py): ring attention sends one stacked K/V block per hop, c − 1 hops forward and
    as many back; all_gather gathers K/V forward and reduce-scatters their gradient back; an MoE
    layer sends its [E, C, D] buffer out and back with two all-to-alls, and two more backward."""
    m = config.model
    c, ep = sizes["context"], sizes["expert"]
    n = tokens // c  # tokens on one device
    kv_width = (m.num_kv_heads or m.num_heads) * (m.head_dim or m.d_model // m.num_heads)
    kv = n * 2 * kv_width * dt  # the local K and V, stacked
    ctx = ("context",)
    if c > 1 and m.context_attention == "ring":
        add(
            "cp: ring K/V hops, fwd + bwd", "collective-permute", ctx, kv, 2 * (c - 1) * reps, False
        )
    elif c > 1:
        add("cp: K/V all-gather, fwd", "all-gather", ctx, kv * c, reps, False)
        add("cp: K/V grads reduce-scatter, bwd", "reduce-scatter", ctx, kv * c, reps, False)
    if ep > 1 and m.num_experts:
        E, k, f = m.num_experts, m.experts_per_token, m.moe_capacity_factor
        C = n if f <= 0 else max(1, min(n, math.ceil(f * n * k / E)))
        buf = E * C * m.d_model * dt  # [E, C, D]
        add(
            "ep: dispatch / combine all-to-alls, fwd + bwd",
            "all-to-all",
            ("expert",),
            buf,
            4 * reps,
            False,
        )


def _saved_per_token(remat: str, D: int, F: int, NT: int) -> tuple[float, float, float]:
    if remat == "none":
        return 6 * D, 4 * D + 2 * F, 2 * NT
    if remat == "dots":
        return 2 * D, 4 * D + F, NT
    if remat == "dots_no_batch":
        return 2 * D, 3 * D + F, 0
    return D, 0, 0


def _computed_per_token(D: int, F: int, NT: int) -> tuple[float, float, float]:
    """Everything one layer's forward computes (`none`'s row with the GELU's four tanh pieces,
    which its backward recomputes): the unit of the working set below."""
    return 6 * D, 4 * D + 6 * F, 2 * NT


# Working set of one layer's backward (cotangents, slices of the saved stacks, what the policy
# recomputes) as a multiple of the layer's full activation set (`_computed_per_token`). Read from
# XLA:CPU's buffer assignment (`--xla_dump_to`, memory-usage report) of the GPT at d_model 128-256, T 64-128,
# F 512-1024, from the change in temp between 2 and 4 rows: none 0.70-0.83, dots 0.65-0.97,
# dots_no_batch 0.65-0.90. With `full` that marginal figure is 1.24-1.33 but the whole working set
# at 1-2 rows per device is 0.9 of the layer's activations (the peak moves). Since the GELU keeps
# only its input, none and dots take the ends of their ranges (docs/PLANNER.md).
_WORKING_SET = {"none": 0.83, "dots": 0.65, "dots_no_batch": 0.7, "full": 0.9}


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Per-leaf storage / compute PartitionSpecs and shard sizes for one mesh shape."""

    storage: list
    compute: list
    stored: list[int]  # elements per device, storage sharding
    computed: list[int]  # elements per device, compute sharding (gathered over fsdp)
    params_bytes: int
    opt_bytes: int
    gathered: list[tuple[str, ...]]  # mesh axes each leaf is all-gathered over for compute (fsdp)
    batch_axes: tuple[str, ...]  # mesh axes the batch is split over
    tensor_axes: tuple[str, ...]  # mesh axes heads / mlp are split over


_SHARDS_CACHE: dict[tuple, tuple[ModelInfo, _Shards]] = {}


def _shards(model: ModelInfo, layout: Layout) -> _Shards:
    """Resolves every parameter's sharding with `sharding.logical_to_spec`, once per mesh shape."""
    key = (id(model), tuple(layout.mesh.values()))
    if key in _SHARDS_CACHE and _SHARDS_CACHE[key][0] is model:
        return _SHARDS_CACHE[key][1]
    mesh, sizes = _mesh(layout), dict(layout.mesh)
    storage = [
        sharding.logical_to_spec(x.axes, sharding.STORAGE_RULES, mesh, x.shape)
        for x in model.params
    ]
    compute = [
        sharding.logical_to_spec(x.axes, sharding.COMPUTE_RULES, mesh, x.shape)
        for x in model.params
    ]
    stored = [_shard_elems(x.shape, s, sizes) for x, s in zip(model.params, storage)]
    computed = [_shard_elems(x.shape, s, sizes) for x, s in zip(model.params, compute)]
    # The optimizer state takes its parameter's storage sharding (train.build maps the param
    # shardings over it with optax.tree_map_params); counts and other leaves are replicated.
    opt_b = 0
    for shape, itemsize, owner in model.opt:
        if owner >= 0 and shape == model.params[owner].shape:
            opt_b += _shard_elems(shape, storage[owner], sizes) * itemsize
        else:
            opt_b += math.prod(shape) * itemsize
    batch_spec = sharding.logical_to_spec(("batch", "length"), sharding.COMPUTE_RULES, mesh)
    heads_spec = sharding.logical_to_spec(("heads",), sharding.COMPUTE_RULES, mesh)
    out = _Shards(
        storage=storage,
        compute=compute,
        stored=stored,
        computed=computed,
        params_bytes=sum(n * x.itemsize for n, x in zip(stored, model.params)),
        opt_bytes=opt_b,
        gathered=[
            tuple(a for a in config_lib.MESH_AXES if a in _spec_axes(st) - _spec_axes(cp))
            for st, cp in zip(storage, compute)
        ],
        batch_axes=_entry_axes(batch_spec[0]),
        tensor_axes=_entry_axes(heads_spec[0]),
    )
    if len(_SHARDS_CACHE) > 4096:
        _SHARDS_CACHE.clear()
    _SHARDS_CACHE[key] = (model, out)
    return out


# Elementwise bytes per token of one layer, in units of d_model × the activation itemsize: norms,
# RoPE, GELU, residual adds and their gradients, read and written (what the profile's non-matmul,
# non-attention kernels moved per token-layer in gpt_1b and gpt_small on an H100: ~115 passes).
ELEMENTWISE_PASSES = 115
# Bytes per token of the loss over the vocabulary: float32 logits written, read for the log-sum-exp,
# the softmax and its gradient (6 passes of 4 bytes).
LOSS_BYTES_PER_VOCAB = 24
# Passes over the float32 [heads, T] scores per token-layer when attention is not fused (scores,
# probabilities and their gradients, forward recomputed in the backward): gpt_1b and gpt_small
# with `model.attention=xla` on an H100 moved 15–18.
SCORE_PASSES = 16


def _compute_time(config, model: ModelInfo, hw: Hardware, remat: str, tokens: int) -> float:
    """Seconds of compute for one step on one device's worth of FLOPs (divide by devices)."""
    L, D, T = model.num_layers, model.d_model, model.seq_len
    flash = config.model.attention == "cudnn" or (
        config.model.attention == "auto" and hw.fused_attention
    )
    active = model.num_params - model.idle_params  # MoE: k of the E experts' weights
    dense = 6 * (active - model.embed_params)  # per token, the head included
    attn = 12 * D * T  # per layer, per token: attention's model FLOPs
    layer_matmul = 6 * (active - model.embed_params - D * model.vocab_size) / max(L, 1)
    # What the policy recomputes in the backward; dots_no_batch keeps fused attention's outputs.
    recompute = {
        "none": 0.0,
        "dots": 0.0,
        "dots_no_batch": 0.0 if flash and hw.hbm_bandwidth else attn / 3,
        "full": (layer_matmul + attn) / 3,
    }[remat]
    if not hw.hbm_bandwidth:  # every FLOP at one calibrated rate (the CPU profile)
        flops = (dense + (attn + recompute) * L) * tokens
        return flops / (hw.peak_flops * hw.matmul_efficiency)
    matmul_s = (dense + recompute * L) * tokens / (hw.peak_flops * hw.matmul_efficiency)
    attn_eff = hw.attention_efficiency or hw.matmul_efficiency
    attn_s = attn * L * tokens / (hw.peak_flops * (attn_eff if flash else hw.matmul_efficiency))
    act_bytes = np.dtype(config.train.compute_dtype).itemsize
    moved = ELEMENTWISE_PASSES * D * act_bytes * L + LOSS_BYTES_PER_VOCAB * model.vocab_size
    if not flash:
        moved += SCORE_PASSES * model.num_heads * T * 4 * L
    return matmul_s + attn_s + moved * tokens / hw.hbm_bandwidth


@dataclasses.dataclass(frozen=True)
class _Step:
    """What one device runs per step under a layout: the sizes every cost term is built from."""

    config: Any
    model: ModelInfo
    layout: Layout
    hw: Hardware
    sh: _Shards
    sizes: dict[str, int]
    remat: str
    cdt: int  # compute dtype bytes
    A: int  # gradient-accumulation microbatches
    p: int  # pipeline stages
    rows: int  # examples per device per step
    rows_mb: int  # examples per device per microbatch
    tp: int  # tensor-parallel group size
    m: int  # pipeline microbatches
    v: int  # interleaved virtual stages
    Lp: int  # layers on one device
    ticks: int  # gpipe / interleaved ticks
    chunk_rows: int  # rows of one pipeline microbatch
    reps: int  # layer executions per step on one device
    edge_rows: int  # rows the embedding / head run on
    one_f_one_b: bool  # 1f1b or zb: a switch per tick
    ticks_1f1b: int
    # 1f1b: its costliest branch (the last stage's forward, head, loss and backward of one
    # microbatch in one tick) runs a forward too; zb's runs a backward only
    fused: bool
    # 1f1b / zb: slots of the arriving activations, arriving gradients and the residual stash
    slots: tuple[int, int, int]
    # pipeline.fsdp_gather_once: the stage's layers are gathered over fsdp once per step (per
    # accumulation chunk) before the stages, and their gradients summed over fsdp once after.
    once: bool

    def wire_dt(self, nbytes: int) -> int:
        return nbytes if self.hw.bf16_collectives else max(nbytes, 4)

    def act(self, rows: int) -> int:
        """Bytes of one [rows, T, D] activation on the wire."""
        return rows * self.model.seq_len * self.model.d_model * self.wire_dt(self.cdt)

    def in_stage(self, x) -> bool:
        return x.stacked or (self.one_f_one_b and x.path != "embed")


def _step(config, layout: Layout, model: ModelInfo, hw: Hardware) -> _Step:
    # Without a pipeline every layer runs once per microbatch on rows_mb rows. With one, the stage
    # runs its Lp layers at every tick of the schedule (idle ticks too: SPMD) on a pipeline
    # microbatch, and embedding / head / loss run outside it on the batch split over the stages.
    sizes, p, A = dict(layout.mesh), layout.pipeline, layout.grad_accum
    sh = _shards(model, layout)
    rows = int(config.train.batch_size) // math.prod(sizes[a] for a in sh.batch_axes)
    rows_mb = rows // A
    m = layout.microbatches if p > 1 else 1
    spec = pipeline.schedule_spec(config.pipeline.schedule)
    v = int(config.pipeline.virtual_stages) if spec.virtual else 1
    Lp = model.num_layers // p
    ticks = m * v + p - 1
    # An explicit-backward schedule (1f1b: jaxdist.pipeline.one_f_one_b): its table's ticks, each
    # a switch over idle / forward / backward / both (and the last stage's forward, head, loss and
    # backward of one microbatch) whose collectives are charged as the costliest branch's (as
    # jaxdist.hlo_cost counts conditionals): the last stage's, a forward and the stashed vjp (no
    # forward recomputed). zb (jaxdist.pipeline.zero_bubble) is costed as 1F1B on its own table's
    # ticks: the same switch, its backward split in two branches whose collectives are the
    # backward's. Ticks, fused ticks and slots come from the spec's table (`tick_cost`).
    explicit = p > 1 and not spec.autodiff_backward
    tick = spec.tick_cost(p, m) if explicit else None
    ticks_1f1b, slots = (tick.ticks, tick.slots) if tick else (0, (p, p, p))
    return _Step(
        config=config,
        model=model,
        layout=layout,
        hw=hw,
        sh=sh,
        sizes=sizes,
        remat=layout.remat,
        cdt=np.dtype(config.train.compute_dtype).itemsize,
        A=A,
        p=p,
        rows=rows,
        rows_mb=rows_mb,
        tp=math.prod(sizes[a] for a in sh.tensor_axes),
        m=m,
        v=v,
        Lp=Lp,
        ticks=ticks,
        chunk_rows=rows_mb // m,
        reps=(Lp // v * ticks if p > 1 else Lp) * A,
        edge_rows=rows_mb // p if p > 1 and rows_mb % p == 0 else rows_mb,
        one_f_one_b=explicit,
        ticks_1f1b=ticks_1f1b,
        fused=bool(tick and tick.fused),
        slots=slots,
        once=p > 1 and bool(config.pipeline.get("fsdp_gather_once", False)) and sizes["fsdp"] > 1,
    )


class _Terms:
    """The collective terms of a step, each added once with its group resolved from the mesh."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.terms = sizes, []

    def add(self, name, kind, axes, payload, count, hidden) -> None:
        group = math.prod(self.sizes[a] for a in axes)
        if group > 1 and count > 0 and payload > 0:
            self.terms.append(
                CommTerm(name, kind, tuple(axes), group, float(payload), int(count), hidden)
            )


def _tensor_terms(s: _Step, out: _Terms) -> None:
    """Megatron's all-reduces: embedding output, per-layer fwd/bwd, head and cross-entropy."""
    if s.tp <= 1:
        return
    tpa = s.sh.tensor_axes
    act_chunk = s.act(s.chunk_rows)
    out.add(
        "tp: embedding lookup output (vocab-parallel)",
        "all-reduce",
        tpa,
        s.act(s.edge_rows),
        s.A,
        False,
    )
    # Layer executions whose all-reduces run: 1F1B charges every tick's backward branch, whose
    # stashed vjp runs the backward's all-reduces only.
    layer_runs = s.Lp * s.ticks_1f1b * s.A if s.one_f_one_b else s.reps
    names = ["QKV, up-projection input grads, bwd"]
    if not s.one_f_one_b or s.fused:
        names.insert(0, "attention, MLP outputs (row-parallel), fwd")
    for name in names:
        out.add(f"tp: {name}", "all-reduce", tpa, act_chunk, 2 * layer_runs, False)
    if s.remat == "full" and not s.one_f_one_b:
        out.add("tp: attention output recomputed, bwd", "all-reduce", tpa, act_chunk, s.reps, False)
    if s.one_f_one_b:  # the head runs per microbatch in the last stage, every tick
        head_rows, head_count, ce_terms = s.chunk_rows, s.ticks_1f1b * s.A, 2  # one-hot target
    else:
        head_rows, head_count, ce_terms = s.edge_rows, s.A, 3  # max, sum of exp, target logit
    out.add("tp: head input grad, bwd", "all-reduce", tpa, s.act(head_rows), head_count, False)
    ce = ce_terms * head_rows * s.model.seq_len * 4  # [b, T] float32 each
    if not s.one_f_one_b or s.fused:  # (in zb the forward branch's, not the costliest)
        out.add("tp: cross-entropy over vocab shards", "all-reduce", tpa, ce, head_count, False)


def _fsdp_terms(s: _Step, out: _Terms) -> None:
    """FSDP all-gathers: each layer's weights per execution (twice with remat), the rest once."""
    regather = 2 if s.remat != "none" else 1
    # Under 1F1B / zb with FSDP, each layer's weights are gathered in a forward (1f1b's costliest
    # branch runs one) and, with remat, again when the backward recomputes it: per tick.
    for x, gathered, n_cp in zip(s.model.params, s.sh.gathered, s.sh.computed):
        if gathered:
            payload = (n_cp // s.Lp if x.stacked else n_cp) * s.wire_dt(s.cdt)
            if s.once and s.in_stage(x):  # (1F1B's head enters its stages gathered, too)
                payload, count = n_cp * s.wire_dt(s.cdt), s.A
            elif s.one_f_one_b and s.in_stage(x):
                runs = regather if s.fused else regather - 1  # (1f1b's costliest runs a forward)
                count = s.ticks_1f1b * s.A * (s.Lp * runs if x.stacked else int(s.fused))
            elif x.stacked:
                count = s.reps * regather
            else:
                count = 1
            out.add(f"fsdp: all-gather {x.path}", "all-gather", gathered, payload, count, True)


def _topk_fraction(s: _Step) -> float:
    """Top-k's gradient bytes over f32's at this layout's data replicas R: each layer of each
    tensor's device shard priced by `compression.topk_wire_ratio` (its own k; the all-gather's
    bytes grow with R up to the dense reduce of the union, the two-phase exchange's do not)."""
    g = s.config.grad_sync
    two_phase = g.get("topk_exchange", "all_gather") == "two_phase"
    dense = sent = 0.0
    for x, n in zip(s.model.params, s.sh.computed):
        layers = s.Lp if x.stacked else 1
        size = n // layers
        dense += layers * size
        sent += (
            layers
            * size
            / compression.topk_wire_ratio(size, s.sizes["data"], g.topk_ratio, two_phase)
        )
    return sent / dense


def _grad_sync_terms(s: _Step, out: _Terms, ratio: float) -> None:
    """The gradient reduction over the batch axes (compressed by `ratio` over data).

    Every gradient byte (compute shard) per microbatch, layer by layer inside the layer loop; with
    a pipeline the stage's stacked grads once per microbatch, and the embedding / head grads over
    data × pipeline (their batch is split over the stages too).
    """
    grad_dt, batch_axes, computed, A = s.wire_dt(s.cdt), s.sh.batch_axes, s.sh.computed, s.A
    layer_grads = sum(n // s.Lp * grad_dt for x, n in zip(s.model.params, computed) if x.stacked)
    other_grads = sum(n * grad_dt for x, n in zip(s.model.params, computed) if not x.stacked) + 4
    if s.p > 1:
        layer_grads, layer_count = layer_grads * s.Lp, A
    else:
        layer_count = s.Lp * A
    other_axes = batch_axes + (("pipeline",) if s.p > 1 and s.edge_rows < s.rows_mb else ())
    fs_axes = tuple(a for a in batch_axes if a == "fsdp")
    syncs = [
        ("grads: layers", layer_grads, layer_count, batch_axes),
        ("grads: embedding, final norm, head", other_grads, A, other_axes),
    ]
    if s.one_f_one_b and fs_axes and s.sizes["fsdp"] > 1 and not s.once:
        # FSDP inside 1F1B stages: fsdp is an automatic axis there, so XLA reduces the stage's layer
        # and head gradients over it in every tick's backward branch; the fsdp shard is then summed
        # once over data (the head's over data × pipeline), the embedding's outside the stages.
        f = s.sizes["fsdp"]
        rest = tuple(a for a in batch_axes if a not in fs_axes)
        head_grads = sum(
            n * grad_dt for x, n in zip(s.model.params, computed) if s.in_stage(x) and not x.stacked
        )
        embed_grads = other_grads - 4 - head_grads
        per_tick = "reduce-scatter" if s.hw.native_reduce_scatter else "all-reduce"
        for name, payload in (("layers", layer_grads), ("final norm, head", head_grads)):
            out.add(
                f"grads: {name}, every 1F1B tick",
                per_tick,
                fs_axes,
                payload,
                s.ticks_1f1b * A,
                True,
            )
        syncs = [
            ("grads: layers, fsdp shard", layer_grads / f, A, rest),
            ("grads: final norm, head, fsdp shard", head_grads / f + 4, A, rest + ("pipeline",)),
            ("grads: embedding", embed_grads, A, batch_axes + ("pipeline",)),
        ]
    if s.once:  # psum inside the stages' shard_map (manual over data and fsdp): an all-reduce
        syncs[0] = ("grads: layers, once per step (fsdp_gather_once)", *syncs[0][1:])
    for name, payload, count, axes in syncs:
        if (
            s.hw.native_reduce_scatter
            and set(fs_axes) & set(axes)
            and not (s.once and name == syncs[0][0])
        ):
            f = math.prod(s.sizes[a] for a in fs_axes)
            rest = tuple(a for a in axes if a not in fs_axes)
            out.add(
                f"{name} (reduce-scatter over fsdp)",
                "reduce-scatter",
                fs_axes,
                payload,
                count,
                True,
            )
            out.add(
                f"{name} (all-reduce of the shard)",
                "all-reduce",
                rest,
                payload / f * ratio,
                count,
                True,
            )
        else:
            out.add(f"{name} (all-reduce)", "all-reduce", axes, payload * ratio, count, True)


def _lockstep(s: _Step) -> tuple[float, float]:
    """(lock-step dot FLOPs per device per step, the lock-step bubble) of a pipelined layout: the
    executed schedule table with every tick charged its slowest stage's branch
    (`pipeline.branch_lockstep`), the branch FLOPs from the model's shapes (a layer's weight
    matmuls, its attention's two [T, T] matmuls, the head), plus the head gpipe and interleaved
    run outside the ticks. The bubble is the ticks' idle share: 1 - useful / (p · lock-step).
    """
    model, T, D = s.model, s.model.seq_len, s.model.d_model
    sched = pipeline.build_schedule(s.config.pipeline.schedule, s.p, s.m, s.v)
    matmul = 2 * sum(math.prod(x.shape) for x in model.params if x.stacked and len(x.shape) > 2)
    tokens = s.chunk_rows * T / s.tp  # one microbatch on one device
    weights, attn = matmul / model.num_layers * s.Lp * tokens, 4 * T * D * s.Lp * tokens
    head = 2 * D * model.vocab_size * tokens
    fwd = weights + attn
    full = s.remat == "full"  # the backward recomputes the forward; zb's W then holds nothing
    bwd = 2 * fwd + (fwd if full else 0)
    b_input, b_weight = (bwd, 0.0) if full else (weights + 2 * attn, weights)
    total, useful = pipeline.branch_lockstep(sched, fwd, bwd, b_input, b_weight, head)
    outside = 0.0 if s.one_f_one_b else 3 * head * s.edge_rows / s.chunk_rows
    return (total + outside) * s.A, 1 - useful / (s.p * total)


def _pipeline_terms(s: _Step, out: _Terms) -> None:
    """Stage-to-stage permutes and the batch moved into / out of the stages."""
    if s.p <= 1:
        return
    pa, A = ("pipeline",), s.A
    act, act_chunk = s.act(s.rows_mb), s.act(s.chunk_rows)
    if s.one_f_one_b:  # an activation forward and a gradient back at every tick
        out.add(
            "pp: stage activations and gradients, every 1F1B tick",
            "collective-permute",
            pa,
            act_chunk,
            2 * s.ticks_1f1b * A,
            False,
        )
    else:
        out.add(
            "pp: stage activations, fwd + bwd",
            "collective-permute",
            pa,
            act_chunk,
            2 * s.ticks * A,
            False,
        )
        # the last stage's outputs go back to the batch split over the stages for the head
        out.add("pp: batch into / out of the stages", "collective-permute", pa, act, A, False)
        out.add("pp: batch split over stages (all-to-all)", "all-to-all", pa, act, 2 * A, False)
    # (not with context / expert manual in the stages: jaxdist.pipeline.gradients, x0_blocks)
    split = s.sizes["context"] > 1 or s.sizes["expert"] > 1
    if s.one_f_one_b and s.m % s.p == 0 and not split:
        # jaxdist.pipeline.feed_tables: the embedded microbatches stay in blocks over the
        # stages; two conveyors, one fixed-pair permute each way on every tick, bring each to
        # stage 0 and its gradient back; only the integer targets reach every stage.
        out.add(
            "pp: stage-0 inputs down, input grads up (conveyors), every tick",
            "collective-permute",
            pa,
            act_chunk,
            2 * s.ticks_1f1b * A,
            False,
        )
        targets = s.rows_mb * s.model.seq_len * 4  # int32 [m, b, T]
        out.add("pp: targets to every stage (gather)", "all-gather", pa, targets, A, False)
        return
    out.add("pp: batch split over stages (gather)", "all-gather", pa, act, A, False)
    out.add("pp: stage-0 input grad summed over stages", "all-reduce", pa, act, A, False)


def _activations(s: _Step) -> tuple[float, int, int, float, float]:
    """(saved + working activation bytes, rows of the working set, rows of the logits,
    extra float32 copies of the stage's layer grads, copies of the layer weights saved)."""
    # XLA:CPU computes bf16 in float32: activations there are float32 whatever the compute dtype.
    m, T, D = s.model, s.model.seq_len, s.model.d_model
    adt = s.cdt if s.hw.bf16_activations else 4
    NT = m.num_heads * T if s.config.model.attention != "cudnn" else 0
    rep, split, scores = _saved_per_token(s.remat, D, m.mlp_dim, NT)
    # one row of one layer, bytes. With mesh.context a device holds T/c tokens; each still scores
    # against all T keys.
    Tl = T // s.sizes["context"]
    row_bytes = lambda r, sp, sc: Tl * ((r + sp / s.tp) * adt + sc / s.tp * 4)
    full_row = row_bytes(*_computed_per_token(D, m.mlp_dim, NT))
    # A stage's layer scan of one layer is no loop for XLA (trip count 1): nothing is stacked twice.
    Lc = s.Lp // s.v  # layers one tick runs
    stage_grads = 0  # a second float32 copy of the stage's layer grads (1F1B's per-tick vjp)
    weight_copies = 1  # copies of the layers' weights the backward saved, remat none
    if s.p == 1:
        saved = s.rows_mb * s.Lp * row_bytes(rep, split, scores)
        work_rows, logit_rows = s.rows_mb, s.rows_mb
    elif s.one_f_one_b:
        # Input and gradient buffers, the embedded microbatches and their gradient, and the stash:
        # its slots of one microbatch's residuals (what the policy keeps), plus about four more
        # live around the tick's switch (the slot read, the branch's new residuals, the
        # conditional's result, the masked store), from the compiled layouts of tests/test_plan*;
        # one more in 1f1b, whose last stage holds a microbatch's residuals within its tick.
        n_x, n_g, n_stash = s.slots
        buffers = (n_x + n_g + 2 * s.m) * s.chunk_rows * T * D * adt
        live = n_stash + 4 + s.fused
        saved = buffers + live * s.chunk_rows * s.Lp * row_bytes(rep, split, scores)
        work_rows, logit_rows = s.chunk_rows, s.chunk_rows
        stage_grads = 1 if Lc > 1 else 0
    else:
        # Autodiff through the ticks keeps every tick's residuals and (remat none) its weights, idle
        # ticks included (SPMD), plus the stacks of the tick it is in.
        saved = (s.ticks + (Lc > 1)) * s.chunk_rows * Lc * row_bytes(rep, split, scores)
        work_rows, logit_rows = s.chunk_rows, s.rows_mb
        weight_copies = s.ticks / s.v
    working = _WORKING_SET[s.remat] * work_rows * full_row
    return saved + working, work_rows, logit_rows, stage_grads, weight_copies


def _memory(s: _Step) -> dict[str, float]:
    """Per-device bytes: arguments (params, optimizer, batch) and the temp peak.

    temp is the peak of the backward layer loop: the residuals saved for it, the working set of
    one layer's backward (with what the policy recomputes), the stacked gradient buffers, the
    weights it saved (remat none) or re-gathers, plus what stays live around it (logits, casts).
    """
    stored, computed, cdt, Lp = s.sh.stored, s.sh.computed, s.cdt, s.Lp
    activations, _, logit_rows, stage_grads, weight_copies = _activations(s)
    fsdp_gathered = [bool(g) for g in s.sh.gathered]
    params = s.model.params
    layer_compute = sum(
        n // Lp for x, n, g in zip(params, computed, fsdp_gathered) if x.stacked and g
    )
    stacked_compute = sum(n for x, n in zip(params, computed) if x.stacked)
    grads_b = sum(n * 4 for n in stored) + layer_compute * 4 + stage_grads * stacked_compute * 4
    # Compute-sharded layer weights the backward loop holds: all layers' without remat (the scan
    # saves them), one re-gathered layer with it. The gathered embedding and head are dead by then
    # (the head's backward runs before the loop, the embedding's needs no weights) unless gradient
    # accumulation hoists their gather out of its loop.
    weights_b = 0
    for x, n_cp, g in zip(params, computed, fsdp_gathered):
        if x.stacked and s.once and g:  # the whole stage, gathered for the step
            weights_b += n_cp * cdt * (1 + (s.remat == "none" and weight_copies > 1))
        elif x.stacked and s.remat == "none":
            weights_b += n_cp * cdt * weight_copies
        elif x.stacked and g:
            weights_b += n_cp // Lp * cdt
        elif g and (s.A > 1 or (s.one_f_one_b and s.in_stage(x))):
            weights_b += n_cp * cdt
            if s.one_f_one_b:  # the head's gradient sums over the ticks at its gathered shape
                grads_b += n_cp * 4
    logits_b = (
        logit_rows * (s.model.seq_len // s.sizes["context"]) * (s.model.vocab_size // s.tp) * 4
    )
    cast_b = sum(n * cdt for n in stored) if cdt < 4 else 0
    other = weights_b + logits_b + cast_b
    temp = grads_b + activations + other
    batch_b = 2 * s.rows * s.model.seq_len * 4  # inputs + targets, int32
    scalars_b = 4 + 8 + 4  # step, rng, skipped
    arguments = s.sh.params_bytes + s.sh.opt_bytes + batch_b + scalars_b
    return {
        "params": float(s.sh.params_bytes),
        "opt_state": float(s.sh.opt_bytes),
        "batch": float(batch_b),
        "state_scalars": float(scalars_b),
        "arguments": float(arguments),
        "grads": float(grads_b),
        "activations": float(activations),
        "other_temp": float(other),
        "temp": float(temp),
        "total": float(arguments + temp),
    }


def predict(
    config,
    layout: Layout | None = None,
    hw: str | Hardware = "cpu_here",
    *,
    num_devices: int | None = None,
    model: ModelInfo | None = None,
    compression_ratio: float = 1.0,
) -> Prediction:
    """Predicts per-device memory, collective bytes and step time of one layout.

    Args:
      config: the experiment config (model, train.batch_size, compute_dtype, optimizer, pipeline
        schedule are read; mesh / grad_accum / remat come from `layout`).
      layout: defaults to the config's own (`num_devices` then resolves a `-1` axis).
      hw: a `Hardware` or the name of a built-in profile.
      model: `model_info(config)`, to reuse across many layouts.
      compression_ratio: bytes on the wire of the gradient sync over the data axis relative to
        float32 (`grad_sync.compression`: bf16 0.5, int8 ≈ 0.25, ...); 1 = uncompressed, or
        for `compression='topk'` its bytes at this layout's replica count (`_topk_fraction`).
    """
    hw = hardware(hw)
    if layout is None:
        layout = layout_of(
            config, num_devices or math.prod(max(1, config.mesh[a]) for a in config_lib.MESH_AXES)
        )
    model = model or model_info(config)
    s = _step(config, layout, model, hw)
    out = _Terms(s.sizes)
    _tensor_terms(s, out)
    _fsdp_terms(s, out)
    if compression_ratio == 1.0 and config.grad_sync.get("compression") == "topk":
        compression_ratio = _topk_fraction(s)
    _grad_sync_terms(s, out, compression_ratio)
    _pipeline_terms(s, out)
    # Per layer run, one pipeline microbatch's tokens; 1f1b / zb: every tick's costliest branch.
    runs = s.Lp * s.ticks_1f1b * s.A if s.one_f_one_b else s.reps
    tokens = s.chunk_rows * model.seq_len
    _context_expert_terms(out.add, config, s.sizes, tokens, s.wire_dt(s.cdt), runs)
    memory = _memory(s)

    tokens = int(config.train.batch_size) * model.seq_len
    model_flops = model.flops_per_token() * tokens
    n = layout.devices
    compute_s = _compute_time(config, model, hw, s.remat, tokens) / n
    lockstep, bubble = _lockstep(s) if s.p > 1 else (None, 0.0)
    compute_s /= 1 - bubble
    local, hosts = _hosts(layout, hw)
    times = [(t, _term_time(t, local, hw)) for t in out.terms]
    comm_s = sum(x for _, x in times)
    exposed = sum(x for t, x in times if not t.hidden)
    hideable = sum(x for t, x in times if t.hidden)
    exposed += max(0.0, hideable - hw.overlap * compute_s)
    step_s = compute_s + exposed
    return Prediction(
        layout=layout,
        hardware=hw.name,
        memory=memory,
        terms=out.terms,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=exposed,
        bubble=bubble,
        step_s=step_s,
        tokens_per_step=tokens,
        model_flops_per_step=model_flops,
        mfu=model_flops / (step_s * n * hw.peak_flops),
        fits=memory["total"] <= hw.usable_fraction * hw.memory_bytes,
        hosts=hosts,
        lockstep_flops=lockstep,
    )


# --------------------------------------------------------------------------------------------------
# Planning: enumerate, predict, rank, recommend
# --------------------------------------------------------------------------------------------------


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
            f"{self.model['params'] / 1e9:.3g}B-parameter GPT on {self.num_devices} × {hw.name} "
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
    _, hosts = _hosts(layout, hw)
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
      ConfigError: the model is not a GPT, or no layout passes `config.validate`.
    """
    hw = hardware(hw)
    if num_devices < 1:
        raise ConfigError(f"devices={num_devices} must be >= 1")
    model = model or model_info(config)
    total = sum(
        1 for _ in _candidates(config, num_devices, max_grad_accum, max_microbatches, remats)
    )
    layouts = enumerate_layouts(
        config,
        num_devices,
        remats=remats,
        max_grad_accum=max_grad_accum,
        max_microbatches=max_microbatches,
    )
    if not layouts:
        raise ConfigError(
            f"no (data, fsdp, tensor, pipeline, expert, context) layout of {num_devices} devices "
            "is valid for this "
            f"config (train.batch_size={config.train.batch_size}, model.num_heads="
            f"{config.model.num_heads}, model.d_model={config.model.d_model}); "
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
        "heads": model.num_heads,
        "vocab": model.vocab_size,
        "seq_len": model.seq_len,
        "global_batch": int(config.train.batch_size),
        "compute_dtype": str(config.train.compute_dtype),
        "optimizer": str(config.train.optimizer),
        "flops_per_token": model.flops_per_token(),
    }
    return Plan(num_devices, hw, info, preds, total - len(layouts))


def _candidates(config, n: int, max_accum: int, max_mb: int, remats) -> Iterable[tuple]:
    remats = tuple(remats or remat_names())
    for _, _, _, p, _, _ in _mesh_shapes(config, n):
        accums = len(_powers_of_two(max_accum)) if p == 1 else 1
        mbs = len(_powers_of_two(max(1, max_mb // p))) if p > 1 else 1
        for _ in range(accums * mbs * len(remats)):
            yield ()


# --------------------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------------------

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


def plot_scaling(curves: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """Scaling efficiency and MFU vs device count, one line per hardware profile, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eff, ax_mfu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in curves.items():
        pts = [r for r in rows if r.get("efficiency") is not None]
        if not pts:
            continue
        xs = [r["devices"] for r in pts]
        ax_eff.plot(xs, [100 * r["efficiency"] for r in pts], marker="o", label=name)
        ax_mfu.plot(xs, [100 * r["mfu"] for r in pts], marker="o", label=name)
    for ax, label in ((ax_eff, "scaling efficiency (%)"), (ax_mfu, "predicted MFU (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "weak scaling (best fitting layout per device count)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Refusing a run that cannot fit, before it compiles
# --------------------------------------------------------------------------------------------------

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

    Only the GPT is modelled. Local SGD keeps an outer state plus a copy of the model and
    optimizer per replica, which the planner does not model: no prediction then either.
    """
    if config.model.name != "gpt" or "local" in engine.abstract_state:
        return {}
    predicted = predict(config, num_devices=engine.mesh.size).memory
    return {
        "predicted_bytes_per_device": {
            k: int(predicted[k]) for k in ("params", "opt_state", "temp")
        }
    }


def refuse_if_far_over_memory(config, num_devices: int, factor: float = REFUSE_FACTOR) -> None:
    """ConfigError when the predicted per-device peak is over `factor` × the device's memory.

    Runs before anything is built or compiled, so an impossible run costs seconds and leaves
    nothing behind. Only the GPT is modelled (other families pass), and local SGD's per-replica
    copies are not (it passes too), as in the `layout` record's planner line.
    """
    if config.model.name != "gpt" or config.grad_sync.local_steps != 1:
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
        f"jaxdist/plan.py) is {total / capacity:.1f}× the {capacity / GiB:.1f} GiB of one device "
        f"({source}), over the {factor}× limit; make the model smaller (model.vocab_size="
        f"{m.vocab_size}, model.d_model={m.d_model}, model.num_layers={m.num_layers}, "
        f"model.seq_len={m.seq_len}), train.batch_size={config.train.batch_size} smaller, or "
        "shard over more devices (mesh.fsdp, mesh.tensor)"
    )


# --------------------------------------------------------------------------------------------------
# Gradient all-reduce algorithms (grad_sync.algorithm, jaxdist/allreduce.py): α-β costs per tier
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AlgorithmCost:
    """One algorithm reducing S bytes over N devices, as the compiled HLO runs it.

    Attributes:
      steps: sequential collective ops (the latency terms; `hlo_cost.collective_phases` steps).
      busiest_bytes: bytes sent + received by the device that moves the most (the parameter
        server's hot spot), as `hlo_cost.collective_phases` reads it from the HLO.
      time_s: α-β time: per step the latency α of the tier the step crosses plus its payload over
        that tier's bandwidth β (a ring step waits on its slowest hop; a server takes its pushes
        one after another through its own link; an all-to-all / all-gather is N-1 direct
        messages, each paying α).
    """

    algorithm: str
    n: int
    hosts: int
    steps: int
    busiest_bytes: float
    time_s: float


def _tier(hw: Hardware, cross: bool) -> tuple[float, float]:
    """(α seconds, β bytes/s) of one step inside a host (False) or across hosts (True)."""
    return (
        (hw.inter_latency, hw.inter_bandwidth) if cross else (hw.intra_latency, hw.intra_bandwidth)
    )


def algorithm_cost(
    algorithm: str, size_bytes: float, n: int, hw: Hardware, local: int = 0
) -> AlgorithmCost:
    """Predicted steps, hot-spot bytes and time of one all-reduce of `size_bytes` over `n` devices.

    `local` of the `n` share a host (0: as many as fit, `hw.devices_per_host`), consecutive in
    the axis, H = N / local hosts, as `hierarchical` and the mesh lay them out. Raises ConfigError
    where the algorithm cannot run.
    """
    s, local = float(size_bytes), local or min(n, hw.devices_per_host)
    hosts = max(1, n // local)
    log = math.ceil(math.log2(n)) if n > 1 else 0
    a_in, b_in = _tier(hw, False)
    a_x, b_x = _tier(hw, hosts > 1)
    ring_busy = 2 * 2 * (n - 1) / n * s
    if algorithm == "xla":  # NCCL-like: ring inside hosts, tree latency across (_term_time)
        t = 2 * (local - 1) / local * s / b_in + 2 * (local - 1) * a_in
        if hosts > 1:
            t += 2 * (hosts - 1) / hosts * s / local / hw.inter_bandwidth
            t += 2 * math.ceil(math.log2(hosts)) * hw.inter_latency
        return AlgorithmCost(algorithm, n, hosts, 1, ring_busy, t)
    if algorithm == "ring":
        return AlgorithmCost(
            algorithm, n, hosts, 2 * (n - 1), ring_busy, 2 * (n - 1) * (a_x + s / n / b_x)
        )
    if algorithm in ("halving_doubling", "tree"):
        if algorithm == "halving_doubling" and n & (n - 1):
            raise ConfigError(f"halving_doubling needs a power-of-two device count, got {n}")
        t = 0.0
        for k in range(log):  # distance 2^k: partners in one host while 2^k < L
            a, b = _tier(hw, 2**k >= local)
            payload = s / 2 ** (log - k) if algorithm == "halving_doubling" else s
            t += 2 * (a + payload / b)
        busy = ring_busy if algorithm == "halving_doubling" else 2 * log * s
        return AlgorithmCost(algorithm, n, hosts, 2 * log, busy, t)
    if algorithm == "hierarchical":
        if hosts < 2:
            raise ConfigError(f"hierarchical needs more than one host; {n} devices fit in one")
        t = 2 * (local - 1) * (a_in + s / local / b_in)
        t += 2 * (hosts - 1) * (hw.inter_latency + s / n / hw.inter_bandwidth)
        busy = 2 * (2 * (local - 1) / local * s + 2 * (hosts - 1) / hosts * s / local)
        return AlgorithmCost(algorithm, n, hosts, 2 * (local - 1) + 2 * (hosts - 1), busy, t)
    if algorithm == "ps":  # the server's link carries every push and every pull
        t = 2 * ((local - 1) * (a_in + s / b_in) + (n - local) * (a_x + s / b_x))
        return AlgorithmCost(algorithm, n, hosts, 2 * (n - 1), 2 * (n - 1) * s, t)
    if algorithm == "sharded_ps":  # all-to-all + all-gather: N-1 direct messages of S/N each
        per_peer = s / n
        t = 2 * ((local - 1) * (a_in + per_peer / b_in) + (n - local) * (a_x + per_peer / b_x))
        return AlgorithmCost(algorithm, n, hosts, 2, ring_busy, t)
    raise ConfigError(f"algorithm={algorithm!r} has no cost model")


def recommend_algorithm(
    size_bytes: float, n: int, hw: Hardware, local: int = 0
) -> list[AlgorithmCost]:
    """Every algorithm that can run on `n` devices, fastest first (the first is the pick)."""
    from jaxdist import allreduce

    costs = []
    for name in allreduce.ALGORITHMS:
        try:
            costs.append(algorithm_cost(name, size_bytes, n, hw, local))
        except ConfigError:
            continue
    return sorted(costs, key=lambda c: c.time_s)


def algorithm_table(best: Prediction, model: ModelInfo, hw: Hardware) -> tuple[str, list[dict]]:
    """The data axis's gradient all-reduce for a layout: every algorithm's predicted cost, the pick
    first. The gradient per device is the float32 parameters over fsdp × tensor × pipeline (each
    device reduces its own shard over `data`); those axes keep XLA's own collectives."""
    lay = best.layout
    n = lay.data
    size = model.num_params * 4 / (lay.fsdp * lay.tensor * lay.pipeline)
    if n <= 1:
        return "grad_sync.algorithm: mesh.data = 1, nothing to reduce over data (keep 'xla')", []
    local = _hosts(lay, hw)[0]["data"]
    costs = recommend_algorithm(size, n, hw, local)
    rows = [dataclasses.asdict(c) for c in costs]
    lines = [
        f"gradient all-reduce over data (N={n}, {local} per host, {size / 2**20:.1f} MiB per "
        f"device, {hw.name}): "
        f"recommended grad_sync.algorithm={costs[0].algorithm}; fsdp/tensor/pipeline: xla",
        f"  {'algorithm':<17}{'steps':>7}{'busiest MiB':>13}{'time ms':>10}",
    ]
    for c in costs:
        lines.append(
            f"  {c.algorithm:<17}{c.steps:>7}{c.busiest_bytes / 2**20:>13.1f}{1e3 * c.time_s:>10.3f}"
        )
    return "\n".join(lines), rows
