"""A tiny Qwen3 (the Llama layers with RMSNormed q and k heads) on the standard library's bytes.

    python scripts/train.py --config=configs/qwen3_tiny.py --workdir=runs/qwen3_tiny

Seconds per hundred steps on a CPU. Like configs/llama_tiny.py, a CPU-only machine simulates 8
devices split data=2 × fsdp=2 × tensor=2; with GPUs/TPUs every device is data-parallel. As in the
real Qwen3 shapes, the heads are wider than d_model / num_heads (4 heads of 32 on d_model 64), 4
query heads share 2 key/value heads, and the head is the embedding table.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=2, fsdp=2, tensor=2)
    c.model.name = "qwen3"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 128
    c.model.seq_len = 64
    c.model.vocab_size = 256
    c.model.rope_theta = 1000000.0
    c.model.norm_eps = 1e-6
    c.model.tie_embeddings = True
    recipes.cpu_seconds_run(c)
    return locked(c)
