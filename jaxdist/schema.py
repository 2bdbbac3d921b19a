"""The config schema: one small grouped tree of every field and its default, with no rules.

A leaf anyone can import (the mesh, the planner, the weight readers): it needs only ml_collections,
`jaxdist.errors` and the compressors' field table. Experiment files in `configs/` start from
`base_config()` and override fields; the tree is locked so a misspelt key fails at parse time.
The rules that read other modules' registries are `jaxdist.config.validate`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxdist.compression_fields import COMPRESSION_FIELDS
from jaxdist.errors import ConfigError

# Slowest- to fastest-varying device index (jaxdist/mesh.py): `expert` and `context` sit between
# the batch axes and `tensor`, so their all-to-alls and ring hops stay on neighbouring devices.
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor", "pipeline")
# The axes every message names; `expert` and `context` are named only when used.
_CORE_AXES = ("data", "fsdp", "tensor", "pipeline")
CONTEXT_ATTENTIONS = ("ring", "all_gather")
COMPUTE_DTYPES = ("float32", "bfloat16")
NONFINITE = ("stop", "skip")


def base_config() -> ml_collections.ConfigDict:
    """Every field jaxdist reads, with its default. Experiments override a handful."""
    c = ml_collections.ConfigDict()
    _mesh_fields(c)
    _model_fields(c)
    _runtime_fields(c)
    _train_fields(c)
    _data_fields(c)
    _checkpoint_fields(c)
    _pipeline_fields(c)
    _grad_sync_fields(c)
    _profile_fields(c)
    return c


def _mesh_fields(c: ml_collections.ConfigDict) -> None:
    """`mesh`: the mesh axes' sizes (-1: every device left)."""
    c.mesh = ml_collections.ConfigDict()
    for axis in MESH_AXES:
        c.mesh[axis] = 1
        c.mesh[f"dcn_{axis}"] = 1
    c.mesh.data = -1


def _model_fields(c: ml_collections.ConfigDict) -> None:
    """`model`: the model family and its shape."""
    c.model = ml_collections.ConfigDict()
    c.model.name = "gpt"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.mlp_dim = 0  # 0 = 4 * d_model
    c.model.vocab_size = 256
    c.model.seq_len = 64
    c.model.norm = "rmsnorm"  # or "layernorm"
    c.model.attention = "xla"  # "xla", "cudnn" (flash attention on NVIDIA GPUs) or "auto"
    c.model.scan_unroll = 1  # layers per scan iteration (num_layers: no loop, no stacked copies)
    c.model.embed_grad = "scatter"  # or "matmul": one-hot matmul, no atomics (fast on GPUs)
    # llama (models/llama.py): grouped-query attention, rotary embeddings, RMSNorm, tied head.
    c.model.num_kv_heads = 0  # 0 = num_heads (no grouping)
    c.model.head_dim = 0  # 0 = d_model // num_heads
    c.model.rope_theta = 10000.0
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # or "llama3" (Llama 3.1+ long-context frequencies)
    c.model.rope_scaling.factor = 8.0
    c.model.rope_scaling.low_freq_factor = 1.0
    c.model.rope_scaling.high_freq_factor = 4.0
    c.model.rope_scaling.original_max_len = 8192
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.eos_token_id = -1  # generation stops at this token; -1 = none
    # Context parallelism (models/attention.py): how attention reads K/V across `mesh.context`.
    c.model.context_attention = "ring"  # or "all_gather"
    # Mixture of experts in the Llama family (models/moe.py); 0 experts = a dense MLP.
    c.model.num_experts = 0
    c.model.experts_per_token = 2  # top-k
    c.model.moe_capacity_factor = 0.0  # 0 = dropless; else capacity = factor·tokens·k / experts
    c.model.moe_aux_loss_weight = 0.01  # load-balancing loss (Switch / GShard)
    c.model.moe_z_loss_weight = 0.001  # router z-loss (ST-MoE)
    c.model.moe_shared_expert = False  # one dense SwiGLU every token also goes through
    c.model.hidden_dims = (256, 256)  # mlp
    c.model.widths = (16, 32, 64)  # resnet stage widths
    c.model.num_classes = 10  # mlp / resnet


