"""Qwen3 decoder (dense: Qwen3-0.6B ... 32B): the Llama layers with RMSNorm on each head's q and k.

Qwen3 is models/llama.py's network (pre-norm RMSNorm, grouped-query attention with rotate-half
rotary embeddings, SwiGLU, bias-free projections, a head that may be the embedding table) plus
one change: q and k are RMSNormed over the head dimension, one [H] scale each per layer shared by
all heads, before the rotation (`qkv`). Its head dim is its own (Qwen3-0.6B: d_model 1024, 16
heads of 128). Everything else, the scanned layers, the pipeline's stages, context-parallel
attention and the key/value cache for generation, is Llama's, called with this family's `qkv`.
Hugging Face `Qwen3ForCausalLM` weights map 1:1 (`HF` below; `scripts/hf.py` reads and writes them).

Shapes: B batch, T length, D d_model, N query heads, K key/value heads, H head dim, F mlp width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.errors import ConfigError
from jaxdist.sharding import constrain
from models import api, gpt, llama

QK_NORM_AXES = {"q_norm": ("kv",), "k_norm": ("kv",)}  # [H] each, per layer


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class Layers(llama.Layers):
    """Llama's stacked layers plus the [L, H] q and k norm scales."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        L, H = cfg.num_layers, llama.dims(cfg)["H"]
        self.q_norm = api.param(jnp.ones((L, H)), ("layers", *QK_NORM_AXES["q_norm"]))
        self.k_norm = api.param(jnp.ones((L, H)), ("layers", *QK_NORM_AXES["k_norm"]))
        self._names = {**self._names, **QK_NORM_AXES}


def qkv(lp, x, positions, cfg, c) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] → q [B, T, N, H], k, v [B, T, K, H]: Llama's projections, then q and k each
    RMSNormed over H (as Hugging Face's `Qwen3Attention`: float32, cast back, scaled), then
    rotated. Llama's `c` gathers Llama's parameters; the norm scales are gathered here."""
    q, k, v = llama.project_qkv(x, cfg, c)
    norm = lambda a, name: llama.rms_norm(a, constrain(lp[name], QK_NORM_AXES[name]), cfg.norm_eps)
    return llama.rotate_qk(norm(q, "q_norm"), norm(k, "k_norm"), v, positions, cfg)


class Qwen3(llama.Llama):
    """Token embedding → L scanned Qwen3 layers → final RMSNorm → head (or the tied embedding)."""

    layers_type = Layers
    qkv = staticmethod(qkv)


def check(m, mesh: Mapping[str, int]) -> None:
    """Llama's shape rules; Qwen3 here is the dense model (no `model.num_experts`)."""
    _need(
        not m.num_experts,
        f"model.num_experts={m.num_experts}: model.name='qwen3' is the dense Qwen3"
        "; set model.num_experts=0, or use model.name='qwen3_moe' for Qwen3-MoE",
    )
    llama.check(m, mesh)


def plan_cost(cfg, params: dict[str, Any]) -> api.PlanCost:
    """Llama's accounting (`llama.plan_cost`) with Qwen3's own head width N·H (not D): the q, k, v
    projections (N + 2K)·H wide, the attention output N·H, attention FLOPs 12·N·H·T, plus the q
    and k norms' (N + K)·H elementwise outputs."""
    d = llama.dims(cfg)
    N, K, H, T = d["N"], d["K"], d["H"], cfg.seq_len
    width = {"q, k, v": (N + 2 * K) * H, "attention output o": N * H}
    base = llama.plan_cost(cfg, params)
    acts = tuple(dataclasses.replace(a, width=width.get(a.name, a.width)) for a in base.activations)
    norms = api.Activation("q and k RMSNorms", (N + K) * H, "elementwise", split=True)
    return dataclasses.replace(
        base,
        label="Qwen3",
        activations=(*acts, norms),
        attention_flops=12.0 * N * H * T,
        context_parallel=False,  # config.validate refuses mesh.context > 1 but for llama
    )


def stages(cfg) -> api.Stages:
    """Llama's pipeline stages with Qwen3's `qkv`."""
    return llama.stages(cfg, qkv=qkv)


def decoder(cfg) -> api.Decoder:
    """Llama's KV-cache forward with Qwen3's `qkv` (`scripts/sample.py`)."""
    return llama.decoder(cfg, qkv=qkv)


# ------------------------------------------------------------------------------------------------
# Hugging Face `Qwen3ForCausalLM` (jaxdist/hf.py reads and writes the files): Llama's table
# (models/llama.py) with the same names, plus per layer
#
# | jaxdist (`params/...`) | shape | Hugging Face                          | shape |
# |------------------------|-------|---------------------------------------|-------|
# | layers/q_norm[i]       | [H]   | model.layers.i.self_attn.q_norm.weight | [H]   |
# | layers/k_norm[i]       | [H]   | model.layers.i.self_attn.k_norm.weight | [H]   |


def config_from_hf(hf: Mapping[str, Any], m, where: str) -> None:
    """Fills config.model `m` from a `Qwen3ForCausalLM` config.json: Llama's fields (biases and
    rope types Llama does not take are refused there); sliding-window layers are refused."""
    layer_types = hf.get("layer_types") or []
    sliding = bool(hf.get("use_sliding_window")) or "sliding_attention" in layer_types
    _need(
        not sliding,
        f"{where}: use_sliding_window=true / sliding_attention layers are not supported "
        "(jaxdist's Qwen3 attends over the whole sequence)",
    )
    llama.config_from_hf(hf, m, where)


def config_to_hf(m, dtype: str) -> dict[str, Any]:
    """A `Qwen3ForCausalLM` config.json for config.model `m`."""
    out = llama.config_to_hf(m, dtype)
    out.pop("mlp_bias")
    return out | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "use_sliding_window": False,
    }


def hf_tensors(m) -> list[api.HFTensor]:
    """Llama's tensors plus each layer's q and k norm scales (the table above)."""
    H = llama.dims(m)["H"]
    same = lambda a: a
    norms = [
        api.HFTensor(
            ("layers", name), f"model.layers.{{i}}.self_attn.{name}.weight", (H,), same, same, True
        )
        for name in QK_NORM_AXES
    ]
    return llama.hf_tensors(m) + norms


HF = api.HFFormat(
    architectures=("Qwen3ForCausalLM",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=hf_tensors,
    ignored=llama.HF.ignored,
)


FAMILY = api.ModelFamily(
    name="qwen3",
    make=lambda cfg, ds: lambda rngs: Qwen3(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: gpt.batch_axes(),
    check=check,
    check_data=gpt.check_data,
    flops_per_token=llama.flops_per_token,
    tokens_per_example=lambda cfg: cfg.seq_len,
    stages=stages,
    decoder=decoder,
    hf=HF,
    plan_cost=plan_cost,
    packing=True,
)
