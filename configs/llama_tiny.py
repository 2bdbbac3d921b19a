"""A tiny Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU) on the standard library's bytes.

    python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_tiny

Seconds per hundred steps on a CPU. Like configs/default.py, a CPU-only machine simulates 8 devices
split data=2 × fsdp=2 × tensor=2; with GPUs/TPUs every device is data-parallel. 4 query heads
share 2 key/value heads, so the grouped-query path is what every test of this config runs.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=2, fsdp=2, tensor=2)
    c.model.name = "llama"
    c.model.num_layers = 2
    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 128
    c.model.seq_len = 64
    c.model.vocab_size = 256
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    recipes.cpu_seconds_run(c)
    return locked(c)
