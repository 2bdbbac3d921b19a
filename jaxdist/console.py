"""The run's console: the layout summary, the step line and progress bar, the closing lines.

Process 0 prints; every line is a pure function of a record (tested without a run), except the
`Console`, which chooses a tqdm bar on a terminal and plain lines elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from jaxdist import metrics

fmt_duration = metrics.human_duration  # `42s`, `3m05s`, `1h02m` (also goodput's line)


def summary(record: dict[str, Any]) -> str:
    """The layout record as the lines a run prints first: model, mesh, memory, wire, planner."""
    mesh = " × ".join(f"{k}={v}" for k, v in record["mesh"].items())
    b = record["bytes_per_device"]
    coll = record["collective_bytes_per_step"]
    wire = ", ".join(f"{k} {metrics.human_bytes(v)}" for k, v in coll.items()) or "none"
    lines = [
        f"jaxdist │ {record['model']} │ {record['params_total']:,} parameters │ "
        f"{record['devices']} × {record['device_kind']} in {record['processes']} process(es)",
        f"mesh    │ {mesh}",
        f"memory  │ per device: params {metrics.human_bytes(b['params'])}, optimizer {metrics.human_bytes(b['opt_state'])}, "
        f"temp {metrics.human_bytes(b['temp'])}",
        f"wire    │ per device per step: {wire} (total {metrics.human_bytes(sum(coll.values()))})"
        + (
            f"; busiest device sends + receives {metrics.human_bytes(record['busiest_device_bytes_per_step'])}"
            if "busiest_device_bytes_per_step" in record
            else ""
        ),
    ]
    extra = {
        "grad_sync_state": "compressor state",
        "local_state": "local SGD replica state",
        "in_flight_state": "stale gradients in flight",
        "outer_pending_state": "outer gradients in flight",
    }
    for key, what in extra.items():
        if key in b:
            lines[2] += f", {what} {metrics.human_bytes(b[key])}"
    if "local_steps" in record:
        lines[3] += f"; parameters averaged every {record['local_steps']} steps"
    if "predicted_bytes_per_device" in record:
        p = record["predicted_bytes_per_device"]
        lines.append(
            f"planner │ predicted params {metrics.human_bytes(p['params'])}, optimizer {metrics.human_bytes(p['opt_state'])}, "
            f"temp {metrics.human_bytes(p['temp'])} (jaxdist/plan/)"
        )
    if "planner" in record:  # the family is not modelled, in one line
        lines.append(f"planner │ {record['planner']}")
    if "bubble_fraction" in record:
        line = f"pipeline│ bubble fraction {record['bubble_fraction']:.3f}"
        if "lockstep_vs_ideal" in record.get("pipeline", {}):
            line += f", lock-step cost {record['pipeline']['lockstep_vs_ideal']:.2f}× the ideal"
        lines.append(line)
    return "\n".join(lines)


def fmt_rate(per_s: float, unit: str) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{suffix} {unit}/s"
    return f"{per_s:.3g} {unit}/s"


def step_line(step: int, total: int, m: dict[str, float], eta_s: float | None) -> str:
    """The periodic log line, as nanoGPT and torchtitan print theirs.

    `step     20/300 │ loss 4.5491 │ lr 2.25e-03 │ 412.3 ms/step │ 1.24k tok/s │ MFU 41.2% │ ETA 1m55s`
    (MFU only where the device's peak is known; eval figures when the step evaluated).
    """
    parts = [f"step {step:6d}/{total}", f"loss {m['loss']:.4f}"]
    if "learning_rate" in m:
        parts.append(f"lr {m['learning_rate']:.2e}")
    if "step_time_s" in m:
        parts.append(f"{m['step_time_s'] * 1e3:.1f} ms/step")
    if "tokens_per_s" in m:
        parts.append(fmt_rate(m["tokens_per_s"], "tok"))
    elif "examples_per_s" in m:
        parts.append(fmt_rate(m["examples_per_s"], "ex"))
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if eta_s is not None and step < total:
        parts.append(f"ETA {fmt_duration(eta_s)}")
    parts += eval_parts(m)
    return " │ ".join(parts)


def eval_parts(m: dict[str, float]) -> list[str]:
    """`eval loss 4.4241`, `eval accuracy 0.913`: every eval_* figure of a record."""
    return [
        f"eval {k.removeprefix('eval_')} {v:.4f}" for k, v in m.items() if k.startswith("eval_")
    ]


def terminal_width() -> int:
    """Columns of the terminal stdout is, 0 for none (a pipe, a file, CI, a size-less pty)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError, AttributeError):
        return 0


