"""A small ResNet on scikit-learn's 8×8 handwritten digits (pip install -e '.[digits]').

python scripts/train.py --config=configs/resnet.py --workdir=runs/resnet
"""

from jaxdist.recipes import accelerator_present
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    if not accelerator_present():
        c.runtime.cpu_devices = 8
        c.mesh.data, c.mesh.fsdp = 4, 2
    c.model.name = "resnet"
    c.model.widths = (16, 32, 64)
    c.model.num_classes = 10
    c.data.source = "digits"
    c.train.steps = 300
    c.train.batch_size = 64
    c.train.learning_rate = 2e-3
    c.train.log_every = 25
    c.train.eval_batches = 2
    return locked(c)
