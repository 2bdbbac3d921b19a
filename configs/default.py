"""The default job: a tiny GPT on the Python standard library's source, bytes as tokens.

    python scripts/train.py                      # = --config=configs/default.py --workdir=runs/default

On a CPU-only machine it simulates 8 devices and splits them data=2 × fsdp=2 × tensor=2, so every
parallelism axis is exercised; on a machine with GPUs/TPUs it uses the real devices for data
parallelism. Loss falls from ~5.5 (uniform over 256 bytes) to below 2.5 in a few minutes on 2 cores.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    recipes.cpu_or_accelerators(c, data=2, fsdp=2, tensor=2)
    c.model.name = "gpt"
    c.model.num_layers = 2
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.seq_len = 64
    c.model.vocab_size = 256
    recipes.cpu_seconds_run(c, steps=300, batch_size=32)
    return locked(c)
