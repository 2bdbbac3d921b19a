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
from ml_collections import config_flags  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402

DEFAULT_CONFIG = "configs/default.py"


def _define_flags(argv: list[str]) -> None:
    """Defines the flags, checking the config path and override names first for clean errors.

    ml_collections parses `--config.a.b=v` overrides while the flag is defined; checking them
    against the schema beforehand turns a typo into one line instead of a KeyError traceback.
    """
    from jaxdist.config import check_override_names

    path = DEFAULT_CONFIG
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
    if not os.path.isfile(path):
        raise ConfigError(
            f"--config={path}: no such config file (see configs/ for the experiments)"
        )
    check_override_names([a for a in argv if a.startswith("--config.")])
    try:
        config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Experiment config file.", lock_config=True
        )
    except (KeyError, AttributeError, TypeError, ValueError, OSError) as e:
        raise ConfigError(f"config: {str(e).strip().splitlines()[-1]}") from None
    flags.DEFINE_string("workdir", "runs/default", "Where metrics, config and checkpoints go.")
    flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields (train.steps = 10).")
    flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'train.steps=10'.")


def main(argv):
    if len(argv) > 1:
        raise ConfigError(
            f"unexpected arguments {argv[1:]}; fields are set with --config.section.key=value"
        )
    from jaxdist import config as config_lib
    from jaxdist import distributed, mesh

    if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO
        logging.set_verbosity(logging.WARNING)
    config = flags.FLAGS.config
    config_lib.apply_gin(config, flags.FLAGS.gin_file, flags.FLAGS.gin_param)
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
