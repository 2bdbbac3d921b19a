"""GPT-small (~125M parameters: 12 layers, d_model 768, 12 heads, 50304 vocabulary, 1024 context).

    python scripts/train.py --config=configs/gpt_small.py --workdir=runs/gpt_small

Sized for one GPU in bfloat16 (layers unrolled, one-hot-matmul embedding gradient: see
configs/gpt_1b.py); on the CPU, shrink it with --config.train.batch_size and steps.
"""

from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = -1
    c.model.num_layers = 12
    c.model.d_model = 768
    c.model.num_heads = 12
    c.model.vocab_size = 50304
    c.model.seq_len = 1024
    c.model.attention = "auto"
    c.model.scan_unroll = 12
    c.model.embed_grad = "matmul"
    c.train.steps = 5000
    c.train.batch_size = 32
    c.train.learning_rate = 6e-4
    c.train.warmup_steps = 200
    c.train.weight_decay = 0.1
    c.train.compute_dtype = "bfloat16"
    c.train.log_every = 50
    c.train.eval_every = 500
    c.checkpoint.every = 1000
    return locked(c)