def _runtime_fields(c: ml_collections.ConfigDict) -> None:
    """`runtime`: the devices and the GPU runtime."""
    c.runtime = ml_collections.ConfigDict()
    c.runtime.cpu_devices = 0
    c.runtime.gpu_xla_flags = False  # jaxdist.xla_flags.GPU_PERFORMANCE_FLAGS into XLA_FLAGS
    c.runtime.gpu_memory_fraction = 0.0  # XLA_PYTHON_CLIENT_MEM_FRACTION; 0 = JAX's default (0.75)


def _train_fields(c: ml_collections.ConfigDict) -> None:
    """`train`: the optimizer, schedule, precision and step options."""
    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.batch_size = 16
    c.train.seed = 0
    c.train.log_every = 10
    c.train.eval_every = 0  # 0 = only at the end
    c.train.eval_batches = 4
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 10
    c.train.schedule = "cosine"
    c.train.min_lr_ratio = 0.1
    c.train.optimizer = "adamw"
    c.train.weight_decay = 0.01
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.momentum = 0.9
    c.train.nesterov = False  # sgd: Nesterov momentum
    c.train.opt_state_dtype = "float32"  # or "bfloat16": the optimizer's moments (jaxdist/optim.py)
    c.train.opt_state_rounding = "nearest"  # or "stochastic" (bfloat16 moments: unbiased writes)
    # train.optimizer=muon's own fields (jaxdist/optim.py `Muon`, whose defaults these are).
    c.train.muon = ml_collections.ConfigDict()
    c.train.muon.momentum = 0.95
    c.train.muon.nesterov = True
    c.train.muon.ns_steps = 5
    c.train.muon.bias_correction = False  # True: optax.contrib.muon's convention
    c.train.muon.distribution = "gather"  # or "auto" (jaxdist/muon.py)
    c.train.grad_clip = 1.0  # 0 = no clipping
    c.train.grad_accum = 1
    c.train.compute_dtype = "float32"
    c.train.remat = "none"
    c.train.matmul_precision = "default"  # "fp8" / "fp8_all": block matmuls in FP8 (jaxdist/fp8.py)
    c.train.on_nonfinite = "stop"  # or "skip": drop a non-finite step's update and go on
    c.train.max_skipped = 10  # on_nonfinite=skip: stop after this many skipped updates in a row
    c.train.on_spike = "none"  # or "skip": drop the update of a loss spike (jaxdist/spikes.py)
    c.train.spike_k = 6.0  # a spike: loss > running mean + spike_k * running std
    c.train.spike_warmup = 20  # losses seen before the detector judges
    c.train.spike_decay = 0.99  # weight of the past in the running mean and variance
    c.train.lr_scaling = "none"
    c.train.base_batch_size = 0  # 0 = batch_size: lr_scaling is relative to this
    c.train.init_from = ""  # start from these weights: an HF folder or a jaxdist run/checkpoint


def _data_fields(c: ml_collections.ConfigDict) -> None:
    """`data`: the training data."""
    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.val_fraction = 0.1
    c.data.max_bytes = 16_000_000  # cap on the text corpus read into memory
    c.data.sources = ()  # a mixture of token sources (replaces data.source when given)
    c.data.weights = ()  # one per data.sources entry; default equal
    c.data.packing = "windows"  # or "documents": whole documents per row (jaxdist/data.py)


def _checkpoint_fields(c: ml_collections.ConfigDict) -> None:
    """`checkpoint`: saves: when, how many, where."""
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 0
    c.checkpoint.keep = 3
    c.checkpoint.local_every = 0  # the fast tier (checkpoint/fast.py): steps between saves, 0 = off
    c.checkpoint.local_dir = ""  # its process-local folder; "" = /dev/shm/jaxdist-fast-<hash>


