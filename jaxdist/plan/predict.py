"""One layout's prediction: per-device memory, compute time and step time from the step's terms."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import numpy as np

from jaxdist import config as config_lib
from jaxdist import fp8, hlo_cost, pipeline
from jaxdist.plan.hardware import Hardware, hardware
from jaxdist.plan.layouts import Layout, hosts_of, layout_of
from jaxdist.plan.model import ModelInfo, model_info
from jaxdist.plan.terms import (
    CommTerm,
    Step,
    Terms,
    context_expert_terms,
    fsdp_terms,
    grad_sync_ratio,
    grad_sync_terms,
    optimizer_terms,
    pipeline_terms,
    step_of,
    tensor_terms,
    term_time,
)
from models.api import ACTIVATION_KINDS, Activation, RematPolicy


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


def _row_bytes(
    acts: tuple[Activation, ...], kinds: Collection[str], tokens: int, adt: int, tp: int
) -> float:
    """Bytes of one row (example) of one layer's activations of these kinds on one device:
    `tokens` tokens of it, the tensor-split ones over `tp`, float32 ones (attention scores:
    jax.nn.dot_product_attention computes logits and softmax in float32) at 4 bytes, the rest at
    the activation itemsize `adt`."""
    return tokens * sum(
        a.width * (4 if a.float32 else adt) / (tp if a.split else 1)
        for a in acts
        if a.kind in kinds
    )


# Elementwise bytes per token of one layer, in units of d_model × the activation itemsize: norms,
# RoPE, GELU, residual adds and their gradients, read and written (what the profile's non-matmul,
# non-attention kernels moved per token-layer in gpt_1b and gpt_small on an H100: ~115 passes).
ELEMENTWISE_PASSES = 115
# Bytes per token of the loss over the vocabulary: float32 logits written, read for the log-sum-exp,
# the softmax and its gradient (6 passes of 4 bytes).
LOSS_BYTES_PER_VOCAB = 24
# Bytes an FP8 matmul's casts move per element of its input (K) and of its output gradient (N),
# per token (`train.matmul_precision`, jaxdist/fp8.py): the amax passes, the casts, the backward's
# transposes of FP8 operands (cuBLASLt's layout) and a recomputing policy's second cast. Fitted, at
# `hbm_bandwidth`, to the non-matmul time the FP8 rows added on an H100 (gpt_1b +99.3 ms, llama_1b
# +68.9, the 8B proxy +24.6: 11.5, 10.1 and 15.7 bytes; least squares 11.1), before the remat
# policies kept the scales (docs/PERFORMANCE.md, "FP8 GEMMs on an H100").
FP8_CAST_BYTES = 11
# Passes over the float32 [heads, T] scores per token-layer when attention is not fused (scores,
# probabilities and their gradients, forward recomputed in the backward): gpt_1b and gpt_small
# with `model.attention=xla` on an H100 moved 15–18.
SCORE_PASSES = 16


def _compute_time(
    config, model: ModelInfo, hw: Hardware, policy: RematPolicy, tokens: int
) -> float:
    """Seconds of compute for one step on one device's worth of FLOPs (divide by devices)."""
    cost = model.cost
    L, D = model.num_layers, model.d_model
    flash = cost.attention == "cudnn" or (cost.attention == "auto" and hw.fused_attention)
    active = model.num_params - model.idle_params  # MoE: k of the E experts' weights
    dense = 6 * (active - model.embed_params)  # per token, the head included
    attn = cost.attention_flops  # per layer, per token: attention's model FLOPs
    layer_matmul = 6 * (active - model.embed_params - D * model.vocab_size) / max(L, 1)
    # What the policy recomputes in the backward (a forward is a third of the FLOPs): the matmuls
    # whose outputs it drops, attention unless it keeps its batch dots or fused attention's outputs.
    keeps_attention = "batch_dot" in policy.keeps or (
        policy.keeps_fused_attention and flash and hw.hbm_bandwidth
    )
    recompute = (0.0 if "dot" in policy.keeps else layer_matmul / 3) + (
        0.0 if keeps_attention else attn / 3
    )
    if not hw.hbm_bandwidth:  # every FLOP at one calibrated rate (the CPU profile)
        flops = (dense + (attn + recompute) * L) * tokens
        return flops / (hw.peak_flops * hw.matmul_efficiency)
    fp8_saved, cast_bytes = _fp8_terms(config, model, hw, policy)
    matmul_flops = dense + recompute * L - fp8_saved * L
    matmul_s = matmul_flops * tokens / (hw.peak_flops * hw.matmul_efficiency)
    attn_eff = hw.attention_efficiency or hw.matmul_efficiency
    attn_s = attn * L * tokens / (hw.peak_flops * (attn_eff if flash else hw.matmul_efficiency))
    act_bytes = np.dtype(config.train.compute_dtype).itemsize
    moved = ELEMENTWISE_PASSES * D * act_bytes * L + LOSS_BYTES_PER_VOCAB * model.vocab_size
    moved += cast_bytes * L
    if not flash:
        moved += SCORE_PASSES * cost.scores * 4 * L
    return matmul_s + attn_s + moved * tokens / hw.hbm_bandwidth


