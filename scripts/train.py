"""Train a model: `python scripts/train.py --config=configs/NAME.py --workdir=DIR [--config.a.b=V]`.

With no flags it runs the default job (configs/default.py into runs/default). Gin works too:
`--gin_file=F.gin --gin_param='train.steps=10'` set the same fields as `--config.train.steps=10`.
Rerunning with the same --workdir resumes from its newest checkpoint.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from jaxdist.errors import ConfigError, run_command  # noqa: E402

DEFAULT_CONFIG = "configs/default.py"
# Gloo (JAX's CPU collectives across processes) prints "[Gloo] Rank 0 is connected to 1 peer ranks.
# Expected number of connected peer ranks is : 1" per connection, from C++ to file descriptor 1,
# where Python's logging settings cannot reach; its threads write it in pieces that interleave, so
# the pieces are removed wherever they are and a line left blank is dropped.
NATIVE_NOISE = re.compile(
    rb"\[Gloo\] Rank |\d+ is connected to |\d+ peer ranks\. "
    rb"|Expected number of connected peer ranks is : \d+"
)
# The whole banner, digits as `#`: a line that is nothing but a piece of it (`1`, ` is connected
# to `, ` peer ranks. `), cut there by another thread's write, is dropped too.
NATIVE_NOISE_TEXT = (
    b"[Gloo] Rank # is connected to # peer ranks. Expected number of connected peer ranks is : #"
)


def is_native_noise_piece(text: bytes) -> bool:
    """Whether `text` (a line without its newline) is only a piece of Gloo's banner."""
    piece = re.sub(rb"\d+", b"#", text.strip())
    return bool(piece) and piece in NATIVE_NOISE_TEXT


def filter_native_line(line: bytes, *, drop_blank: bool) -> bytes | None:
    """`line` with Gloo's banner removed; None when nothing of it is left to show.

    `drop_blank`: drop blank lines too (a process other than 0 prints no blank lines of its own;
    its blank lines are what the banner's pieces left).
    """
    kept = NATIVE_NOISE.sub(b"", line)
    if kept.strip():
        return None if is_native_noise_piece(kept) else kept
    if line.strip() or drop_blank:
        return None
    return kept


def _filter_native_stdout(drop_blank: bool):
    """Routes file descriptor 1 through a pipe that removes Gloo's banner (`filter_native_line`).

    Returns a function that restores descriptor 1 and forwards what is still in the pipe; it must
    run before anything ends the process with `os._exit`, so register it with atexit late.
    """
    sys.stdout.flush()
    real = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb") as src:
            for line in src:
                kept = filter_native_line(line, drop_blank=drop_blank)
                if kept is not None:
                    os.write(real, kept)

    thread = threading.Thread(target=pump, name="jaxdist-stdout-filter", daemon=True)
    thread.start()

    def restore() -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(real, 1)  # closes the pipe's last write end: the pump sees EOF
        thread.join(timeout=2.0)

    return restore


def _define_flags(argv: list[str]) -> None:
    """Defines the flags, checking the config path and override names first for clean errors.

    ml_collections parses `--config.a.b=v` overrides while the flag is defined; checking them
    against the schema beforehand turns a typo into one line instead of a KeyError traceback.
    """
    from jaxdist.config_files import define_config_flag

    define_config_flag(argv, DEFAULT_CONFIG, "Experiment config file.")
    flags.DEFINE_string("workdir", "runs/default", "Where metrics, config and checkpoints go.")
    flags.DEFINE_multi_string("gin_file", [], "Gin files binding config fields (train.steps = 10).")
    flags.DEFINE_multi_string("gin_param", [], "Gin bindings, e.g. 'train.steps=10'.")


def main(argv):
    if len(argv) > 1:
        raise ConfigError(
            f"unexpected arguments {argv[1:]}; fields are set with --config.section.key=value"
        )
    from jaxdist.config_files import apply_gin

    config = flags.FLAGS.config
    apply_gin(config, flags.FLAGS.gin_file, flags.FLAGS.gin_param)  # before JAX loads: quick
    from jaxdist import distributed, mesh, xla_flags

    quiet = not flags.FLAGS["verbosity"].present
    if quiet:  # orbax logs every save step at INFO
        logging.set_verbosity(logging.WARNING)
    xla_flags.apply(config.runtime.gpu_xla_flags, config.runtime.gpu_memory_fraction)
    restore_stdout = None
    spec = distributed.detect()
    if quiet and spec.is_multiprocess:
        restore_stdout = _filter_native_stdout(drop_blank=spec.process_id != 0)
    distributed.initialize()
    if restore_stdout is not None:  # after initialize's exit hook, so it runs before that one
        atexit.register(restore_stdout)
    mesh.configure_cpu_devices(config.runtime.cpu_devices)
    from jaxdist import loop, plan

    distributed.gc_after_imports()
    try:
        loop.run(
            config,
            flags.FLAGS.workdir,
            checks=[plan.refuse_if_far_over_memory],
            layout_extras=[plan.layout_prediction],
        )
    except loop.Preempted as stopped:  # the checkpoint is committed; the loop said so
        sys.exit(stopped.exit_code)


def _start() -> None:
    from jaxdist.config_files import parse_flags

    _define_flags(sys.argv)
    app.run(main, flags_parser=parse_flags)


def entry():
    sys.exit(run_command(_start))


if __name__ == "__main__":
    entry()
