"""The network study: the same small GPT trained on emulated hosts per method and link, measured.

    python scripts/bench.py --study=network --out=FILE.json [--links=rate=1gbit,rate=50mbit]
        [--methods=xla,ring,...] [--network_steps=30]

Each row is one run of `scripts/launch.py --network=LINK -- python scripts/train.py ...` (needs
root, see docs/MULTIHOST.md): H hosts × 1 process × D devices, `mesh.data` = H·D across
`mesh.dcn_data` = H hosts, so `hierarchical` reduces inside each host before it crosses; and the
same job on loopback without `--network` (the compute-only reference: an unshaped link, the
processes on one machine). From each run's metrics.jsonl:

- `step_time_s`: median of the logged steps after the first 2 (gloo's connections, compiles);
  `step_time_p10_s`, `step_time_p90_s` the spread;
- `exposed_comm_s`: step time minus the loopback run's (what the shaped link adds);
- `kernel_bytes_per_step`: median over the steady steps of the bytes each host sent, as its link's
  counters report them (`kind: "net"`); `hlo_bytes_per_step`: the layout record's
  `cross_process_bytes_per_step` (the HLO's collectives, costed as gloo moves them);
- `time_to_target_s`: summed step times (the first 2 at the median) up to the first evaluation at
  or below the target loss (`--target_loss` if given, else `default_target`: the loopback `xla`
  run's second-last evaluation, rounded up to 0.01), null if never; `loss_within_budget`: the
  last evaluation's loss within `BUDGET_S` of training time so counted; `final_eval_loss`.

`framework` is `jaxdist` for the jaxdist methods and `ddp` for the PyTorch DDP ones
(`ddp`, `ddp_fp16`, `ddp_powersgd`: scripts/ddp_gpt.py, the same GPT, data and AdamW in PyTorch,
one process per device, `torch.nn.parallel.DistributedDataParallel` over gloo), measured the same
way: its metrics.jsonl has the same records. There is no HLO there: a DDP row's
`hlo_bytes_per_step` is gloo's ring all-reduce of the float32 gradient, 2(N-1)/N·4·params per host,
whatever the hook sends. Each row also has `load_avg`, the machine's 1-minute
load average when the run started and ended (the machine may be shared; the times are only as good
as that).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxdist import plan  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.network import profiles  # noqa: E402

LAUNCH = os.path.join(ROOT, "scripts", "launch.py")

# label -> grad_sync flags
METHODS: dict[str, tuple[str, ...]] = {
    "xla": (),
    "xla_flat": ("--config.grad_sync.algorithm=xla_flat",),
    "ring": ("--config.grad_sync.algorithm=ring",),
    "hierarchical": ("--config.grad_sync.algorithm=hierarchical",),
    "ps": ("--config.grad_sync.algorithm=ps",),
    "sharded_ps": ("--config.grad_sync.algorithm=sharded_ps",),
    "halving_doubling": ("--config.grad_sync.algorithm=halving_doubling",),
    "tree": ("--config.grad_sync.algorithm=tree",),
    "bf16": ("--config.grad_sync.compression=bf16",),
    "fp16": ("--config.grad_sync.compression=fp16",),
    "int8": ("--config.grad_sync.compression=int8",),
    "powersgd": ("--config.grad_sync.compression=powersgd", "--config.grad_sync.rank=4"),
    "ef_sign": ("--config.grad_sync.compression=ef_sign",),
    "topk": ("--config.grad_sync.compression=topk", "--config.grad_sync.topk_ratio=0.01"),
    "onebit_adam": (
        "--config.grad_sync.compression=onebit_adam",
        "--config.grad_sync.warmup_steps=2",
    ),
    "stale1": ("--config.grad_sync.staleness=1",),
    # grad_sync.overlap: each layer's gradient reduced inside the backward (jaxdist/overlap.py)
    "xla_overlap": ("--config.grad_sync.overlap=backward",),
    "ring_overlap": ("--config.grad_sync.algorithm=ring", "--config.grad_sync.overlap=backward"),
    "bf16_overlap": ("--config.grad_sync.compression=bf16", "--config.grad_sync.overlap=backward"),
    "fp16_overlap": ("--config.grad_sync.compression=fp16", "--config.grad_sync.overlap=backward"),
    # ... or each step's gradient reduced during the next step's compute (staleness 1)
    "xla_next": ("--config.grad_sync.overlap=next_step",),
    "ring_next": ("--config.grad_sync.algorithm=ring", "--config.grad_sync.overlap=next_step"),
    "bf16_next": ("--config.grad_sync.compression=bf16", "--config.grad_sync.overlap=next_step"),
    "diloco_h8": (
        "--config.grad_sync.local_steps=8",
        "--config.grad_sync.outer_optimizer=nesterov",
    ),
    "diloco_h32": (
        "--config.grad_sync.local_steps=32",
        "--config.grad_sync.outer_optimizer=nesterov",
    ),
    "streaming_h8": (
        "--config.grad_sync.local_steps=8",
        "--config.grad_sync.outer_optimizer=nesterov",
        "--config.grad_sync.fragments=2",
    ),
}
# label -> scripts/ddp_gpt.py flags (PyTorch DDP; `framework: "ddp"` rows)
DDP_METHODS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "ddp_fp16": ("--ddp_hook=fp16",),
    "ddp_powersgd": ("--ddp_hook=powersgd", "--powersgd_rank=4"),
    # starting from the parameters a jaxdist run of the same config starts from
    "ddp_jaxinit": ("--init=jaxdist",),
    "ddp_fp16_jaxinit": ("--ddp_hook=fp16", "--init=jaxdist"),
}
DDP = os.path.join(ROOT, "scripts", "ddp_gpt.py")
HOSTS, DEVICES = 2, 2
# A small GPT (0.46 M parameters, 1.8 MB of float32 gradients): its ring all-reduce over 4 devices
# on 2 hosts sends 2.8 MB per host per step, 0.45 s at 50 Mbit/s, 22 ms at 1 Gbit/s.
MODEL = (
    "--config.model.num_layers=2",
    "--config.model.d_model=128",
    "--config.model.num_heads=4",
    "--config.model.seq_len=64",
    "--config.model.vocab_size=256",
    "--config.train.batch_size=16",
    "--config.train.learning_rate=3e-3",
    "--config.train.warmup_steps=5",
    "--config.train.log_every=1",
    "--config.train.eval_batches=2",
    "--config.checkpoint.every=0",
    "--config.data.max_bytes=2000000",
    "--config.mesh.fsdp=1",
    "--config.mesh.tensor=1",
)


def framework(method: str) -> str:
    """`ddp` for the PyTorch DDP methods, else `jaxdist`."""
    return "ddp" if method in DDP_METHODS else "jaxdist"


def _load() -> float:
    return os.getloadavg()[0]


STEADY_FROM = 3  # steps 1-2 connect gloo and settle
BUDGET_S = 10.0  # `loss_within_budget`: the loss a method reaches in this much training time


def _records(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _command(
    workdir: str,
    method: str,
    link: str | None,
    steps: int,
    eval_every: int,
    devices: int,
    hosts: int = HOSTS,
) -> list[str]:
    """The launch of one row: jaxdist's train.py with `hosts` processes × `devices` CPU devices,
    or scripts/ddp_gpt.py with `hosts`·`devices` processes (one per device, `devices` per host)."""
    net = [f"--network={link}"] if link else []
    fit = [f"--config.train.steps={steps}", f"--config.train.eval_every={eval_every}"]
    if method in DDP_METHODS:
        per = [f"--processes_per_host={devices}"] if link and devices > 1 else []
        cmd = [sys.executable, LAUNCH, *net, f"--num_processes={hosts * devices}", *per]
        cmd += ["--devices_per_process=1", "--platform=cpu", "--grace_s=2", "--"]
        return cmd + [sys.executable, DDP, f"--workdir={workdir}", *MODEL, *fit,
                      *DDP_METHODS[method]]  # fmt: skip
    cmd = [sys.executable, LAUNCH, *net, f"--num_processes={hosts}"]
    cmd += [f"--devices_per_process={devices}", "--platform=cpu", "--grace_s=2", "--"]
    cmd += [sys.executable, "scripts/train.py", f"--workdir={workdir}", *MODEL, *METHODS[method]]
    mesh = [f"--config.mesh.data={hosts * devices}", f"--config.mesh.dcn_data={hosts}"]
    return cmd + mesh + fit


def _run(
    workdir: str,
    method: str,
    link: str | None,
    steps: int,
    eval_every: int,
    env: dict,
    devices: int = DEVICES,
    hosts: int = HOSTS,
) -> dict:
    cmd = _command(workdir, method, link, steps, eval_every, devices, hosts)
    load_start = _load()
    t0 = time.perf_counter()
    for attempt in range(2):  # once more after a failure: a loaded machine can starve a process
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if done.returncode == 0:
            break
        print(f"{workdir}: failed (attempt {attempt + 1}): {done.stderr[-1500:]}", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        raise RuntimeError(f"{' '.join(cmd)}\n{done.stderr[-3000:]}")
    recs = _records(workdir)
    layout = recs[0]
    train = [r for r in recs if "loss" in r and r.get("kind") is None]
    times = [r["step_time_s"] for r in train if r["step"] >= STEADY_FROM]
    evals = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
    row = {
        "step_time_s": statistics.median(times),
        "step_time_mean_s": statistics.fmean(times),
        "step_time_p10_s": statistics.quantiles(times, n=10)[0],
        "step_time_p90_s": statistics.quantiles(times, n=10)[-1],
        "step_times_s": {r["step"]: r["step_time_s"] for r in train},
        "evals": evals,
        "final_eval_loss": evals[-1][1] if evals else None,
        "hlo_bytes_per_step": layout["cross_process_bytes_per_step"],
        "hlo_messages_per_step": layout.get("cross_process_messages_per_step"),
        "hlo_messages_by_buffer": True,  # hlo_cost counts a variadic all-reduce's arrays
        "collective_bytes_per_step": layout["collective_bytes_per_step"],
        "params_total": layout["params_total"],
        "wall_s": time.perf_counter() - t0,
        "load_avg": [load_start, _load()],
    }
    if method in WARMUP and "cross_process_cheapest_branch" in layout:
        cheapest = layout["cross_process_cheapest_branch"]
        row["hlo_steady_bytes_per_step"] = cheapest["bytes_per_step"]
        row["hlo_steady_messages_per_step"] = cheapest["messages_per_step"]
    net_recs = [r for r in recs if r.get("kind") == "net" and r["step"] >= STEADY_FROM]
    if net_recs:
        row["kernel_bytes_per_step"] = [
            statistics.median(r["hosts"][f"host{h}"]["tx_bytes_per_step"] for r in net_recs)
            for h in range(hosts)
        ]
        row["kernel_bytes_per_step_mean"] = [
            statistics.fmean(r["hosts"][f"host{h}"]["tx_bytes_per_step"] for r in net_recs)
            for h in range(hosts)
        ]
    return row


def default_target(reference: dict) -> float:
    """The target loss when none is given: what the reference run (loopback `xla`) reached at its
    second-last evaluation, rounded up to 0.01, so the exact methods (the same loss but for the
    order of float additions) reach it too, and a method one evaluation slower still can."""
    evals = reference["evals"]
    return math.ceil(100 * evals[max(len(evals) - 2, 0)][1]) / 100


def _loss_within(row: dict, budget_s: float) -> float | None:
    """The last evaluation's loss reached within `budget_s` of summed step times (as `_time_to`
    counts them), or None if the first evaluation came later."""
    best = None
    for step, loss in row["evals"]:
        spent = sum(
            t if s >= STEADY_FROM else row["step_time_s"]
            for s, t in row["step_times_s"].items()
            if s <= step
        )
        if spent <= budget_s:
            best = loss
    return best


def _time_to(row: dict, target: float) -> float | None:
    """Training seconds to the first evaluation at or below `target`: the logged step times, the
    first steps' (gloo's connections, first-call costs) counted at the steady median."""
    for step, loss in row["evals"]:
        if loss <= target:
            return sum(
                t if s >= STEADY_FROM else row["step_time_s"]
                for s, t in row["step_times_s"].items()
                if s <= step
            )
    return None


# One message's latency across the emulated link, unshaped part: gloo over TCP through two veths
# and the bridge, on this shared 2-core machine. Measured: a 4-byte all-reduce over 2 hosts x 2
# devices at 50 Mbit/s took 5.7 ms (median of 20, load average 17; tests/netem_job.py
# `allreduce`, `small_times_s`), 2 messages across; tests/test_netem.py measures it each run.
MESSAGE_LATENCY_S = 2.9e-3
EXACT = ("xla", "xla_flat", "ring", "halving_doubling", "tree", "hierarchical", "ps", "sharded_ps")


def planner_hardware(
    link: str, devices_per_host: int = DEVICES, latency_s: float = MESSAGE_LATENCY_S
) -> plan.Hardware:
    """The planner's `Hardware` for an emulated link (`plan.emulated_link`): this machine's CPU
    profile (`cpu_here`: gloo's flat ring for XLA's all-reduce), each host's link of the link's
    rate shared by its devices, TCP's framing at its MTU, and per message the link's one-way delay
    plus the measured unshaped latency."""
    spec = profiles.link(link)
    return plan.emulated_link(
        spec.rate_bps, spec.delay_s + latency_s, devices_per_host, mtu=spec.mtu
    )


# Methods whose exchange runs every H-th step (DiLoCo, streaming DiLoCo): a median step is a local
# step, so these rows are compared by their mean step, which carries the sync's share.
PERIODIC = tuple(m for m, flags in METHODS.items() if any("local_steps" in f for f in flags))
# Methods that run an exact algorithm under another name: DDP's default is gloo's ring all-reduce,
# staleness 1 is XLA's all-reduce of the previous step's gradient.
SAME_ALGORITHM = {"ddp": "ring", "ddp_jaxinit": "ring", "stale1": "xla"}
# Methods with a full-precision warm-up branch; their steady state sends the cheapest branch.
WARMUP = ("onebit_adam",)


def no_exchange_step(result: dict) -> float | None:
    """The step without a gradient exchange, measured: a DiLoCo run's median step on loopback (the
    same forward, backward and AdamW; it averages only every H-th step), or None."""
    for m in ("diloco_h32", "diloco_h8"):
        if m in result.get("loopback", {}):
            return result["loopback"][m]["step_time_s"]
    return None


def compared(row: dict) -> tuple[float, float]:
    """(measured, loopback) step time the prediction is set against: the median, or for the
    periodic methods the mean."""
    if row["method"] in PERIODIC:
        return row["step_time_mean_s"], row["compute_only_step_time_mean_s"]
    return row["step_time_s"], row["compute_only_step_time_s"]


def add_predictions(result: dict, latency_s: float = MESSAGE_LATENCY_S) -> dict:
    """Each row gets `predicted_comm_s`, what the planner says the link's exchange takes per step,
    and `predicted_step_time_s`, the step it predicts (compared with `compared(row)`).

    Latency: `latency_s` per message (the study's `message_latency_s` where it measured one) plus
    the link's delay. Rows whose messages were counted per array of a variadic all-reduce
    (`_messages`) pay it for every message of the compiled step; other rows for one all-reduce's
    2(N-1).

    Exact algorithms (`EXACT`, and `SAME_ALGORITHM`'s): `plan.algorithm_cost` of the float32
    gradient (4 bytes per parameter) over `planner_hardware`. The step is the step without any
    exchange (`no_exchange_step`, where the study measured one) plus that, and never less than the
    loopback step: over the link the transfer replaces the loopback's, whose cost on these cores
    is mostly CPU time that overlaps a wire transfer. Without a no-exchange step: loopback + comm.
    Compressors and the other methods: the bytes one host sends per step as the compiled HLO says
    (`hlo_bytes_per_step`, the layout record; the cheapest branch for `WARMUP` methods; DDP's hooks:
    the hook's own ratio of the ring's) at the host link's payload rate, plus one all-reduce's
    2(N-1) message latencies, added to the loopback step: their compute (compressing, sorting,
    error feedback) is in it. For `PERIODIC` methods (bytes per step on average) the same
    replacement as for the exact ones: the loopback's median (local) step plus the larger of what
    the syncs add to its mean on loopback and the link's time.
    """
    latency_s = result.get("message_latency_s", latency_s)
    base = no_exchange_step(result)
    for row in result["runs"]:
        dev = row["devices_per_host"]
        hw = planner_hardware(row["link"], dev, latency_s)
        n = row["hosts"] * dev
        _, loopback = compared(row)
        algorithm = SAME_ALGORITHM.get(row["method"], row["method"])
        messages = _messages(row)
        if algorithm in EXACT:
            if messages is None:
                comm = plan.algorithm_cost(algorithm, 4.0 * row["params_total"], n, hw, dev).time_s
            else:  # the wire's time, and each of the compiled step's messages its latency
                wire_only = dataclasses.replace(hw, inter_latency=0.0)
                comm = plan.algorithm_cost(algorithm, 4.0 * row["params_total"], n, wire_only, dev)
                comm = comm.time_s + messages * hw.inter_latency
            own = base if base is not None and row["framework"] == "jaxdist" else None
            row["predicted_comm_s"] = comm
            row["predicted_step_time_s"] = (
                loopback + comm if own is None else max(loopback, own + comm)
            )
            continue
        sent = max(row.get("hlo_steady_bytes_per_step") or row["hlo_bytes_per_step"])
        if row["method"] in ("ddp_fp16", "ddp_fp16_jaxinit"):
            sent /= 2
        elif row["method"] == "ddp_powersgd":
            sent = None  # no HLO, and the hook's factors are not modelled here
        latency = (2 * (n - 1) if messages is None else messages) * hw.inter_latency
        comm = None if sent is None else sent / hw.host_bandwidth + latency
        row["predicted_comm_s"] = comm
        if comm is None:
            row["predicted_step_time_s"] = None
        elif row["method"] in PERIODIC:  # a local step, plus the sync's share or the link's
            local = row["compute_only_step_time_s"]
            row["predicted_step_time_s"] = local + max(loopback - local, comm)
        else:
            row["predicted_step_time_s"] = loopback + comm
    return result


def _messages(row: dict) -> float | None:
    """The most messages a host's processes send across per step, as the compiled step says
    (`hlo_cost.cross_host_traffic`, one gloo call per array of a variadic all-reduce; a `WARMUP`
    method's cheapest branch where the row has it), where the row has them counted that way
    (`hlo_messages_by_buffer`); None otherwise (DDP, older rows)."""
    if not row.get("hlo_messages_by_buffer") or not row.get("hlo_messages_per_step"):
        return None
    return max(row.get("hlo_steady_messages_per_step") or row["hlo_messages_per_step"])


def planner_table(result: dict) -> str:
    """Predicted against measured per row (Markdown): step time and what the link adds."""
    head = (
        "| hosts x devices | link | method | measured step s (p10-p90) | loopback s "
        "| predicted step s | step error | measured exposed s | predicted comm s | load avg |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for r in result["runs"]:
        pred = r.get("predicted_step_time_s")
        if pred is None:
            continue
        measured, loopback = compared(r)
        err = (pred - measured) / measured
        load = r.get("load_avg")
        mean = " mean" if r["method"] in PERIODIC else ""
        rows.append(
            f"| {r['hosts']} x {r['devices_per_host']} | {r['link']} | {r['method']} | "
            f"{measured:.3f}{mean} ({r['step_time_p10_s']:.3f}-{r['step_time_p90_s']:.3f}) | "
            f"{loopback:.3f}{mean} | {pred:.3f} | {100 * err:+.0f}% | "
            f"{measured - loopback:.3f} | {r['predicted_comm_s']:.3f} | "
            f"{'-' if not load else f'{min(load):.0f}-{max(load):.0f}'} |"
        )
    return head + "\n".join(rows)


def table(result: dict) -> str:
    """The study as a Markdown table, one row per method and link."""
    head = (
        "| link | method | step s (p10-p90) | loopback s | exposed comm s | planner comm s "
        "| kernel B/host/step | HLO B/host/step | kernel/HLO | time to target s | loss in budget "
        "| final loss |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for r in result["runs"]:
        kernel, hlo = r["kernel_bytes_per_step"], r["hlo_bytes_per_step"]
        k, h = (sum(kernel) / len(kernel) if kernel else None), sum(hlo) / len(hlo)
        pred = r.get("predicted_comm_s")
        ttt, budget = r["time_to_target_s"], r.get("loss_within_budget")
        rows.append(
            f"| {r['link']} | {r['method']} | {r['step_time_s']:.3f} ({r['step_time_p10_s']:.3f}-"
            f"{r['step_time_p90_s']:.3f}) | {r['compute_only_step_time_s']:.3f} | "
            f"{r['exposed_comm_s']:.3f} | {'-' if pred is None else f'{pred:.3f}'} | "
            f"{'-' if k is None else f'{k:,.0f}'} | {h:,.0f} | "
            f"{'-' if k is None or not h else f'{k / h:.3f}'} | "
            f"{'-' if ttt is None else f'{ttt:.1f}'} | "
            f"{'-' if budget is None else f'{budget:.3f}'} | "
            f"{r['final_eval_loss']:.3f} |"
        )
    return head + "\n".join(rows)


# jaxdist method -> the DDP method that sends the same bytes (fp32 ring, 16-bit, PowerSGD rank 4)
PAIRS = {
    "xla": "ddp",
    "xla_overlap": "ddp",
    "ring": "ddp",
    "ring_overlap": "ddp",
    "bf16": "ddp_fp16",
    "bf16_overlap": "ddp_fp16",
    "xla_next": "ddp",
    "ring_next": "ddp",
    "bf16_next": "ddp_fp16",
    "fp16": "ddp_fp16",
    "fp16_overlap": "ddp_fp16",
    "powersgd": "ddp_powersgd",
}


def side_by_side(result: dict) -> str:
    """jaxdist against PyTorch DDP as a Markdown table: per link, each jaxdist method next to the
    DDP method that sends the same bytes (`PAIRS`), with the machine's load average per run."""
    rows = {(r["link"], r["method"]): r for r in result["runs"]}
    head = (
        "| link | jaxdist method | step s (p10-p90) | loopback s | exposed s | kernel B/host/step "
        "| DDP method | step s (p10-p90) | loopback s | exposed s | kernel B/host/step "
        "| load avg (jaxdist; DDP) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )

    def cells(r: dict) -> str:
        k = r["kernel_bytes_per_step"]
        k = f"{sum(k) / len(k):,.0f}" if k else "-"
        return (
            f"{r['method']} | {r['step_time_s']:.3f} ({r['step_time_p10_s']:.3f}-"
            f"{r['step_time_p90_s']:.3f}) | {r['compute_only_step_time_s']:.3f} | "
            f"{r['exposed_comm_s']:.3f} | {k}"
        )

    def load(r: dict) -> str:
        a, b = r["compute_only_load_avg"], r["load_avg"]
        return f"{min(a + b):.0f}-{max(a + b):.0f}"

    out = []
    for link in dict.fromkeys(r["link"] for r in result["runs"]):
        for jm, dm in PAIRS.items():
            j, d = rows.get((link, jm)), rows.get((link, dm))
            if j and d:
                out.append(f"| {link} | {cells(j)} | {cells(d)} | {load(j)}; {load(d)} |")
    return head + "\n".join(out)


def _record(
    method: str, link: str, hosts: int, devices: int, row: dict, base: dict, target: float
) -> dict:
    """The study's row of `method` over `link`: its run `row` set against `base`, the same
    method's run on loopback (the compute-only step time)."""
    return {
        "framework": framework(method),
        "method": method,
        "link": link,
        "hosts": hosts,
        "devices_per_host": devices,
        "step_time_s": row["step_time_s"],
        "step_time_mean_s": row["step_time_mean_s"],
        "compute_only_step_time_mean_s": base["step_time_mean_s"],
        "step_time_p10_s": row["step_time_p10_s"],
        "step_time_p90_s": row["step_time_p90_s"],
        "compute_only_step_time_s": base["step_time_s"],
        "exposed_comm_s": row["step_time_s"] - base["step_time_s"],
        "kernel_bytes_per_step": row.get("kernel_bytes_per_step"),
        "kernel_bytes_per_step_mean": row.get("kernel_bytes_per_step_mean"),
        "hlo_bytes_per_step": row["hlo_bytes_per_step"],
        "hlo_messages_by_buffer": row.get("hlo_messages_by_buffer", False),
        "hlo_steady_bytes_per_step": row.get("hlo_steady_bytes_per_step"),
        "hlo_messages_per_step": row.get("hlo_messages_per_step"),
        "hlo_steady_messages_per_step": row.get("hlo_steady_messages_per_step"),
        "time_to_target_s": _time_to(row, target),
        "loss_within_budget": _loss_within(row, BUDGET_S),
        "final_eval_loss": row["final_eval_loss"],
        "params_total": row["params_total"],
        "evals": row["evals"],
        "step_times_s": row["step_times_s"],
        "load_avg": row["load_avg"],
        "compute_only_load_avg": base["load_avg"],
    }


def run(
    links: list[str],
    methods: list[str],
    steps: int,
    target: float | None,
    out_dir: str,
    partial_path: str | None = None,
    devices: int = DEVICES,
    hosts: int = HOSTS,
):
    """Every method on loopback and on each link, `hosts` hosts × `devices` devices each; returns the
    study's JSON object (written to `partial_path` after each row too, so a stopped study keeps
    what it measured)."""
    known = {**METHODS, **DDP_METHODS}
    bad = [m for m in methods if m not in known]
    if bad:
        raise ConfigError(f"--methods: {bad} not in the network study ({', '.join(known)})")
    if devices < 1:
        raise ConfigError(f"--network_devices={devices}: must be at least 1")
    if hosts < 2:
        raise ConfigError(f"--network_hosts={hosts}: a network needs at least 2 hosts")
    eval_every = max(steps // 3, 1)
    # No compilation cache shared between runs. Seen twice with one: the first run over the
    # network after the loopback run of the same program failed, process 1 aborted by a failed
    # coordination RPC while it compiled. Our reading, not established: the processes found
    # different things in the cache, so one waited in the first collective while the other
    # compiled, longer than the collective's timeout on this loaded machine.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    loopback = {}
    for m in methods:
        loopback[m] = _run(
            os.path.join(out_dir, f"loopback_{m}"), m, None, steps, eval_every, env, devices, hosts
        )
        print(f"loopback {m}: {loopback[m]['step_time_s'] * 1e3:.1f} ms/step", flush=True)
    ref = loopback.get("xla") or next(iter(loopback.values()))
    target = target if target is not None else default_target(ref)
    runs = []
    for link in links:
        for m in methods:
            workdir = os.path.join(out_dir, f"{link}_{m}".replace("=", "-"))
            row = _run(workdir, m, link, steps, eval_every, env, devices, hosts)
            runs.append(_record(m, link, hosts, devices, row, loopback[m], target))
            r = runs[-1]
            if partial_path:
                with open(partial_path, "w", encoding="utf-8") as f:
                    json.dump({"study": "network", "partial": True, "loopback": loopback,
                               "target_loss": target, "runs": runs}, f, indent=1)  # fmt: skip
            print(
                f"{link} {m}: {r['step_time_s'] * 1e3:.1f} ms/step (exposed "
                f"{r['exposed_comm_s'] * 1e3:.1f} ms), kernel {r['kernel_bytes_per_step']} vs "
                f"HLO {r['hlo_bytes_per_step']} B/step/host",
                flush=True,
            )
    result = add_predictions(
        {
            "study": "network",
            "steps": steps,
            "target_loss": target,
            "model_flags": list(MODEL),
            "hosts": hosts,
            "devices_per_host": devices,
            "loopback": {
                m: {k: v for k, v in r.items() if k != "step_times_s"} for m, r in loopback.items()
            },
            "runs": runs,
        }
    )
    print(table(result), flush=True)
    if any(r["framework"] == "ddp" for r in runs):
        print(side_by_side(result), flush=True)
    return result


def main(argv: list[str]) -> None:
    """`python scripts/network_study.py planner FILE.json...`: the planner against the measured
    rows of saved studies (predictions recomputed with this checkout's model), as a table."""
    if len(argv) < 2 or argv[0] != "planner":
        raise SystemExit("usage: python scripts/network_study.py planner STUDY.json...")
    runs = []
    for path in argv[1:]:
        with open(path, encoding="utf-8") as f:
            study = json.load(f)
        for r in study["runs"]:
            r.setdefault("devices_per_host", study.get("devices_per_host", DEVICES))
        runs += add_predictions(study)["runs"]
    print(planner_table({"runs": runs}))


if __name__ == "__main__":
    main(sys.argv[1:])