def _pipeline_fields(c: ml_collections.ConfigDict) -> None:
    """`pipeline`: pipeline parallelism."""
    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.microbatches = 1
    c.pipeline.schedule = "gpipe"
    c.pipeline.virtual_stages = 1
    # Gather the FSDP-sharded stage weights once per step instead of at every tick (and reduce
    # their gradients once): more memory (a stage's whole weights), fewer collectives.
    c.pipeline.fsdp_gather_once = False


def _grad_sync_fields(c: ml_collections.ConfigDict) -> None:
    """`grad_sync`: data-parallel gradient synchronisation: algorithm, compression, local SGD."""
    c.grad_sync = ml_collections.ConfigDict()
    # The compressors' fields: defaults and meanings in jaxdist/compression_fields.py
    for name, f in COMPRESSION_FIELDS.items():
        c.grad_sync[name] = f.default
    c.grad_sync.local_steps = 1  # H > 1: local SGD, replicas average their parameters every H steps
    c.grad_sync.outer_optimizer = "average"  # local SGD's outer step: average | nesterov (DiLoCo)
    c.grad_sync.outer_learning_rate = 0.7  # nesterov: DiLoCo's outer learning rate and momentum
    c.grad_sync.outer_momentum = 0.9
    c.grad_sync.fragments = 1  # streaming DiLoCo (jaxdist/streaming.py): F fragments, staggered
    c.grad_sync.outer_overlap = 0  # streaming: a fragment's outer step lands this many steps later
    c.grad_sync.outer_quantization = "none"  # streaming: none | int8 | int4 outer gradients
    c.grad_sync.outer_mix = 0.5  # streaming, overlap > 0: replica's share in the arriving fragment
    c.grad_sync.algorithm = "xla"  # the data-parallel all-reduce (jaxdist/allreduce.py ALGORITHMS)
    c.grad_sync.staleness = 0  # tau: step t applies the reduced gradient of step t - tau
    c.grad_sync.overlap = "none"  # backward: per layer inside the backward; next_step (overlap.py)
    c.grad_sync.compress_over = "all"  # "dcn": hierarchical compresses only across hosts


def _profile_fields(c: ml_collections.ConfigDict) -> None:
    """`profile`: profiler traces."""
    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ()  # steps to trace with jax.profiler, e.g. (10, 11)


def locked(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config.lock()
    return config


def need(cond: bool, msg: str) -> None:
    """Raises ConfigError(msg) unless `cond`: the one-line refusal every rule uses."""
    if not cond:
        raise ConfigError(msg)


def resolve_mesh_shape(mesh_cfg: Mapping[str, Any], num_devices: int) -> dict[str, int]:
    """Sizes for every mesh axis, with the one `-1` axis (if any) taking the remaining devices."""
    # An axis a caller's dict leaves out (scripts building a mesh by hand) has size 1.
    sizes = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    need(len(free) <= 1, f"mesh: only one axis may be -1, got {', '.join(free)}")
    for a, s in sizes.items():
        need(s == -1 or s >= 1, f"mesh.{a}={s} must be >= 1 or -1 (= all remaining devices)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        need(
            num_devices % fixed == 0,
            f"mesh: fixed axes multiply to {fixed}, which does not divide the {num_devices} "
            f"devices, so mesh.{free[0]}=-1 has no valid size",
        )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    named = [a for a in MESH_AXES if a in _CORE_AXES or sizes[a] != 1]
    need(
        total == num_devices,
        f"mesh: {'×'.join(named)} = "
        + "×".join(str(sizes[a]) for a in named)
        + f" = {total} but there are {num_devices} devices; make the product {num_devices} "
        "or set one axis to -1",
    )
    for a in MESH_AXES:
        dcn = int(mesh_cfg.get(f"dcn_{a}", 1))
        need(
            dcn >= 1 and sizes[a] % dcn == 0,
            f"mesh.dcn_{a}={dcn} must be >= 1 and divide mesh.{a}={sizes[a]}",
        )
    return sizes


def to_json_dict(config: ml_collections.ConfigDict) -> dict:
    """The resolved config as plain JSON types (tuples become lists)."""
    return json.loads(config.to_json())
