"""Mixtral-8x7B's shape (46.7B parameters, 12.9B active per token: 32 layers, d_model 4096, 32
query heads of 128 sharing 8 key/value heads, in every layer top-2 of 8 SwiGLU experts of width
14336, 32000 vocabulary, untied head, rope_theta 1e6), as its Hugging Face config.json has it,
trained on 4096-token sequences.

    python scripts/train.py --config=configs/mixtral_8x7b.py --workdir=runs/mixtral_8x7b

For several nodes of H100/H200s (validated and planned by the tests, not trained there):
parameters, gradients and Adam's moments of 46.7B parameters (~750 GB in float32) are sharded
over every device (`mesh.fsdp=-1`); `mesh.expert` puts E/ep experts on each device instead
(`python scripts/plan.py --config=configs/mixtral_8x7b.py --devices=64
--hardware=h100_nvlink_ib` ranks the layouts). bfloat16 compute, cuDNN flash attention where it
applies, activations rematerialised except the matmul outputs without batch dimensions, dropless
experts, Hugging Face's load-balancing loss with Mixtral's coefficient 0.02. To fine-tune the
published weights, import them first (`python scripts/hf.py import HF_DIR --out DIR`) and add
`--config.train.init_from=DIR`.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.name = "mixtral"
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 14336
    c.model.num_experts = 8
    c.model.experts_per_token = 2
    c.model.moe_capacity_factor = 0.0
    c.model.moe_aux_loss_weight = 0.02
    c.model.moe_z_loss_weight = 0.0
    c.model.vocab_size = 32000
    c.model.seq_len = 4096
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.eos_token_id = 2
    recipes.accelerator_run(
        c, batch_size=64, learning_rate=1e-4, log_every=10, checkpoint_every=500
    )
    return locked(c)
