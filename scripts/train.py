"""Train a model: `python scripts/train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=V]`.

With no flags it runs the default job (configs/default.py into runs/default). Gin works too:
`--gin_file=F.gin --gin_param='train.steps=10'` set the same fields as `--config.train.steps=10`.
Rerunning with the same --workdir resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/default", "Where metrics, config and checkpoints go."
)
_GIN_FILE = flags.DEFINE_multi_string(
    "gin_file", [], "Gin files binding config fields (train.steps = 10)."
)
_GIN_PARAM = flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'train.steps=10'.")


def main(argv):
    if len(argv) > 1:
        raise ConfigError(
            f"unexpected arguments {argv[1:]}; fields are set with --config.section.key=value"
        )
    from jaxdist import config as config_lib
    from jaxdist import distributed, mesh

    config = _CONFIG.value
    config_lib.apply_gin(config, _GIN_FILE.value, _GIN_PARAM.value)
    distributed.initialize()
    mesh.configure_cpu_devices(config.runtime.cpu_devices)
    from jaxdist import loop

    loop.run(config, _WORKDIR.value)


def entry():
    try:
        app.run(main)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
