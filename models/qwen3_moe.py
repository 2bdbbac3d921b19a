"""Qwen3-MoE decoder (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention with Mixtral's experts and router loss.

Qwen3-MoE is models/qwen3.py's attention (q and k RMSNormed per head, its own head width) with
every MLP models/mixtral.py's mixture of experts: softmax over all E router logits, the top k
renormalised (`norm_topk_prob=true`, as the published Qwen3-MoE checkpoints set it), dropless, no
shared expert, and Hugging Face's load-balancing loss pooled over the layers (the same
`load_balancing_loss_func` as Mixtral's). Only the Hugging Face names differ
(`model.layers.{i}.mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`); the experts'
width is `moe_intermediate_size` (`model.mlp_dim`).

Shapes: B batch, T length, D d_model, E experts, k experts per token, F expert width, L layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxdist.errors import ConfigError
from models import api, gpt, llama, mixtral, qwen3


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class Qwen3Moe(mixtral.Mixtral):
    """Mixtral's network and loss with Qwen3's layers (the q and k norm scales) and `qkv`."""

    layers_type = qwen3.Layers
    qkv = staticmethod(qwen3.qkv)


def plan_cost(cfg, params: dict[str, Any]) -> api.PlanCost:
    """Qwen3's accounting (its head width N·H, the q and k norms) on Llama's MoE one (k experts'
    activations, the unchosen experts' weights idle), without context parallelism."""
    label = f"Qwen3-MoE ({cfg.experts_per_token} of {cfg.num_experts} experts)"
    return dataclasses.replace(qwen3.plan_cost(cfg, params), label=label)


# ------------------------------------------------------------------------------------------------
# Hugging Face `Qwen3MoeForCausalLM`: models/qwen3.py's table without the dense MLP, and per layer
# i, expert e
#
# | jaxdist (`params/...`) | shape  | Hugging Face                                   | shape  |
# |------------------------|--------|------------------------------------------------|--------|
# | layers/router[i]       | [D, E] | model.layers.i.mlp.gate.weight                 | [E, D] |
# | layers/e_gate[i, e]    | [D, F] | model.layers.i.mlp.experts.e.gate_proj.weight  | [F, D] |
# | layers/e_up[i, e]      | [D, F] | model.layers.i.mlp.experts.e.up_proj.weight    | [F, D] |
# | layers/e_down[i, e]    | [F, D] | model.layers.i.mlp.experts.e.down_proj.weight  | [D, F] |


def config_from_hf(hf: Mapping[str, Any], m, where: str) -> None:
    """Fills config.model `m` from a `Qwen3MoeForCausalLM` config.json: Qwen3's fields, the
    experts' width `moe_intermediate_size`, the experts (`mixtral.experts_from_hf`). Refused:
    unnormalised top-k weights, dense layers among the sparse ones, sliding windows."""
    _need(
        hf.get("norm_topk_prob") is True,
        f"{where}: norm_topk_prob={hf.get('norm_topk_prob')!r} is not supported (jaxdist "
        "renormalises the top-k router weights, as Qwen3-MoE's checkpoints set); it must be true",
    )
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    _need(
        step == 1 and not dense,
        f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={dense!r}: every layer must be "
        "sparse (1 and [])",
    )
    qwen3.config_from_hf({k: v for k, v in hf.items() if v is not None}, m, where)
    m.mlp_dim = llama.hf_field(hf, "moe_intermediate_size", where, int)
    # The published checkpoints say num_experts; transformers 5 writes num_local_experts.
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    mixtral.experts_from_hf(hf, m, where, key)


def config_to_hf(m, dtype: str) -> dict[str, Any]:
    """A `Qwen3MoeForCausalLM` config.json for config.model `m`."""
    out = qwen3.config_to_hf(mixtral.dense_view(m), dtype)
    return (
        out
        | mixtral.experts_to_hf(m)
        | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": int(m.num_experts),
            "moe_intermediate_size": int(llama.dims(m)["F"]),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    )


def hf_tensors(m) -> list[api.HFTensor]:
    """Qwen3's tensors but the dense MLP, then the router and the experts (the table above)."""
    at = "model.layers.{i}.mlp."
    return mixtral.without_dense_mlp(qwen3.hf_tensors(m)) + mixtral.expert_tensors(
        m,
        at + "gate.weight",
        at + "experts.{e}.gate_proj.weight",
        at + "experts.{e}.up_proj.weight",
        at + "experts.{e}.down_proj.weight",
    )


HF = api.HFFormat(
    architectures=("Qwen3MoeForCausalLM",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=hf_tensors,
    ignored=llama.HF.ignored,
)


FAMILY = api.ModelFamily(
    name="qwen3_moe",
    make=lambda cfg, ds: lambda rngs: Qwen3Moe(cfg, rngs=rngs),
    batch_axes=lambda cfg, ds: gpt.batch_axes(),
    check=mixtral.check,
    check_data=gpt.check_data,
    flops_per_token=llama.flops_per_token,
    tokens_per_example=lambda cfg: cfg.seq_len,
    stages=lambda cfg: mixtral.stages(cfg, qkv=qwen3.qkv),
    decoder=qwen3.decoder,
    hf=HF,
    plan_cost=plan_cost,
    packing=True,
    mesh_axes=frozenset({"expert"}),
)
