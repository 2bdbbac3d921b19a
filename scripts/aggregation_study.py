"""`scripts/bench.py --study=aggregation`: all-reduce algorithms, parameter servers and staleness.

Three tables (docs/AGGREGATION.md quotes them):
  measured   per `grad_sync.algorithm` on the config's mesh: the gradient bytes S per device, the
             busiest device's bytes sent + received per step and the sequential collective steps
             of the data-axis reduction (both read from the compiled HLO, `hlo_cost.
             collective_phases`), and the median step time on these (simulated) devices.
  predicted  the planner's α-β time of one gradient all-reduce (`plan.algorithm_cost`) of a
             `--planner_config` model's float32 gradient, pure data parallelism, 8 → 4096 devices
             on NVLink+InfiniBand (h100_nvlink_ib) and cloud Ethernet (cloud_ethernet).
  staleness  steps to `--target_loss` validation loss for each `grad_sync.staleness` in `--taus`,
             and the validation curve (plot next to the JSON).
  per_hop    bf16 / int8 compression of the whole reduction against the same at every ring hop
             (with error feedback): busiest-device bytes and validation loss after `--max_steps`
             steps.
  per_hop_topk
             the same for top-k at 10%: all-gathered over the whole reduction, or at every hop.
  compress_over
             `hierarchical` compressing only its cross-host stage (compress_over=dcn, bf16 /
             int8) against compressing the whole reduction and against exact `xla`: busiest-
             device bytes in total and across hosts, validation loss after `--max_steps` steps.
             On one process the two hosts are emulated (`emulated_hosts`); under
             scripts/launch.py on 2 processes with `mesh.dcn_data=2` they are the processes.
  streaming  plain DiLoCo against streaming DiLoCo (fragments, overlap, int8 outer gradients) at
             the config's `grad_sync.local_steps`: the costliest single sync and the mean bytes
             per step (HLO), validation loss after `--max_steps` steps.

`rows` (bench.py's `--rows`, 1-based) picks rows of the per_hop, per_hop_topk, compress_over and
streaming tables, in each the rows it holds; the default is every row.

No flags here: bench.py passes their values in.
"""

from __future__ import annotations

import importlib.util
import os

import benchlib

PROFILES = ("h100_nvlink_ib", "cloud_ethernet")
DEVICES = (8, 64, 512, 4096)


def _variant(config, dcn_data: int | None = None, **grad_sync):
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
        for k, v in grad_sync.items():
            cfg.grad_sync[k] = v
        if dcn_data is not None:
            cfg.mesh.dcn_data = dcn_data
    return cfg


def measured(config, m, ds, steps: int, warmup: int) -> list[dict]:
    """One row per algorithm that runs on this mesh (hierarchical needs mesh.dcn_data > 1)."""
    import numpy as np

    from jaxdist import allreduce, hlo_cost, mesh
    from jaxdist.errors import ConfigError

    rows = []
    for name in allreduce.ALGORITHMS:
        cfg = _variant(config, algorithm=name)
        try:
            engine, batches = benchlib.build(cfg, m, ds)
        except ConfigError as e:
            rows.append({"algorithm": name, "skipped": str(e)})
            continue
        batch = batches.get(0)
        compiled = engine.train_step.lower(engine.abstract_state, batch).compile()
        processes = [d.process_index for d in m.devices.flat]
        phases, busiest = hlo_cost.collective_phases(
            compiled.as_text(), mesh.mesh_shape(m), processes
        )
        # The gradient's phases: over `data` (with fsdp where XLA fuses the two), not the loss's
        # 4-byte mean.
        data = [p for p in phases if "data" in p["axes"].split("+") and p["busiest_bytes"] > 64]
        shards = np.prod([m.shape[a] for a in ("fsdp", "tensor", "pipeline")])
        _, times = benchlib.timed(compiled, engine.init(), batch, steps, warmup)
        rows.append(
            {
                "algorithm": name,
                "strategy": engine.strategy,
                "grad_bytes": engine.num_params * 4 / float(shards),
                "data_steps": sum(p["steps"] for p in data),
                "data_busiest_bytes": sum(p["busiest_bytes"] for p in data),
                "busiest_device_bytes_per_step": busiest,
                "phases": phases,
                **benchlib.stats(times),
            }
        )
    return rows


