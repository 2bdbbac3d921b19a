"""Train a model: `python scripts/train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=V]`.

With no flags it runs the default job (configs/default.py into runs/default). Gin works too:
`--gin_file=F.gin --gin_param='train.steps=10'` set the same fields as `--config.train.steps=10`.
Rerunning with the same --workdir resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402

DEFAULT_CONFIG = "configs/default.py"


def _define_flags(argv: list[str]) -> None:
    """Defines the flags, checking the config path and override names first for clean errors.

    ml_collections parses `--config.a.b=v` overrides while the flag is defined; checking them
    against the schema beforehand turns a typo into one line instead of a KeyError traceback.
    """
    from jaxdist.config import define_config_flag

    define_config_flag(argv, DEFAULT_CONFIG, "Experiment config file.")
    flags.DEFINE_string("workdir", "runs/default", "Where metrics, config and checkpoints go.")
    flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields (train.steps = 10).")
    flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'train.steps=10'.")


def main(argv):
    if len(argv) > 1:
        raise ConfigError(
            f"unexpected arguments {argv[1:]}; fields are set with --config.section.key=value"
        )
    from jaxdist import config as config_lib
    from jaxdist import distributed, mesh, xla_flags

    if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO
        logging.set_verbosity(logging.WARNING)
    config = flags.FLAGS.config
    config_lib.apply_gin(config, flags.FLAGS.gin_file, flags.FLAGS.gin_param)
    xla_flags.apply(config.runtime.gpu_xla_flags, config.runtime.gpu_memory_fraction)
    distributed.initialize()
    mesh.configure_cpu_devices(config.runtime.cpu_devices)
    from jaxdist import loop

    loop.run(config, flags.FLAGS.workdir)


def entry():
    try:
        _define_flags(sys.argv)
        app.run(main)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()
