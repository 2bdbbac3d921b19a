#!/usr/bin/env python
"""What one kill -9 costs a job, with and without the fast checkpoint tier.

    python scripts/restart_bench.py --num_processes=2 --kill_after=9 --out=runs/restart.json

Runs the same small multi-process GPT job (`scripts/launch.py --max_restarts=1`, persistent saves
every `--every` steps) twice: with `checkpoint.local_every=0` and with `--local_every`. In each,
process 1 is killed with SIGKILL once the job has logged step `--kill_after`; the launcher
restarts the job (`--elastic`: on the processes that remain, one fewer, the fast tier then
reassembled onto the new layout), which resumes from the newest checkpoint of either tier. Prints
a table and writes JSON rows: the step reached before the kill, the step resumed from, steps lost,
the job's goodput record (`restart` and `recomputed` seconds, goodput), and the fast tier's save
time per save and bytes per process (from its `fast_tier` records).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = (
    "--config.model.num_layers=1",
    "--config.model.d_model=64",
    "--config.model.num_heads=4",
    "--config.model.seq_len=32",
    "--config.train.batch_size=16",
    "--config.train.log_every=1",
    "--config.train.eval_batches=1",
    "--config.train.schedule=constant",
    "--config.train.warmup_steps=2",
    "--config.data.max_bytes=1000000",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=-1",
    "--config.mesh.tensor=1",
)


def _records(workdir: pathlib.Path) -> list[dict]:
    out = []
    try:
        for line in (workdir / "metrics.jsonl").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
    except OSError:
        pass
    return out


def _last_step(workdir: pathlib.Path) -> int:
    return max((r["step"] for r in _records(workdir) if "loss" in r), default=0)


def _rank_pid(workdir: pathlib.Path, rank: int) -> int | None:
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(workdir).encode() in cmdline and f"JAXDIST_PROCESS_ID={rank}".encode() in environ:
            return int(entry.name)
    return None


def run_one(args, root: pathlib.Path, local_every: int) -> dict:
    """One job with one kill -9 of process 1; its row."""
    workdir = root / f"fast{local_every}-{os.getpid()}"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "launch.py"),
        f"--num_processes={args.num_processes}",
        f"--devices_per_process={args.devices_per_process}",
        "--grace_s=2",
        "--max_restarts=1",
        *(["--elastic"] if args.elastic else []),
        "--",
        "python",
        "scripts/train.py",
        f"--workdir={workdir}",
        *MODEL,
        f"--config.train.steps={args.steps}",
        f"--config.checkpoint.every={args.every}",
        f"--config.checkpoint.local_every={local_every}",
        f"--config.checkpoint.local_dir={root / f'local{local_every}'}",
    ]
    log = open(root / f"fast{local_every}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.deadline_s
    while _last_step(workdir) < args.kill_after:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the job never reached step {args.kill_after}: see {log.name}")
        time.sleep(0.05)
    pid = _rank_pid(workdir, 1)
    if pid is None:
        raise SystemExit("process 1 not found")
    killed_at = _last_step(workdir)
    os.kill(pid, signal.SIGKILL)
    rc = proc.wait(timeout=args.deadline_s)
    log.close()
    text = (root / f"fast{local_every}.log").read_text()
    if rc != 0:
        raise SystemExit(f"the job failed (exit {rc}): see {log.name}\n{text[-2000:]}")
    records = _records(workdir)
    job = next(r for r in records if r.get("kind") == "goodput_job")
    resumed = [ln for ln in text.splitlines() if "resumed from" in ln or "checkpoint tier" in ln]
    resumed_step = 0
    for line in text.splitlines():
        if "resumed from the fast tier at step" in line or "resumed from " in line:
            resumed_step = int(line.rsplit("step", 1)[1].split()[0])
    saves = [r for r in records if r.get("kind") == "fast_tier"]
    return {
        "local_every": local_every,
        "checkpoint_every": args.every,
        "processes": args.num_processes,
        "restarted_on": args.num_processes - 1 if args.elastic else args.num_processes,
        "killed_after_step": killed_at,
        "resumed_from_step": resumed_step,
        "steps_lost": killed_at - resumed_step,
        "tier_lines": resumed,
        "job_goodput": job,
        "fast_save_s_median": statistics.median(r["save_s"] for r in saves) if saves else None,
        "fast_bytes_per_process": saves[-1]["bytes"] if saves else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=20, help="persistent saves (steps)")
    parser.add_argument("--local_every", type=int, default=2, help="fast-tier saves (steps)")
    parser.add_argument("--kill_after", type=int, default=9, help="kill once this step is logged")
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="restart on the processes that remain (launch.py --elastic): one fewer",
    )
    parser.add_argument("--deadline_s", type=float, default=400.0)
    parser.add_argument("--out", default="", help="JSON file for the rows")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        parser.error(f"--kill_after={args.kill_after} must be in 1..{args.steps - 1}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="restart-bench-") as tmp:
        for local_every in (0, args.local_every):
            rows.append(run_one(args, pathlib.Path(tmp), local_every))
    print(
        "| fast tier | killed after | resumed from | steps lost | restart s | recomputed s "
        "| job goodput | fast save s | fast bytes/process |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        job = r["job_goodput"]
        save = "-" if r["fast_save_s_median"] is None else f"{r['fast_save_s_median']:.4f}"
        print(
            f"| {'every ' + str(r['local_every']) if r['local_every'] else 'off'} "
            f"| {r['killed_after_step']} | {r['resumed_from_step']} | {r['steps_lost']} "
            f"| {job['restart']:.1f} | {job.get('recomputed', 0):.1f} "
            f"| {100 * job['goodput']:.1f}% | {save} | {r['fast_bytes_per_process']} |"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
