"""Plot a run: loss (and eval loss), learning rate and throughput against step, to one PNG.

    python scripts/plot.py runs/default [--out=runs/default/curves.png]

Reads WORKDIR/metrics.jsonl as `scripts/train.py` writes it: the `layout` line is skipped, a step
logged twice (a resumed run) keeps its last value, evaluation losses come from `eval_loss` in step
lines or `"kind": "eval"` lines. Throughput is `tokens_per_s` or `examples_per_s`.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from jaxdist.errors import ConfigError, run_command  # noqa: E402

_OUT = flags.DEFINE_string("out", "", "PNG to write (default: WORKDIR/curves.png).")


def read_metrics(path: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from a metrics.jsonl, last value per step winning."""
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{lineno}: not a JSON line") from None
            if rec.get("kind") == "layout" or "step" not in rec:
                continue
            for key, value in rec.items():
                if key in ("step", "kind") or not isinstance(value, (int, float)):
                    continue
                if isinstance(value, bool):
                    continue
                series.setdefault(key, {})[int(rec["step"])] = float(value)
    return series


PLOT_INSTALL = "pip install -e '.[plot]'"


def plot(series: dict[str, dict[int, float]], out: str, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL}"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = "tokens_per_s" if "tokens_per_s" in series else "examples_per_s"
    panels = [
        ("loss", [("loss", "train"), ("eval_loss", "eval")]),
        ("learning rate", [("learning_rate", None)]),
        (rate.replace("_per_s", "/s"), [(rate, None)]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (label, keys) in zip(axes, panels):
        drawn = False
        for key, legend in keys:
            points = sorted(series.get(key, {}).items())
            if not points:
                continue
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=legend)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if any(legend for _, legend in keys) and drawn:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    if not flags.FLAGS["verbosity"].present:  # absl's INFO lines (JAX's backend probe) stay out
        logging.set_verbosity(logging.WARNING)
    if len(argv) != 2:
        raise ConfigError("usage: scripts/plot.py WORKDIR [--out=FILE.png]")
    workdir = argv[1]
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file; pass the --workdir of a training run")
    series = read_metrics(path)
    if "loss" not in series:
        raise ConfigError(f"{path}: no step lines with a loss yet")
    out = _OUT.value or os.path.join(workdir, "curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    plot(series, out, title=os.path.abspath(workdir))
    print(out)


def _parse(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def entry():
    sys.exit(run_command(app.run, main, flags_parser=_parse))


if __name__ == "__main__":
    entry()
