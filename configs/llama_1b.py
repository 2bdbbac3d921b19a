"""Llama-3.2-1B's shape (~1.24B parameters: 16 layers, d_model 2048, 32 heads sharing 8 key/value
heads, SwiGLU width 8192, 128256 vocabulary, rope_theta 500000 with Llama 3's long-context
frequencies, tied embeddings).

    python scripts/train.py --config=configs/llama_1b.py --workdir=runs/llama_1b

For one H100/H200 or more; bfloat16 compute, cuDNN flash attention where it applies, activations
rematerialised except the matmul outputs without batch dimensions and flash attention's outputs,
the 16 layers unrolled and the embedding gradient as a one-hot matmul (as configs/gpt_1b.py). To
fine-tune the published weights instead of training from scratch, import them first
(`python scripts/hf.py import HF_DIR --out DIR`) and add `--config.train.init_from=DIR`.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = -1
    c.model.name = "llama"
    c.model.num_layers = 16
    c.model.d_model = 2048
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 64
    c.model.mlp_dim = 8192
    c.model.vocab_size = 128256
    c.model.seq_len = 2048
    c.model.rope_theta = 500000.0
    c.model.rope_scaling.type = "llama3"
    c.model.rope_scaling.factor = 32.0
    c.model.rope_scaling.low_freq_factor = 1.0
    c.model.rope_scaling.high_freq_factor = 4.0
    c.model.rope_scaling.original_max_len = 8192
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = True
    c.model.eos_token_id = 128001
    c.model.scan_unroll = 16
    recipes.accelerator_run(c, batch_size=16)
    return locked(c)
