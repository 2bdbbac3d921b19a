"""The step's collective terms: what each parallelism moves, over which mesh axes, how often.

Per-leaf shardings come from `jaxdist.sharding.logical_to_spec` with the engine's STORAGE_RULES /
COMPUTE_RULES on an `AbstractMesh`; each term is costed with `jaxdist.hlo_cost.ring_wire_bytes`, the
same ring costs the layout record reads from the compiled HLO (docs/PLANNER.md, term by term).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh

from jaxdist import compression, hlo_cost, optim, pipeline, sharding, strategies
from jaxdist import config as config_lib
from jaxdist.plan.hardware import Hardware
from jaxdist.plan.layouts import Layout
from jaxdist.plan.model import ModelInfo
from models.api import REMAT, RematPolicy


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


def term_time(term: CommTerm, local: dict[str, int], hw: Hardware) -> float:
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
    if term.kind == "all-reduce" and m > 1 and hw.xla_allreduce == "flat_ring":
        # gloo's flat ring over the whole group: 2(g-1) steps of payload/g, one hop per host
        # crossing per step (docs/AGGREGATION.md "Measured on an emulated network")
        g = term.group
        return term.count * 2 * (g - 1) * (hw.inter_latency + term.payload / g / hw.host_bandwidth)
    t = 0.0
    if k > 1:
        t += hlo_cost.ring_wire_bytes(term.kind, term.payload, k) / hw.intra_bandwidth
        t += steps * (k - 1) * hw.intra_latency
    if m > 1:
        t += hlo_cost.ring_wire_bytes(term.kind, term.payload / k, m) / hw.inter_bandwidth
        t += steps * math.ceil(math.log2(m)) * hw.inter_latency
    return term.count * t


def context_expert_terms(add, config, sizes: dict[str, int], tokens: int, dt: int, reps: int):
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


@dataclasses.dataclass(frozen=True)
class Shards:
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


_SHARDS_CACHE: dict[tuple, tuple[ModelInfo, Shards]] = {}


def shards_of(model: ModelInfo, layout: Layout) -> Shards:
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
    out = Shards(
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


@dataclasses.dataclass(frozen=True)
class Step:
    """What one device runs per step under a layout: the sizes every cost term is built from."""

    config: Any
    model: ModelInfo
    layout: Layout
    hw: Hardware
    sh: Shards
    sizes: dict[str, int]
    remat: str
    policy: RematPolicy  # the remat policy's spec (models.api.REMAT)
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
    data_manual: bool  # p > 1 inside grad_sync's shard_map over data (strategies.DATA_MANUAL)
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
        return x.stacked or (self.one_f_one_b and not x.embed)


def step_of(config, layout: Layout, model: ModelInfo, hw: Hardware) -> Step:
    # Without a pipeline every layer runs once per microbatch on rows_mb rows. With one, the stage
    # runs its Lp layers at every tick of the schedule (idle ticks too: SPMD) on a pipeline
    # microbatch, and embedding / head / loss run outside it on the batch split over the stages.
    sizes, p, A = dict(layout.mesh), layout.pipeline, layout.grad_accum
    sh = shards_of(model, layout)
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
    return Step(
        config=config,
        model=model,
        layout=layout,
        hw=hw,
        sh=sh,
        sizes=sizes,
        remat=layout.remat,
        policy=REMAT[layout.remat],
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
        data_manual=p > 1 and strategies.choose(config, sizes) in strategies.DATA_MANUAL,
        ticks_1f1b=ticks_1f1b,
        fused=bool(tick and tick.fused),
        slots=slots,
        once=p > 1 and bool(config.pipeline.get("fsdp_gather_once", False)) and sizes["fsdp"] > 1,
    )


class Terms:
    """The collective terms of a step, each added once with its group resolved from the mesh."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.terms = sizes, []

    def add(self, name, kind, axes, payload, count, hidden) -> None:
        group = math.prod(self.sizes[a] for a in axes)
        if group > 1 and count > 0 and payload > 0:
            self.terms.append(
                CommTerm(name, kind, tuple(axes), group, float(payload), int(count), hidden)
            )


