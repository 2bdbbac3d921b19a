"""An MLP classifier on scikit-learn's 8×8 handwritten digits (pip install -e '.[digits]').

    python scripts/train.py --config=configs/mlp.py --workdir=runs/mlp

Or on your own images: --config.data.source=images.npz (arrays `images` [N,H,W(,C)], `labels` [N]).
"""

from jaxdist.recipes import accelerator_present
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    if not accelerator_present():
        c.runtime.cpu_devices = 8
        c.mesh.data, c.mesh.tensor = 4, 2
    c.model.name = "mlp"
    c.model.hidden_dims = (256, 256)
    c.model.num_classes = 10
    c.data.source = "digits"
    c.train.steps = 300
    c.train.batch_size = 64
    c.train.learning_rate = 1e-3
    c.train.optimizer = "adamw"
    c.train.log_every = 25
    c.train.eval_batches = 2
    return locked(c)
