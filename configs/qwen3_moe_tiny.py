"""A tiny Qwen3-MoE (Qwen3's q/k-normed attention, top-2 of 8 SwiGLU experts in every layer) on the
standard library's bytes.

    python scripts/train.py --config=configs/qwen3_moe_tiny.py --workdir=runs/qwen3_moe_tiny

Seconds per hundred steps on a CPU. A CPU-only machine simulates 8 devices split fsdp=2 ×
tensor=2 × expert=2 (each device holds 4 of the 8 experts); with GPUs/TPUs every device is
data-parallel. As Qwen3-MoE: heads wider than d_model / num_heads (4 of 32 on d_model 64), 4
query heads share 2 key/value heads, experts narrower than a dense MLP, top-k weights
renormalised, nothing dropped, Hugging Face's load-balancing loss (all layers pooled) with
Qwen3-MoE's coefficient 0.001.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=1, fsdp=2, tensor=2, expert=2)
    c.model.name = "qwen3_moe"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 64
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_capacity_factor = 0.0
    c.model.moe_aux_loss_weight = 0.001
    c.model.moe_z_loss_weight = 0.0
    c.model.seq_len = 64
    c.model.vocab_size = 256
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = False
    recipes.cpu_seconds_run(c)
    return locked(c)