def outputs_lines(
    workdir: str, ckpt_dir: str, steps: list[int], plot_ready: bool | None = None
) -> list[str]:
    """Where a run's outputs are, and the commands that read them; printed last.

    `plot_ready`: whether matplotlib is importable (None: look); without it the plot line says
    what to install first, since the base install leaves plotting out.
    """
    if plot_ready is None:
        plot_ready = importlib.util.find_spec("matplotlib") is not None
    saved = f" (steps {', '.join(map(str, steps[-3:]))})" if steps else " (none saved)"
    plot = "" if plot_ready else " (needs matplotlib: pip install -e '.[plot]')"
    lines = [
        f"outputs │ {workdir}",
        f"        │ checkpoints  {ckpt_dir}{saved}",
        f"        │ metrics      {os.path.join(workdir, 'metrics.jsonl')} (TensorBoard: "
        f"tensorboard --logdir {workdir})",
        f"        │ plot         python scripts/plot.py {workdir}{plot}",
    ]
    if steps:
        lines.append(f"        │ verify       python scripts/ckpt.py verify {ckpt_dir}")
    return lines


class Console:
    """Where the run's lines go: a tqdm bar on a terminal, plain lines otherwise; process 0 only."""

    def __init__(self, main: bool, total: int, start: int):
        self.main, self.bar = main, None
        if main and terminal_width() > 0:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.main:
            print(line, flush=True)

    def step(self, step: int, total: int, m: dict[str, float], eta_s: float) -> None:
        if self.bar is None:
            if self.main:
                print(step_line(step, total, m, eta_s), flush=True)
            return
        line = step_line(step, total, m, None).split(" │ ", 1)[1]  # tqdm shows the ETA itself
        self.bar.set_postfix_str(line.split(" │ eval ")[0], refresh=False)
        evals = f"step {step}: " + ", ".join(eval_parts(m))
        if step == total:  # the bar is drawn once at 100%, not again around the last lines
            self.bar.n = total
            self.close()
            if any(k.startswith("eval_") for k in m):
                print(evals, flush=True)
        elif any(k.startswith("eval_") for k in m):
            self.bar.write(evals)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        """Ends the bar, so that the lines after it get their own."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def done_line(
    step: int,
    loss: float,
    final_eval: dict[str, float],
    record: dict[str, Any],
    items: tuple[float, str],
) -> str:
    """`done: step 300, train loss 1.6689, eval loss 1.9226 │ 3m12s, mean 5.1k tok/s`.

    The per-expert loads of a mixture of experts (`eval_moe_load_<e>`) stay in metrics.jsonl:
    one figure per expert is more than a closing line can carry. The mean throughput is the items
    (tokens or examples) this run trained over its productive seconds (goodput.py).
    """
    shown = {k: v for k, v in final_eval.items() if not k.startswith("eval_moe_load_")}
    line = f"done: step {step}, train loss {loss:.4f}"
    evals = ", ".join(eval_parts(shown))
    if evals:
        line += f", {evals}"
    line += f" │ {fmt_duration(record['total'])}"
    if record["productive"] > 0:
        count, unit = items
        line += f", mean {fmt_rate(count / record['productive'], unit)}"
    return line
