"""GPT-1B (~1.3B parameters: 24 layers, d_model 2048, 16 heads, 50304 vocabulary, 2048 context).

    python scripts/train.py --config=configs/gpt_1b.py --workdir=runs/gpt_1b

For one H100/H200 or more; bfloat16 compute, cuDNN flash attention where it applies, activations
rematerialised except the matmul outputs without batch dimensions and flash attention's outputs,
the 24 layers unrolled (no per-layer copies in and out of stacked buffers) and the embedding
gradient as a one-hot matmul: 55% MFU on one H100 at batch 16 (docs/PERFORMANCE.md, "GPU").
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = -1
    c.model.num_layers = 24
    c.model.d_model = 2048
    c.model.num_heads = 16
    c.model.vocab_size = 50304
    c.model.seq_len = 2048
    c.model.scan_unroll = 24
    recipes.accelerator_run(c, batch_size=16)
    return locked(c)
