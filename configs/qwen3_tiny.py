"""A tiny Qwen3 (the Llama layers with RMSNormed q and k heads) on the standard library's bytes.

    python scripts/train.py --config=configs/qwen3_tiny.py --workdir=runs/qwen3_tiny

Seconds per hundred steps on a CPU. Like configs/llama_tiny.py, a CPU-only machine simulates 8
devices split data=2 × fsdp=2 × tensor=2; with GPUs/TPUs every device is data-parallel. As in the
real Qwen3 shapes, the heads are wider than d_model / num_heads (4 heads of 32 on d_model 64), 4
query heads share 2 key/value heads, and the head is the embedding table.
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
    c.train.steps = 200
    c.train.batch_size = 16
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    c.checkpoint.every = 100
    return locked(c)