def tensor_terms(s: Step, out: Terms) -> None:
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
    fwd, bwd, rerun = s.model.cost.tensor_all_reduces  # per layer, the family's count
    names = [("input grads of the column-parallel projections, bwd", bwd)]
    if not s.one_f_one_b or s.fused:
        names.insert(0, ("outputs of the row-parallel projections, fwd", fwd))
    for name, per_layer in names:
        out.add(f"tp: {name}", "all-reduce", tpa, act_chunk, per_layer * layer_runs, False)
    if "dot" not in s.policy.keeps and not s.one_f_one_b:  # the policy re-runs the projections
        out.add("tp: outputs recomputed, bwd", "all-reduce", tpa, act_chunk, rerun * s.reps, False)
    if s.one_f_one_b:  # the head runs per microbatch in the last stage, every tick
        head_rows, head_count, ce_terms = s.chunk_rows, s.ticks_1f1b * s.A, 2  # one-hot target
    else:
        head_rows, head_count, ce_terms = s.edge_rows, s.A, 3  # max, sum of exp, target logit
    out.add("tp: head input grad, bwd", "all-reduce", tpa, s.act(head_rows), head_count, False)
    ce = ce_terms * head_rows * s.model.seq_len * 4  # [b, T] float32 each
    if not s.one_f_one_b or s.fused:  # (in zb the forward branch's, not the costliest)
        out.add("tp: cross-entropy over vocab shards", "all-reduce", tpa, ce, head_count, False)


def fsdp_terms(s: Step, out: Terms) -> None:
    """FSDP all-gathers: each layer's weights per execution (twice with remat), the rest once."""
    regather = 2 if s.policy.recomputes else 1
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


# Logical axes the optimizer's per-matrix work runs over one by one (stacked layers, experts):
# the mesh axes that split them are never gathered for it.
_OPTIMIZER_BATCH_AXES = ("layers", "experts")


def optimizer_terms(s: Step, out: Terms) -> None:
    """The optimizer's own collectives (Muon's `gather`): its spec's `wire_bytes` per parameter
    (`jaxdist.optim`, no optimizer named here), charged as an all-gather over the mesh axes that
    split the parameter's matrix dimensions in storage."""
    spec = optim.spec(s.config.train)
    for x, st in zip(s.model.params, s.sh.storage):
        wire = spec.wire_bytes(x.shape, x.axes, s.sizes)
        if wire <= 0:
            continue
        entries = tuple(st) + (None,) * (len(x.shape) - len(st))
        axes = tuple(
            a
            for name, entry in zip(x.axes, entries)
            if name not in _OPTIMIZER_BATCH_AXES
            for a in _entry_axes(entry)
        )
        group = math.prod(s.sizes[a] for a in axes)
        if group > 1:  # wire = (N-1)/N · S_out: the payload S_out the ring cost reads
            out.add(
                f"optimizer: all-gather {x.path}",
                "all-gather",
                axes,
                wire * group / (group - 1),
                1,
                False,
            )


def grad_sync_wire_bytes(grad_sync, size: int, replicas: int, shape=None) -> float:
    """The planner's one price of a gradient compressor: the bytes one tensor's gradient shard of
    `size` float32 elements puts on the data axis's reduction over `replicas`, as the payload of
    the dense all-reduce that moves as much (4·size uncompressed).

    Asks the compressor's spec (`CompressorSpec.wire_bytes`, jaxdist/compression/spec.py): the
    ring-costed bytes one device sends, divided by the dense all-reduce's 2(N-1)/N, so a new
    compressor is priced with no planner edit. `shape` (the tensor's unsharded shape, without the
    stacked-layer axis) where the method reads it (PowerSGD's matrix view); `predict(
    compression_ratio=)` overrides the whole ratio.
    """
    dense = hlo_cost.ring_wire_bytes("all-reduce", 4.0 * size, replicas)
    if replicas <= 1 or dense <= 0:
        return 4.0 * size
    spec = compression.spec_of(grad_sync)
    return 4.0 * size * spec.wire_bytes(4.0 * size, replicas, grad_sync, shape) / dense


def grad_sync_ratio(s: Step) -> float:
    """The configured compressor's gradient bytes over float32's at this layout's data replicas:
    each layer of each tensor's device shard priced by `grad_sync_wire_bytes`."""
    dense = sent = 0.0
    for x, n in zip(s.model.params, s.sh.computed):
        layers = s.Lp if x.stacked else 1
        size = n // layers
        dense += layers * size
        shape = tuple(x.shape[1:] if x.stacked else x.shape)
        whole = math.prod(shape) == size  # the matrix view only where the shard is the tensor
        sent += (
            layers
            * grad_sync_wire_bytes(
                s.config.grad_sync, size, s.sizes["data"], shape if whole else None
            )
            / 4
        )
    return sent / dense


def grad_sync_terms(s: Step, out: Terms, ratio: float) -> None:
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


def pipeline_terms(s: Step, out: Terms) -> None:
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