def _fp8_terms(config, model: ModelInfo, hw: Hardware, policy: RematPolicy) -> tuple[float, float]:
    """Per token and layer: (bf16-equivalent FLOPs the FP8 GEMMs save, bytes their casts move),
    for the block matmuls `train.matmul_precision` casts (`fp8.eligible`); (0, 0) at `default` or
    where the hardware has no FP8 GEMMs."""
    mode = config.train.get("matmul_precision", "default")
    if mode == "default" or not hw.fp8_speedup:
        return 0.0, 0.0
    cast = [(k, n) for k, n in model.cost.block_matmuls if fp8.eligible(mode, k, n)]
    passes = 3 + ("dot" not in policy.keeps)  # forward, two gradients; a forward again
    flops = 2 * passes * sum(k * n for k, n in cast)
    return flops * (1 - 1 / hw.fp8_speedup), FP8_CAST_BYTES * sum(k + n for k, n in cast)


def _lockstep(s: Step) -> tuple[float, float]:
    """(lock-step dot FLOPs per device per step, the lock-step bubble) of a pipelined layout: the
    executed schedule table with every tick charged its slowest stage's branch
    (`pipeline.branch_lockstep`), the branch FLOPs from the model's shapes (a layer's weight
    matmuls, its attention's two [T, T] matmuls, the head), plus the head gpipe and interleaved
    run outside the ticks, and for 1f1b / zb, or any schedule inside grad_sync's shard_map over
    `data`, with a statistics term that is not linear (Mixtral's pooled router loss,
    `ModelInfo.forward_prepass`) the looped forward ticks run once more first (m v + p - 1 ticks
    of 1/v of a stage's layers, no head). The bubble is the share of the lock-step ticks that is
    not the schedule's own work: 1 - useful / (p · lock-step).
    """
    model, T, D = s.model, s.model.seq_len, s.model.d_model
    sched = pipeline.build_schedule(s.config.pipeline.schedule, s.p, s.m, s.v)
    matmul = 2 * sum(math.prod(x.shape) for x in model.params if x.stacked and len(x.shape) > 2)
    tokens = s.chunk_rows * T / s.tp  # one microbatch on one device
    attn = model.cost.attention_flops / 3 * s.Lp * tokens  # the forward's third
    weights = matmul / model.num_layers * s.Lp * tokens
    head = 2 * D * model.vocab_size * tokens
    fwd = weights + attn
    # a policy that drops the dots recomputes the forward in the backward; zb's W then holds nothing
    full = "dot" not in s.policy.keeps
    bwd = 2 * fwd + (fwd if full else 0)
    b_input, b_weight = (bwd, 0.0) if full else (weights + 2 * attn, weights)
    total, useful = pipeline.branch_lockstep(sched, fwd, bwd, b_input, b_weight, head)
    outside = 0.0 if s.one_f_one_b else 3 * head * s.edge_rows / s.chunk_rows
    if (s.one_f_one_b or s.data_manual) and model.forward_prepass:
        outside += s.ticks * fwd / s.v  # the looped forward ticks, each 1/v of a stage
    return (total + outside) * s.A, 1 - useful / (s.p * total)


