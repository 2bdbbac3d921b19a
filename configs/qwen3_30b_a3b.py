"""Qwen3-30B-A3B's shape (30.5B parameters, 3.3B active per token: 48 layers, d_model 2048, 32
query heads of 128 sharing 4 key/value heads, q/k RMSNorm, in every layer top-8 of 128 SwiGLU
experts of width 768, 151936 vocabulary, untied head, rope_theta 1e6), as its Hugging Face
config.json has it, trained on 4096-token sequences.

    python scripts/train.py --config=configs/qwen3_30b_a3b.py --workdir=runs/qwen3_30b_a3b

For several nodes of H100/H200s (validated and planned by the tests, not trained there):
parameters, gradients and Adam's moments are sharded over every device (`mesh.fsdp=-1`);
`mesh.expert` puts E/ep experts on each device instead (`python scripts/plan.py
--config=configs/qwen3_30b_a3b.py --devices=64 --hardware=h100_nvlink_ib` ranks the layouts).
bfloat16 compute, cuDNN flash attention where it applies, activations rematerialised except the
matmul outputs without batch dimensions, dropless experts, Hugging Face's load-balancing loss with
Qwen3-MoE's coefficient 0.001. To fine-tune the published weights, import them first
(`python scripts/hf.py import HF_DIR --out DIR`) and add `--config.train.init_from=DIR`.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.name = "qwen3_moe"
    c.model.num_layers = 48
    c.model.d_model = 2048
    c.model.num_heads = 32
    c.model.num_kv_heads = 4
    c.model.head_dim = 128
    c.model.mlp_dim = 768
    c.model.num_experts = 128
    c.model.experts_per_token = 8
    c.model.moe_capacity_factor = 0.0
    c.model.moe_aux_loss_weight = 0.001
    c.model.moe_z_loss_weight = 0.0
    c.model.vocab_size = 151936
    c.model.seq_len = 4096
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = False
    c.model.eos_token_id = 151645
    recipes.accelerator_run(
        c, batch_size=64, learning_rate=1e-4, log_every=10, checkpoint_every=500
    )
    return locked(c)
