"""A tiny Mixtral (top-2 of 8 SwiGLU experts in every layer) on the standard library's bytes.

    python scripts/train.py --config=configs/mixtral_tiny.py --workdir=runs/mixtral_tiny

Seconds per hundred steps on a CPU. A CPU-only machine simulates 8 devices split fsdp=2 ×
tensor=2 × expert=2 (each device holds 4 of the 8 experts; `expert` splits the batch too); with
GPUs/TPUs every device is data-parallel. As Mixtral: 4 query heads share 2 key/value heads,
nothing is dropped (`moe_capacity_factor=0`), no router z-loss, and the load-balancing loss is
Hugging Face's (all layers pooled) with Mixtral's coefficient 0.02.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=1, fsdp=2, tensor=2, expert=2)
    c.model.name = "mixtral"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 128
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_capacity_factor = 0.0
    c.model.moe_aux_loss_weight = 0.02
    c.model.moe_z_loss_weight = 0.0
    c.model.seq_len = 64
    c.model.vocab_size = 256
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    recipes.cpu_seconds_run(c)
    return locked(c)