def _activations(s: Step) -> tuple[float, int, int, float, float]:
    """(saved + working activation bytes, rows of the working set, rows of the logits,
    extra float32 copies of the stage's layer grads, copies of the layer weights saved)."""
    # XLA:CPU computes bf16 in float32: activations there are float32 whatever the compute dtype.
    T, D = s.model.seq_len, s.model.d_model
    adt = s.cdt if s.hw.bf16_activations else 4
    acts = s.model.cost.activations
    # One row of one layer, bytes: what the policy keeps, and everything the forward computes
    # (the unit of the backward's working set). With mesh.context a device holds T/c tokens;
    # each still scores against all T keys.
    Tl = T // s.sizes["context"]
    kept = _row_bytes(acts, s.policy.keeps, Tl, adt, s.tp)
    full_row = _row_bytes(acts, ACTIVATION_KINDS, Tl, adt, s.tp)
    # A stage's layer scan of one layer is no loop for XLA (trip count 1): nothing is stacked twice.
    Lc = s.Lp // s.v  # layers one tick runs
    stage_grads = 0  # a second float32 copy of the stage's layer grads (1F1B's per-tick vjp)
    weight_copies = 1  # copies of the layers' weights the backward saved, remat none
    if s.p == 1:
        saved = s.rows_mb * s.Lp * kept
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
        saved = buffers + live * s.chunk_rows * s.Lp * kept
        work_rows, logit_rows = s.chunk_rows, s.chunk_rows
        stage_grads = 1 if Lc > 1 else 0
    else:
        # Autodiff through the ticks keeps every tick's residuals and (remat none) its weights, idle
        # ticks included (SPMD), plus the stacks of the tick it is in.
        saved = (s.ticks + (Lc > 1)) * s.chunk_rows * Lc * kept
        work_rows, logit_rows = s.chunk_rows, s.rows_mb
        weight_copies = s.ticks / s.v
    working = s.policy.working_set * work_rows * full_row
    return saved + working, work_rows, logit_rows, stage_grads, weight_copies


def _memory(s: Step) -> dict[str, float]:
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
            weights_b += n_cp * cdt * (1 + (not s.policy.recomputes and weight_copies > 1))
        elif x.stacked and not s.policy.recomputes:
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
        the configured compressor's bytes at this layout's replica count
        (`terms.grad_sync_wire_bytes`).
    """
    hw = hardware(hw)
    if layout is None:
        layout = layout_of(
            config, num_devices or math.prod(max(1, config.mesh[a]) for a in config_lib.MESH_AXES)
        )
    model = model or model_info(config)
    s = step_of(config, layout, model, hw)
    out = Terms(s.sizes)
    tensor_terms(s, out)
    fsdp_terms(s, out)
    if compression_ratio == 1.0:  # the configured compressor's own price
        compression_ratio = grad_sync_ratio(s)
    grad_sync_terms(s, out, compression_ratio)
    optimizer_terms(s, out)
    pipeline_terms(s, out)
    # Per layer run, one pipeline microbatch's tokens; 1f1b / zb: every tick's costliest branch.
    runs = s.Lp * s.ticks_1f1b * s.A if s.one_f_one_b else s.reps
    tokens = s.chunk_rows * model.seq_len
    context_expert_terms(out.add, config, s.sizes, tokens, s.wire_dt(s.cdt), runs)
    memory = _memory(s)

    tokens = int(config.train.batch_size) * model.seq_len
    model_flops = model.flops_per_token() * tokens
    n = layout.devices
    compute_s = _compute_time(config, model, hw, s.policy, tokens) / n
    lockstep, bubble = _lockstep(s) if s.p > 1 else (None, 0.0)
    compute_s /= 1 - bubble
    local, hosts = hosts_of(layout, hw)
    times = [(t, term_time(t, local, hw)) for t in out.terms]
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
