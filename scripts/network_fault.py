#!/usr/bin/env python
"""One host's link goes down mid-run on the emulated cluster: what the watchdog and an elastic restart make of it.

    python scripts/network_fault.py --hosts=4 --out=runs/network_fault.json

Needs root (network namespaces, `scripts/launch.py --network`). Runs a small GPT on `--hosts`
emulated hosts (one process and one CPU device each) with `--hang_s`, `--elastic
--max_restarts=1` and `--network_fault=HOST:STEP`: once a process has reported step STEP, host
HOST's link is taken down (`ip link set eth0 down` in its namespace). The watchdog names the host,
the job restarts on the hosts that remain and resumes from its newest checkpoint. Then a
reference run starts from a copy of that same checkpoint on as many hosts (over the same links)
and trains to the same final step. Prints one row and writes JSON: the seconds from the link going
down to the watchdog naming the host (`detect_s`) and from there to the first step trained after
the restart (`recover_s`), the steps trained before the fault and the step resumed from
(`steps_lost`), and whether the losses after the resume and the final parameters equal the
reference's to the bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = (
    "--config.model.num_layers=1",
    "--config.model.d_model=64",
    "--config.model.num_heads=4",
    "--config.model.seq_len=32",
    "--config.train.log_every=1",
    "--config.train.eval_batches=1",
    "--config.train.schedule=constant",
    "--config.train.warmup_steps=2",
    "--config.data.max_bytes=1000000",
    "--config.mesh.data=-1",  # the data axis absorbs the lost host
    "--config.mesh.fsdp=1",
    "--config.mesh.tensor=1",
    "--config.checkpoint.keep=1000",  # the step resumed from stays, for the reference
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts at the start (>= 3)")
    p.add_argument(
        "--fault_host", type=int, default=-1, help="host whose link goes down (-1: last)"
    )
    p.add_argument("--fault_step", type=int, default=5, help="after this step is reported")
    p.add_argument("--steps", type=int, default=10, help="train.steps")
    p.add_argument("--every", type=int, default=2, help="checkpoint.every")
    p.add_argument("--hang_s", type=float, default=20.0, help="launch.py --hang_s")
    p.add_argument("--link", default="rate=1gbit", help="launch.py --network")
    p.add_argument("--workdir", default="runs/network_fault", help="holds both runs (replaced)")
    p.add_argument("--out", default="", help="JSON file for the row")
    a = p.parse_args(argv)
    if a.hosts < 3:
        p.error(f"--hosts={a.hosts}: must be at least 3 (the reference runs on hosts - 1 >= 2)")
    if a.fault_host < 0:
        a.fault_host = a.hosts - 1
    if not 0 <= a.fault_host < a.hosts:
        p.error(f"--fault_host={a.fault_host}: must be in 0..{a.hosts - 1}")
    if not 2 <= a.fault_step < a.steps:
        p.error(f"--fault_step={a.fault_step}: must be in 2..{a.steps - 1} (--steps={a.steps})")
    return a


def _batch(hosts: int) -> int:
    """The smallest batch of at least 12 that both device counts divide."""
    unit = math.lcm(hosts, hosts - 1)
    return unit * math.ceil(12 / unit)


def _run(cmd: list[str], log: pathlib.Path) -> tuple[int, list[tuple[float, str]]]:
    """Runs `cmd`, stdout and stderr merged; returns its code and (seconds, line) per line."""
    t0 = time.monotonic()
    lines = []
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))
            f.write(f"{lines[-1][0]:9.3f} {lines[-1][1]}\n")
            f.flush()
        return proc.wait(), lines


def _shown(cmd: list[str]) -> str:
    """`cmd` as a user would type it: `python`, paths relative to the repository."""
    words = ["python" if w == sys.executable else w for w in cmd]
    return " ".join(w.replace(f"{ROOT}{os.sep}", "") for w in words)


def _first(lines: list[tuple[float, str]], pattern: str, after: float = -1.0):
    """(seconds, match) of the first line after `after` matching `pattern`, else (None, None)."""
    for t, line in lines:
        m = re.search(pattern, line)
        if m and t > after:
            return t, m
    return None, None


def _records(workdir: pathlib.Path) -> list[dict]:
    text = (workdir / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _attempts(workdir: pathlib.Path) -> list[dict[int, float]]:
    """step -> loss of each attempt (a `layout` record starts one)."""
    out: list[dict[int, float]] = []
    for r in _records(workdir):
        if r.get("kind") == "layout":
            out.append({})
        elif "loss" in r and out:
            out[-1][r["step"]] = r["loss"]
    return out


def _params(workdir: pathlib.Path, step: int) -> dict:
    from jaxdist import checkpoint

    return checkpoint.read_arrays(str(workdir / "checkpoints"), step=step, prefix="params")


def measure(a: argparse.Namespace) -> dict:
    """Both runs; the row (see the module docstring)."""
    root = ROOT / a.workdir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    elastic, reference = root / "elastic", root / "reference"
    launch = [sys.executable, "scripts/launch.py", f"--network={a.link}", "--platform=cpu"]
    launch += ["--devices_per_process=1", "--grace_s=2"]
    train = ["--", sys.executable, "scripts/train.py", *MODEL]
    train += [f"--config.train.batch_size={_batch(a.hosts)}", f"--config.train.steps={a.steps}"]
    train += [f"--config.checkpoint.every={a.every}"]
    cmd = [*launch, f"--num_processes={a.hosts}", f"--hang_s={a.hang_s:g}", "--max_restarts=1"]
    cmd += ["--elastic", f"--network_fault={a.fault_host}:{a.fault_step}", *train]
    cmd += [f"--workdir={elastic}"]
    rc, lines = _run(cmd, root / "elastic.log")
    t_fault, fault = _first(lines, r"--network_fault: host\d+'s link is down.* reported step (\d+)")
    t_named, named = _first(lines, r"launch\.py: process (\d+) made no progress .*")
    t_restart, _ = _first(lines, r"launch\.py: restarting the job")
    t_resumed, resumed = _first(lines, r"\] resumed from \S+ at step (\d+)")
    t_step, _ = _first(lines, r"^\[0\] step +\d+/", after=t_restart or math.inf)
    attempts = _attempts(elastic) if (elastic / "metrics.jsonl").exists() else []
    row = {
        "hosts": a.hosts,
        "fault_host": a.fault_host,
        "fault_step": a.fault_step,
        "link": a.link,
        "hang_s": a.hang_s,
        "steps": a.steps,
        "checkpoint_every": a.every,
        "elastic_rc": rc,
        "named_line": named.group(0) if named else None,
        "named_process": int(named.group(1)) if named else None,
        "restarted": t_restart is not None,
        "detect_s": t_named - t_fault if t_fault is not None and t_named is not None else None,
        "recover_s": t_step - t_named if t_step is not None and t_named is not None else None,
        "steps_logged_before_fault": max(attempts[0], default=0) if attempts else None,
        "steps_reached_before_fault": int(fault.group(1)) if fault else None,
        "resumed_from": int(resumed.group(1)) if resumed else None,
        "elastic_command": _shown(cmd),
    }
    if row["resumed_from"] is not None and row["steps_reached_before_fault"] is not None:
        # the steps trained (reported to the launcher) before the fault that were trained again
        row["steps_lost"] = row["steps_reached_before_fault"] - row["resumed_from"]
    if rc != 0 or t_resumed is None:
        return row
    # The reference: the same checkpoint, as many hosts as remain, the same final step.
    step = row["resumed_from"]
    (reference / "checkpoints").mkdir(parents=True)
    shutil.copytree(elastic / "checkpoints" / str(step), reference / "checkpoints" / str(step))
    ref = [*launch, f"--num_processes={a.hosts - 1}", *train, f"--workdir={reference}"]
    ref_rc, _ = _run(ref, root / "reference.log")
    row.update(reference_rc=ref_rc, reference_command=_shown(ref))
    if ref_rc != 0:
        return row
    after = _attempts(elastic)[-1]
    want = _attempts(reference)[-1]
    row["equal_losses"] = after == want and sorted(after) == list(range(step + 1, a.steps + 1))
    got, ref_params = _params(elastic, a.steps), _params(reference, a.steps)
    row["equal_params"] = (
        bool(got)
        and sorted(got) == sorted(ref_params)
        and all(v.tobytes() == ref_params[k].tobytes() for k, v in got.items())
    )
    return row


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    row = measure(a)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=1)
    fmt = lambda v: "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    print("| hosts | link down | named | detect s | recover s | reached | resumed | lost | equal |")
    print(
        f"| {a.hosts} -> {a.hosts - 1} | host{a.fault_host} after step {a.fault_step} | "
        f"process {fmt(row['named_process'])} | {fmt(row['detect_s'])} | "
        f"{fmt(row['recover_s'])} | {fmt(row['steps_reached_before_fault'])} | "
        f"{fmt(row['resumed_from'])} | {fmt(row.get('steps_lost'))} | "
        f"losses {fmt(row.get('equal_losses'))}, params {fmt(row.get('equal_params'))} |"
    )
    ok = row["elastic_rc"] == 0 and row.get("equal_params") and row.get("equal_losses")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
