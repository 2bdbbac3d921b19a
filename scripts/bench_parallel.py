"""`bench.py --study=context` and `--study=moe`: context and expert parallelism on small sizes.

context  temp memory per device (compiled memory analysis) and step time vs sequence length T for
         mesh.context = 1, 2, 4, 8 (`--contexts`; data = 8 / context, one sequence per data replica, so every
         device holds T / context tokens of one sequence), ring and all_gather attention.
moe      step time and tokens/s vs the number of experts at equal active and equal total expert
         parameters (E experts of width 128·4/E, top E/4: finer experts, same FLOPs; MaxText
         #1256's question), dropless vs capacity factor 1.25, on mesh.expert=4 × data=2; with the
         dropped fraction and the all-to-all bytes per step from the compiled HLO.

No flags are defined here; `bench.py` passes its own.
"""

from __future__ import annotations

import statistics

from benchlib import build, timed


def _run(cfg, ds, steps: int, warmup: int) -> dict:
    """Compiles and times `cfg`'s train step: temp bytes, collective bytes, step time, metrics."""
    import numpy as np

    from jaxdist import hlo_cost, mesh

    engine, batches = build(cfg, mesh.make_mesh(cfg.mesh), ds)
    batch = batches.get(0)
    abstract = engine.abstract_batch(
        batches.global_shapes(), {"inputs": np.int32, "targets": np.int32}
    )
    compiled = engine.train_step.lower(engine.abstract_state, abstract).compile()
    state = engine.init()
    state, times = timed(engine.train_step, state, batch, steps, warmup)
    _, m = engine.train_step(state, batch)
    step_s = statistics.median(times)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    return {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "collective_bytes": hlo_cost.collective_bytes(compiled.as_text()),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "loss": float(m["loss"]),
        "dropped": float(m.get("moe_dropped", 0.0)),
    }


def study_context(
    config, lengths: list[int], steps: int, warmup: int, contexts: list[int] = (1, 2, 4, 8)
) -> dict:
    from jaxdist import data

    out = {"study": "context", "runs": []}
    print(f"{'mode':<11}{'T':>6}{'ctx':>5}{'temp MiB':>10}{'ratio':>7}{'step ms':>9}{'tok/s':>9}")
    for mode in ("ring", "all_gather"):
        for T in lengths:
            base = None
            for c in contexts:
                cfg = config.copy_and_resolve_references()
                with cfg.unlocked():
                    cfg.mesh.update(data=8 // c, fsdp=1, tensor=1, pipeline=1, expert=1, context=c)
                    cfg.model.seq_len, cfg.model.context_attention = T, mode
                    cfg.train.batch_size, cfg.train.grad_accum = 8 // c, 1
                ds = data.load(cfg.data, seq_len=T, vocab_size=cfg.model.vocab_size)
                r = _run(cfg, ds, steps, warmup) | {"mode": mode, "seq_len": T, "context": c}
                base = base or r["temp_bytes"]
                r["temp_ratio"] = r["temp_bytes"] / base
                out["runs"].append(r)
                print(
                    f"{mode:<11}{T:>6}{c:>5}{r['temp_bytes'] / 2**20:>10.1f}{r['temp_ratio']:>7.2f}"
                    f"{r['step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>9.0f}",
                    flush=True,
                )
    return out


def study_moe(config, experts: list[int], steps: int, warmup: int) -> dict:
    from jaxdist import data

    out = {"study": "moe", "runs": []}
    print(
        f"{'E':>4}{'k':>4}{'F':>5}{'capacity':>10}{'step ms':>9}{'tok/s':>9}{'dropped':>9}{'a2a KiB':>9}"
    )
    ds = None
    for E in experts:
        for factor in (0.0, 1.25):
            cfg = config.copy_and_resolve_references()
            with cfg.unlocked():
                cfg.mesh.update(data=2, fsdp=1, tensor=1, pipeline=1, expert=4, context=1)
                cfg.model.num_experts, cfg.model.experts_per_token = E, max(1, E // 4)
                cfg.model.mlp_dim = max(1, 512 // E)
                cfg.model.moe_capacity_factor = factor
            ds = ds or data.load(
                cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size
            )
            r = _run(cfg, ds, steps, warmup)
            r |= {
                "experts": E,
                "top_k": cfg.model.experts_per_token,
                "expert_width": cfg.model.mlp_dim,
            }
            r["capacity_factor"] = factor
            out["runs"].append(r)
            a2a = r["collective_bytes"].get("all-to-all", 0.0) / 2**10
            label = "dropless" if factor == 0 else f"{factor:g}"
            print(
                f"{E:>4}{r['top_k']:>4}{r['expert_width']:>5}{label:>10}{r['step_s'] * 1e3:>9.1f}"
                f"{r['tokens_per_s']:>9.0f}{r['dropped']:>9.3f}{a2a:>9.0f}",
                flush=True,
            )
    return out
