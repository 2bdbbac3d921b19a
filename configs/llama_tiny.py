"""A tiny Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU) on the standard library's bytes.

    python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_tiny

Seconds per hundred steps on a CPU. Like configs/default.py, a CPU-only machine simulates 8 devices
split data=2 × fsdp=2 × tensor=2; with GPUs/TPUs every device is data-parallel. 4 query heads
share 2 key/value heads, so the grouped-query path is what every test of this config runs.
"""

from jaxdist.config import base_config, locked
from jaxdist.mesh import accelerator_present


def get_config():
    c = base_config()
    if accelerator_present():
        c.mesh.data = -1
    else:
        c.runtime.cpu_devices = 8
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
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
    c.train.steps = 200
    c.train.batch_size = 16
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    c.checkpoint.every = 100
    return locked(c)
