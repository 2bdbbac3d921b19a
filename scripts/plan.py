"""Plan a mesh: predicted memory and step time for every layout of a GPT on a cluster.

    python scripts/plan.py --config=configs/gpt_1b.py --devices=64 --hardware=h100_nvlink_ib \
        [--top=10] [--out=plan.json] [--plot=scaling.png] [--config.train.batch_size=256]

Prints the ranked layouts (mesh, microbatching, remat, memory per device, whether it fits, predicted
step time, tokens/s, MFU) and the recommended one with the flags that run it, then the data axis's
gradient all-reduce algorithms (`grad_sync.algorithm`) costed for that layout, fastest first; `--out` writes them as
JSON, `--plot` a weak-scaling efficiency plot from 8 to 4096 devices (one line per built-in
accelerator profile). Nothing is compiled: see docs/PLANNER.md for the cost model and its measured
accuracy. Hardware profiles: h100_nvlink_ib, h200_nvlink_ib, cloud_ethernet, tpu_v5p_pod, cpu_here.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from jaxdist.errors import ConfigError, run_command  # noqa: E402

DEFAULT_CONFIG = "configs/gpt_1b.py"


def _define_flags(argv: list[str]) -> None:
    """Defines the flags, checking the config path and override names first for clean errors."""
    from jaxdist.config_files import define_config_flag

    define_config_flag(argv, DEFAULT_CONFIG, "Experiment config (model and batch).")
    flags.DEFINE_integer("devices", None, "Number of devices to plan for.", required=True)
    flags.DEFINE_string(
        "hardware", "h100_nvlink_ib", "Hardware profile (see jaxdist/plan/hardware.py)."
    )
    flags.DEFINE_integer("top", 10, "Rows of the ranked table to print (0 = all).")
    flags.DEFINE_string("out", "", "Write the plan as JSON here.")
    flags.DEFINE_string("plot", "", "Write a weak-scaling plot (8 to 4096 devices) as PNG here.")
    flags.DEFINE_float(
        "compression_ratio",
        1.0,
        "Gradient-sync bytes relative to uncompressed (e.g. 0.5 for bf16), a what-if.",
    )
    flags.DEFINE_integer("max_grad_accum", 16, "Largest train.grad_accum to consider.")
    flags.DEFINE_integer("plot_max_devices", 4096, "Largest device count on the scaling plot.")


def _parse(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def main(argv):
    if not flags.FLAGS["verbosity"].present:  # absl's INFO lines (JAX's backend probe) stay out
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {argv[1:]}; use --flag=value")
    from jaxdist import plan as plan_lib

    F = flags.FLAGS
    config = F.config
    hw = plan_lib.hardware(F.hardware)
    _check_flags(F, plan_lib.SCALING_DEVICES[0])
    model = plan_lib.model_info(config)
    result = plan_lib.plan(
        config,
        F.devices,
        hw,
        model=model,
        max_grad_accum=F.max_grad_accum,
        compression_ratio=F.compression_ratio,
    )
    top = F.top or None
    print(result.table(top))
    if top is not None and len(result.predictions) > top:
        print(f"... {len(result.predictions) - top} more (--top=0 shows all)")
    print(result.summary())
    algorithms = []
    if result.recommended is not None:
        text, algorithms = plan_lib.algorithm_table(result.recommended, model, hw)
        print(text)

    payload = result.to_json(top=top)
    payload["grad_sync_algorithms"] = algorithms
    payload["all"] = [
        {
            "name": p.layout.name,
            "micro": p.layout.micro,
            "remat": p.layout.remat,
            "memory_total_bytes": p.memory["total"],
            "fits": p.fits,
            "step_time_s": p.step_s,
            "mfu": p.mfu,
        }
        for p in result.predictions
    ]
    if F.plot:
        payload["scaling"] = _plot_scaling(F, config, hw, model)
    if F.out:
        _makedirs(F.out)
        with open(F.out, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"plan: {F.out}")


def _check_flags(F, fewest: int) -> None:
    """Refuses (ConfigError) flags out of range; `fewest`: the plot's smallest device count."""
    if F.devices < 1:
        raise ConfigError(f"--devices={F.devices} must be >= 1")
    if not 0 < F.compression_ratio <= 1:
        raise ConfigError(f"--compression_ratio={F.compression_ratio} must be in (0, 1]")
    if F.plot and F.plot_max_devices < fewest:
        raise ConfigError(f"--plot_max_devices={F.plot_max_devices} must be >= {fewest}")
    if F.top < 0:
        raise ConfigError(f"--top={F.top} must be >= 0 (0 = all)")


def _plot_scaling(F, config, hw, model) -> dict:
    """Weak-scaling curves of every profile (and --hardware's) drawn to --plot; returns them."""
    from jaxdist import plan as plan_lib

    per_device = max(1, config.train.batch_size // F.devices)
    names = [n for n in plan_lib.PROFILES if n != "cpu_here"]
    if hw.name not in names:
        names.insert(0, hw.name)
    curves = {
        name: plan_lib.scaling(
            config,
            plan_lib.hardware(name),
            device_counts=[n for n in plan_lib.SCALING_DEVICES if n <= F.plot_max_devices],
            per_device_batch=per_device,
            model=model,
        )
        for name in names
    }
    title = (
        f"{model.num_params / 1e9:.3g}B {model.cost.label}, {per_device} × {model.seq_len} "
        "tokens per device "
        "(weak scaling, best fitting layout)"
    )
    _makedirs(F.plot)
    plan_lib.plot_scaling(curves, F.plot, title=title)
    print(f"scaling plot: {F.plot}")
    return curves


def _makedirs(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def _start() -> None:
    _define_flags(sys.argv)
    app.run(main, flags_parser=_parse)


def entry():
    sys.exit(run_command(_start))


if __name__ == "__main__":
    entry()
