"""Qwen3-0.6B's shape (~0.60B parameters, 0.44B without the tied embedding: 28 layers, d_model
1024, 16 query heads of 128 sharing 8 key/value heads, q/k RMSNorm, SwiGLU width 3072, 151936
vocabulary, rope_theta 1e6, tied embeddings), as its Hugging Face config.json has it.

    python scripts/train.py --config=configs/qwen3_0_6b.py --workdir=runs/qwen3_0_6b

For one H100/H200 or more (validated and planned by the tests, not trained there): bfloat16
compute, cuDNN flash attention where it applies, activations rematerialised except the matmul
outputs without batch dimensions, the embedding gradient as a one-hot matmul (as
configs/llama_1b.py). To fine-tune the published weights, import them first
(`python scripts/hf.py import HF_DIR --out DIR`) and add `--config.train.init_from=DIR`.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = -1
    c.model.name = "qwen3"
    c.model.num_layers = 28
    c.model.d_model = 1024
    c.model.num_heads = 16
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 3072
    c.model.vocab_size = 151936
    c.model.seq_len = 4096
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    c.model.eos_token_id = 151645
    recipes.accelerator_run(c, batch_size=16)
    return locked(c)