def _load_config(path: str):
    spec = importlib.util.spec_from_file_location("planner_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def predicted(planner_config: str) -> dict:
    """The planner's cost of every algorithm for the model's float32 gradient, 8 → 4096 devices."""
    from jaxdist import allreduce, plan
    from jaxdist.errors import ConfigError

    model = plan.model_info(_load_config(planner_config))
    size = model.num_params * 4.0
    rows = []
    for profile in PROFILES:
        hw = plan.PROFILES[profile]
        for n in DEVICES:
            for name in allreduce.ALGORITHMS:
                try:
                    c = plan.algorithm_cost(name, size, n, hw)
                except ConfigError:
                    continue
                rows.append({"hardware": profile, "devices": n, **vars(c)})
    return {"config": planner_config, "grad_bytes": size, "rows": rows}


def staleness(config, m, ds, taus, target: float, max_steps: int, eval_every: int) -> list[dict]:
    """Steps to `target` validation loss per staleness tau, and each run's validation curve."""
    import numpy as np

    runs = []
    for tau in taus:
        cfg = _variant(config, staleness=tau)
        engine, batches = benchlib.build(cfg, m, ds)
        val = [batches.get(i, "val") for i in range(cfg.train.eval_batches)]
        state, reached, curve = engine.init(), None, []
        for step in range(1, max_steps + 1):
            state, _ = engine.train_step(state, batches.get(step - 1))
            if step % eval_every == 0 or step == max_steps:
                loss = float(np.mean([float(engine.eval_step(state, v)["loss"]) for v in val]))
                curve.append((step, loss))
                if reached is None and loss <= target:
                    reached = step
        runs.append({"staleness": tau, "steps_to_target": reached, "curve": curve})
        print(
            f"staleness {tau}: {reached or '—'} steps to val loss {target}, "
            f"final {curve[-1][1]:.3f}",
            flush=True,
        )
    return runs


# (label, grad_sync fields): the whole reduction compressed vs compressed at every ring hop.
PER_HOP = [
    ("none", {}),
    ("bf16 (whole reduction)", {"compression": "bf16"}),
    ("ring + bf16 per hop", {"algorithm": "ring", "compression": "bf16"}),
    ("int8 (whole reduction)", {"compression": "int8"}),
    ("ring + int8 per hop", {"algorithm": "ring", "compression": "int8"}),
]
# top-k (10%, error feedback) over the whole reduction (values + indices all-gathered) against
# top-k at every ring hop (the receiver densifies and adds): `--parts=per_hop_topk`.
PER_HOP_TOPK = [
    ("topk 10% (whole reduction)", {"compression": "topk", "topk_ratio": 0.1}),
    ("ring + topk 10% per hop", {"algorithm": "ring", "compression": "topk", "topk_ratio": 0.1}),
]


def _val_loss_after(engine, compiled, batches, max_steps: int, eval_batches: int) -> float:
    """Mean validation loss on `eval_batches` batches after `max_steps` steps from init."""
    import jax
    import numpy as np

    state = engine.init()
    for step in range(max_steps):
        # Synchronised: hundreds of queued XLA:CPU steps can starve a collective's rendezvous.
        state, _ = jax.block_until_ready(compiled(state, batches.get(step)))
    val = [batches.get(i, "val") for i in range(eval_batches)]
    return float(np.mean([float(engine.eval_step(state, v)["loss"]) for v in val]))


def per_hop(
    config, m, ds, max_steps: int, eval_batches: int = 4, rows=PER_HOP, hosts: int | None = None
) -> list[dict]:
    """Busiest-device bytes (HLO) and validation loss after `max_steps` for each of `rows`
    ((label, `_variant` fields)); with `hosts` > 1 also the busiest bytes of the phases that
    cross hosts (tier dcn), the devices of `data` split into `hosts` consecutive groups (by
    default the most `dcn_data` of `rows`)."""
    from jaxdist import hlo_cost, mesh

    hosts = hosts or max(int(f.get("dcn_data", 1)) for _, f in rows)
    processes = emulated_hosts(m, hosts)
    out = []
    for label, fields in rows:
        engine, batches = benchlib.build(_variant(config, **fields), m, ds)
        batch = batches.get(0)
        compiled = engine.train_step.lower(engine.abstract_state, batch).compile()
        phases, busiest = hlo_cost.collective_phases(
            compiled.as_text(), mesh.mesh_shape(m), processes
        )
        loss = _val_loss_after(engine, compiled, batches, max_steps, eval_batches)
        row = {"method": label, "busiest_device_bytes_per_step": busiest, "val_loss": loss}
        if hosts > 1:
            row["dcn_busiest_bytes"] = sum(p["busiest_bytes"] for p in phases if p["tier"] == "dcn")
        out.append(row)
        dcn = f"{row['dcn_busiest_bytes'] / 2**20:>10.3f} MiB across" if hosts > 1 else ""
        print(
            f"{label:<34}{busiest / 2**20:>10.3f} MiB busiest{dcn}{loss:>9.4f} val loss", flush=True
        )
    return out


# (label, `_variant` fields): hierarchical exact within 2 hosts and compressed across them only,
# against compressing the whole reduction and against exact.
COMPRESS_OVER = [
    ("none (xla, exact)", {}),
    ("hierarchical, exact", {"algorithm": "hierarchical", "dcn_data": 2}),
    ("bf16 (whole reduction)", {"compression": "bf16"}),
    (
        "hierarchical + bf16 across hosts",
        {"algorithm": "hierarchical", "compression": "bf16", "compress_over": "dcn", "dcn_data": 2},
    ),
    ("int8 (whole reduction)", {"compression": "int8"}),
    (
        "hierarchical + int8 across hosts",
        {"algorithm": "hierarchical", "compression": "int8", "compress_over": "dcn", "dcn_data": 2},
    ),
]


def emulated_hosts(m, hosts: int) -> list[int]:
    """Each device's host for the tier accounting: the process it is on when the mesh spans
    processes, else (one process) `hosts` consecutive blocks of the `data` axis, the layout
    `mesh.dcn_data` = `hosts` gives on that many processes (dcn-major). `hierarchical` reads its
    hosts from `mesh.dcn_data` and compiles the same collective-permutes either way; only where
    the devices live differs."""
    import numpy as np

    if hosts == 1 or len({d.process_index for d in m.devices.flat}) > 1:
        return [d.process_index for d in m.devices.flat]
    axis, local = m.axis_names.index("data"), m.shape["data"] // hosts
    return [index[axis] // local for index, _ in np.ndenumerate(m.devices)]


def _compress_over_hosts(config) -> str:
    """How the compress_over rows get their 2 hosts: "emulated_hosts" on one process (the mesh
    without `dcn_data`, as `emulated_hosts` splits it), "processes" on 2 real processes (under
    scripts/launch.py, the mesh with `mesh.dcn_data=2`: one host per process).

    Raises:
      ConfigError: several processes, but not 2 with `mesh.dcn_data=2`.
    """
    import jax

    from jaxdist.errors import ConfigError

    if jax.process_count() == 1:
        return "emulated_hosts"
    if jax.process_count() != 2 or int(config.mesh.get("dcn_data", 1)) != 2:
        raise ConfigError(
            "--parts=compress_over on several processes: its rows split 2 hosts, so run it on 2 "
            f"processes with --config.mesh.dcn_data=2 (got {jax.process_count()} processes, "
            f"mesh.dcn_data={config.mesh.get('dcn_data', 1)})"
        )
    return "processes"


# (label, grad_sync fields) on top of the config's local SGD / DiLoCo (grad_sync.local_steps = H).
STREAMING = [
    ("DiLoCo", {}),
    ("streaming F=2", {"fragments": 2}),
    ("streaming F=2, tau=1", {"fragments": 2, "outer_overlap": 1}),
    (
        "streaming F=2, tau=1, int8",
        {"fragments": 2, "outer_overlap": 1, "outer_quantization": "int8"},
    ),
    (
        "streaming F=2, tau=1, int4",
        {"fragments": 2, "outer_overlap": 1, "outer_quantization": "int4"},
    ),
]


def streaming_rows(
    config, m, ds, max_steps: int, eval_batches: int = 4, table=STREAMING
) -> list[dict]:
    """Per STREAMING row: the costliest single sync and the mean collective bytes per step of one
    device (both from the compiled HLO), and validation loss after `max_steps` steps."""
    from jaxdist import hlo_cost, streaming

    h = config.grad_sync.local_steps
    rows = []
    for label, fields in table:
        engine, batches = benchlib.build(_variant(config, **fields), m, ds)
        compiled = engine.train_step.lower(engine.abstract_state, batches.get(0)).compile()
        text = compiled.as_text()
        peak = streaming.peak_sync_bytes(text)
        mean = sum(hlo_cost.collective_bytes(text, conditional_period=h).values())
        loss = _val_loss_after(engine, compiled, batches, max_steps, eval_batches)
        rows.append({"method": label, "peak_bytes": peak, "bytes_per_step": mean, "val_loss": loss})
        print(
            f"{label:<30}{peak / 2**20:>9.3f} MiB peak{mean / 2**20:>9.3f} MiB/step"
            f"{loss:>9.4f} val loss",
            flush=True,
        )
    return rows


def plot_staleness(runs: list[dict], target: float, png: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        steps, losses = zip(*r["curve"], strict=True)
        ax.plot(steps, losses, label=f"staleness {r['staleness']}")
    ax.axhline(target, color="gray", linestyle=":", label=f"target {target}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


def print_tables(out: dict) -> None:
    print(f"{'algorithm':<17}{'S MiB':>8}{'busiest MiB':>13}{'steps':>7}{'step ms':>9}")
    for r in out["measured"]:
        if "skipped" in r:
            print(f"{r['algorithm']:<17}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['algorithm']:<17}{r['grad_bytes'] / 2**20:>8.3f}"
            f"{r['data_busiest_bytes'] / 2**20:>13.3f}{r['data_steps']:>7}"
            f"{1e3 * r['median_s']:>9.1f}"
        )
    pred = out["predicted"]
    print(f"planner: one all-reduce of {pred['grad_bytes'] / 2**30:.2f} GiB ({pred['config']}), ms")
    names = list(dict.fromkeys(r["algorithm"] for r in pred["rows"]))
    print(f"{'hardware':<16}{'N':>6}" + "".join(f"{n:>17}" for n in names))
    for profile in PROFILES:
        for n in DEVICES:
            cells = {
                r["algorithm"]: r["time_s"]
                for r in pred["rows"]
                if r["hardware"] == profile and r["devices"] == n
            }
            row = "".join(f"{1e3 * cells[a]:>17.1f}" if a in cells else f"{'-':>17}" for a in names)
            print(f"{profile:<16}{n:>6}" + row)


ROW_TABLES = {
    "per_hop": PER_HOP,
    "per_hop_topk": PER_HOP_TOPK,
    "compress_over": COMPRESS_OVER,
    "streaming": STREAMING,
}


def picked(table: list, rows: list[int] | None) -> list:
    """`table`'s rows numbered (1-based) in `rows` that it holds, in table order; all for None."""
    return table if rows is None else [r for i, r in enumerate(table, 1) if i in rows]


def check_rows(parts, rows: list[int] | None) -> None:
    """Refuses `rows` that pick no row of some requested table (one line, before anything runs)."""
    from jaxdist.errors import ConfigError

    for part in (p for p in parts if p in ROW_TABLES and rows is not None):
        if not picked(ROW_TABLES[part], rows):
            n = len(ROW_TABLES[part])
            raise ConfigError(
                f"--rows={','.join(map(str, rows))}: --parts={part} has rows 1 to {n}, none of "
                f"them picked; name at least one (e.g. --rows=1)"
            )


def run(
    config,
    *,
    parts,
    steps,
    warmup,
    taus,
    target,
    max_steps,
    eval_every,
    planner_config,
    out_path,
    rows=None,
):
    """The study's `parts` ("algorithms": measured + predicted, "staleness", "per_hop",
    "per_hop_topk", "compress_over", "streaming"), the tables' `rows` (1-based; None: all); the
    JSON payload."""
    import jax

    from jaxdist import data, mesh

    check_rows(parts, rows)

    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    m = mesh.make_mesh(config.mesh)
    out = {
        "study": "aggregation",
        "device": jax.devices()[0].device_kind,
        "mesh": mesh.mesh_shape(m),
    }
    if "algorithms" in parts:
        out["measured"] = measured(config, m, ds, steps, warmup)
        out["predicted"] = predicted(planner_config)
        print_tables(out)
    if "per_hop" in parts:
        got = per_hop(config, m, ds, max_steps, rows=picked(PER_HOP, rows))
        out["per_hop"] = {"steps": max_steps, "runs": got}
    if "per_hop_topk" in parts:
        got = per_hop(config, m, ds, max_steps, rows=picked(PER_HOP_TOPK, rows))
        out["per_hop_topk"] = {"steps": max_steps, "runs": got}
    if "compress_over" in parts:
        made_by = _compress_over_hosts(config)  # "emulated_hosts" or "processes", 2 of them
        got = per_hop(config, m, ds, max_steps, rows=picked(COMPRESS_OVER, rows), hosts=2)
        out["compress_over"] = {"steps": max_steps, made_by: 2, "runs": got}
    if "streaming" in parts:
        h = config.grad_sync.local_steps
        got = streaming_rows(config, m, ds, max_steps, table=picked(STREAMING, rows))
        out["streaming"] = {"steps": max_steps, "local_steps": h, "runs": got}
    if "staleness" in parts:
        runs = staleness(config, m, ds, taus, target, max_steps, eval_every)
        out["staleness"] = {"target_loss": target, "runs": runs}
        png = os.path.splitext(out_path)[0] + "_staleness.png"
        out["plot"] = plot_staleness(runs, target, png)
    return out
