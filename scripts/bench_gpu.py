"""GPU ground truth, one phase per process: `scripts/gpu_check.sh` runs them all and joins the table.

    python scripts/bench_gpu.py --phase=env --out_dir=runs/gpu_check
    python scripts/bench_gpu.py --phase=correct --out_dir=runs/gpu_check
    python scripts/bench_gpu.py --phase=point --out_dir=runs/gpu_check --label=gpt_1b_b16 \
        --config=configs/gpt_1b.py --config.train.batch_size=16 [--hand]
    python scripts/bench_gpu.py --phase=report --out_dir=runs/gpu_check

Phases:
  env      jax / jaxlib / CUDA / cuDNN versions, device kind and memory → env.json.
  correct  the default job for 20 steps (finite, loss falls); `model.attention=cudnn` against `xla`
           logits on gpt_small in bf16 (on a machine without cuDNN: that `cudnn` is refused with
           one line); two train steps of every model family config (parameters must move) → correct.json.
  point    one compiled train step: compile time, ≥ --steps timed steps after --warmup (median,
           10th–90th percentile), tokens/s, MFU (6·N + 12·L·d·T FLOPs per token, N without the
           embedding table, over the device's dense bf16 peak), compiled memory and the allocator's
           peak, the planner's predicted step time and memory, the GEMMs of the compiled HLO (FP8
           cuBLASLt calls apart, against 3 per block weight per layer when
           train.matmul_precision=fp8); --fit_layers=N first sets the most layers, up to N, that
           the planner predicts fit the device; with --hand also the hand-written step of the
           same model (benchlib.hand_written_step) and the ratio → points/LABEL.json.
  report   every JSON above, decode.json (scripts/bench_data.py --study=decode --vs_transformers)
           and notes.txt → gpu_check.json and gpu_check.md (printed).

Each point runs in its own process: XLA flags are read once per process, and the allocator's peak
(`memory_stats()["peak_bytes_in_use"]`) then belongs to that point alone.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchlib  # noqa: E402
from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402

_PHASE = flags.DEFINE_enum("phase", "point", ["env", "correct", "point", "report"], "What to run.")
_OUT_DIR = flags.DEFINE_string("out_dir", "runs/gpu_check", "Where the JSON and the table go.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gpt_small.py", "--phase=point: the config measured.", lock_config=True
)
_LABEL = flags.DEFINE_string("label", "point", "--phase=point: the row's name (and file name).")
_HAND = flags.DEFINE_bool("hand", False, "--phase=point: also time the hand-written step.")
_STEPS = flags.DEFINE_integer("steps", 20, "--phase=point: timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "--phase=point: untimed steps after compiling.")
_HARDWARE = flags.DEFINE_string(
    "hardware", "", "Planner profile for the prediction (default: by device kind)."
)
_PROFILE = flags.DEFINE_integer(
    "profile", 0, "--phase=point: trace this many extra steps and sum device time per kernel."
)
_FIT_LAYERS = flags.DEFINE_integer(
    "fit_layers",
    0,
    "--phase=point: the most layers whose planner-predicted memory fits the device (this many at "
    "most; layers unrolled); 0 = the config's own model.num_layers.",
)
_FP8_LOWERING = flags.DEFINE_enum(
    "fp8_lowering",
    "direct",
    ["direct", "qdq"],
    "--phase=point: how FP8 matmuls reach XLA (jaxdist.fp8.LOWERINGS); rows with "
    "train.matmul_precision=fp8 also save their compiled HLO (gzip) under OUT_DIR/hlo.",
)
_TINY = flags.DEFINE_bool(
    "tiny",
    False,
    "--phase=correct: CPU dry run sizes (tiny GPT for the attention check, 6 default-job steps).",
)

MFU_FORMULA = "6·N + 12·L·d·T FLOPs per token, N without the embedding table"


def _write(name: str, record: dict) -> str:
    path = os.path.join(_OUT_DIR.value, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
    return path


def _error_line(e: BaseException) -> str:
    """The one line that says what failed (an XLA error's first line, not its dump)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


# --------------------------------------------------------------------------------------------------
# env
# --------------------------------------------------------------------------------------------------


def _cuda_versions() -> dict:
    """CUDA runtime/driver and cuDNN versions as jaxlib's CUDA plugin reports them (if present)."""
    out = {}
    try:
        from jax._src.lib import cuda_versions  # jaxlib's CUDA plugin, where installed
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for key, fn in (
            ("cuda_runtime", "cuda_runtime_get_version"),
            ("cuda_driver", "cuda_driver_get_version"),
            ("cudnn", "cudnn_get_version"),
            ("cublas", "cublas_get_version"),
            ("nccl", "nccl_get_version"),
        ):
            try:
                out[key] = getattr(cuda_versions, fn)()
            except Exception:  # noqa: BLE001 -- a missing getter is just not reported
                pass
    return out


def phase_env() -> dict:
    import importlib.metadata as md

    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    plugins = sorted(
        d.metadata["Name"] for d in md.distributions() if "cuda" in d.metadata["Name"].lower()
    )
    record = {
        "python": platform.python_version(),
        "versions": versions,
        "cuda_plugins": [f"{p} {md.version(p)}" for p in plugins if "jax" in p.lower()],
        "cuda": _cuda_versions(),
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "memory_bytes_limit": stats.get("bytes_limit"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    }
    print(json.dumps(record, indent=2, default=str))
    return record


# --------------------------------------------------------------------------------------------------
# correct
# --------------------------------------------------------------------------------------------------


def _load_config(path: str, **overrides):
    """`get_config()` of a config file, unlocked copy, with `section.key` overrides."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config().copy_and_resolve_references()
    with cfg.unlocked():
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            cfg[section][key] = value
    return cfg


def _check_default_job() -> dict:
    """configs/default.py for 20 steps through the real loop (6 in the CPU dry run, --tiny: its
    steps take 0.19 s each there): finite, and the loss falls."""
    from jaxdist import loop

    workdir = os.path.join(_OUT_DIR.value, "default_job")
    steps = 6 if _TINY.value else 20
    cfg = _load_config(
        "configs/default.py",
        **{
            "train.steps": steps,
            "train.log_every": 1,
            "train.eval_every": 0,
            "checkpoint.every": 0,
        },
    )
    loop.run(cfg, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = [r["loss"] for r in records if "loss" in r and r.get("kind") != "eval"]
    finite = all(math.isfinite(x) for x in losses)
    first, last = losses[0], sum(losses[-3:]) / 3
    return {
        "name": f"default job, {steps} steps",
        "ok": finite and len(losses) == steps and last < first,
        "detail": f"loss {first:.3f} → {last:.3f} (mean of the last 3), finite={finite}",
    }


def _check_attention() -> dict:
    """cuDNN flash attention against XLA attention: same parameters, bf16 logits of gpt_small."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist import data, mesh, sharding, train

    base = {"train.batch_size": 2, "model.attention": "xla"}
    if _TINY.value:
        base.update({"model.num_layers": 2, "model.d_model": 64, "model.num_heads": 2})
        base.update({"model.seq_len": 64, "model.vocab_size": 256, "runtime.cpu_devices": 1})
    cfg = _load_config("configs/gpt_small.py", **base)
    cudnn_cfg = _load_config("configs/gpt_small.py", **{**base, "model.attention": "cudnn"})
    try:
        mesh.check_backend(cudnn_cfg)
    except ConfigError as e:
        return {
            "name": "attention=cudnn vs xla",
            "ok": jax.default_backend() != "gpu",  # refusing is right only without a GPU
            "detail": f"refused before compiling: {e}",
        }
    m = mesh.make_mesh(cfg.mesh, jax.devices()[:1])
    ds = data.load(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    engines = [train.build(c, m, ds) for c in (cfg, cudnn_cfg)]
    params = engines[0].init()["params"]
    tokens = jax.random.randint(jax.random.key(0), (2, cfg.model.seq_len), 0, cfg.model.vocab_size)
    bf16 = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def logits(engine):
        @jax.jit
        def f(params, tokens):
            with sharding.activation_rules(m):
                return engine.merge(jax.tree.map(bf16, params))(tokens).astype(jnp.float32)

        return np.asarray(f(params, tokens))

    ref, got = logits(engines[0]), logits(engines[1])
    rel_rms = float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(ref**2)))
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    hlo = (
        jax.jit(lambda p, t: engines[1].merge(jax.tree.map(bf16, p))(t))
        .lower(params, tokens)
        .compile()
        .as_text()
    )
    return {
        "name": "attention=cudnn vs xla",
        "ok": rel_rms <= 2e-2 and agree >= 0.95 and "cudnn" in hlo.lower(),
        "detail": f"relative RMS {rel_rms:.2e} (≤ 2e-2), argmax agreement {agree:.3f}, "
        f"cuDNN fused attention in the HLO: {'cudnn' in hlo.lower()}",
    }


# Packed rows of the cuDNN check: the documents' lengths; the rest of a row is padding (segment
# id 0). --tiny (the CPU dry run): a tenth of the length.
_PACKED_ROWS = ((300, 500, 224), (700, 200))
_PACKED_ROWS_TINY = ((30, 50, 24), (70, 20))


def _check_packed_attention() -> dict:
    """cuDNN attention on packed documents (issue 32), through the families' own `_attend`: each
    document's output and gradients in a packed row equal that document run alone (causal only,
    no mask), and the packed rows equal float32 XLA attention on them. bf16, GQA 8:2, head dim 64.
    Without a GPU the same check runs through XLA attention (a dry run of the check itself)."""
    import jax

    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    rows = _PACKED_ROWS_TINY if _TINY.value else _PACKED_ROWS
    alone, vs_ref, leak, hlo = _packed_attention_deltas(impl, rows)
    fused = "cudnn" in hlo.lower()
    return {
        "name": f"packed documents: {impl} segment mask",
        "ok": alone <= 2e-2 and vs_ref <= 2e-2 and leak > 0.1 and (fused or impl == "xla"),
        "detail": f"output and dq/dk/dv, worst relative RMS: vs each document alone {alone:.2e} "
        f"(≤ 2e-2), vs float32 XLA on the packed rows {vs_ref:.2e} (≤ 2e-2); without the mask a "
        f"document's worst is {leak:.2e} (> 0.1: the check sees a leak); cuDNN fused attention "
        f"in the HLO: {fused}" + ("" if impl == "cudnn" else " (no GPU: XLA attention, a dry run)"),
    }


def _packed_attention_deltas(impl: str, rows) -> tuple[float, float, float, str]:
    """(worst relative RMS vs each document alone, vs float32 XLA, of the unmasked rows vs each
    document alone, the compiled HLO) of `impl` attention's output and dq/dk/dv on packed `rows`
    (documents' lengths per row)."""
    import functools
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import llama

    T, N, K, H = max(sum(row) for row in rows), 8, 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(2, T, N, H), (2, T, K, H), (2, T, K, H), (2, T, N, H)]
    q, k, v, ct = (jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes))
    seg, docs = np.zeros((2, T), np.int32), []  # padding keeps segment id 0
    for r, row in enumerate(rows):
        at = 0
        for i, n in enumerate(row):
            seg[r, at : at + n] = i + 1
            docs.append((r, slice(at, at + n)))
            at += n

    def run(impl, q, k, v, ct, segments, dtype=jnp.bfloat16):
        cfg = types.SimpleNamespace(attention=impl, context_attention="ring")
        f = lambda *qkv: llama._attend(*qkv, None, cfg, segments)  # noqa: E731
        out, vjp = jax.vjp(f, *(x.astype(dtype) for x in (q, k, v)))
        return (out, *vjp(ct.astype(dtype)))

    def host(xs):
        return [np.asarray(x, np.float32) for x in xs]

    args = (q, k, v, ct, jnp.asarray(seg))  # arguments, not constants XLA would fold
    packed_fn = jax.jit(functools.partial(run, impl)).lower(*args).compile()  # its HLO is read
    packed = host(packed_fn(*args))
    ref = host(jax.jit(lambda *a: run("xla", *a, jnp.float32))(*args))
    unmasked = host(jax.jit(lambda *a: run(impl, *a[:4], None))(*args))

    def rel(a, b):
        return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))

    alone_worst = leak_worst = 0.0
    for r, sl in docs:  # the document at slots 0..n-1 of a row of its own, causal, no mask
        n = sl.stop - sl.start
        qa, ka, va, ca = (jnp.zeros_like(x[:1]).at[0, :n].set(x[r, sl]) for x in (q, k, v, ct))
        alone = [x[0, :n] for x in host(jax.jit(lambda *a: run(impl, *a, None))(qa, ka, va, ca))]
        alone_worst = max(alone_worst, *(rel(p[r, sl], a) for p, a in zip(packed, alone)))
        leak_worst = max(leak_worst, *(rel(u[r, sl], a) for u, a in zip(unmasked, alone)))
    vs_ref = max(rel(a, b) for a, b in zip(packed, ref))
    return alone_worst, vs_ref, leak_worst, packed_fn.as_text()


def _family_configs() -> list[str]:
    """One config per model family: the default GPT, every other family's own config."""
    names = ["configs/default.py", "configs/mlp.py", "configs/resnet.py"]
    return names + [p for p in ("configs/llama_tiny.py",) if os.path.exists(p)]


def _check_family(path: str) -> dict:
    import jax
    import numpy as np

    from jaxdist import data, mesh

    cfg = _load_config(path, **{"train.steps": 1})
    m = mesh.make_mesh(cfg.mesh)
    ds = data.load(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    engine, batches = benchlib.build(cfg, m, ds)
    state = engine.init()
    for i in range(2):  # step 0 runs at learning rate 0 when the schedule warms up from 0
        state, metrics = engine.train_step(state, batches.get(i))
    loss = float(jax.device_get(metrics["loss"]))
    moved = any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(state["params"]), jax.tree.leaves(engine.init()["params"]), strict=True
        )
    )
    return {
        "name": f"two train steps: {path} ({cfg.model.name})",
        "ok": math.isfinite(loss) and moved,
        "detail": f"loss {loss:.4f}, parameters updated: {moved}, mesh {mesh.mesh_shape(m)}",
    }


def phase_correct() -> dict:
    from jaxdist import mesh

    if not mesh.accelerator_present():
        mesh.configure_cpu_devices(8)  # the CPU dry run: the default configs' simulated devices
    checks = []
    jobs = [_check_default_job, _check_attention, _check_packed_attention] + [
        (lambda p=p: _check_family(p)) for p in _family_configs()
    ]
    for job in jobs:
        t0 = time.perf_counter()
        try:
            result = job()
        except Exception as e:  # noqa: BLE001 -- one failing check must not hide the others
            traceback.print_exc()
            result = {"name": getattr(job, "__name__", "check"), "ok": False}
            result["detail"] = _error_line(e)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {result['name']}: {result['detail']}")
        checks.append(result)
    return {"checks": checks, "ok": all(c["ok"] for c in checks)}


# --------------------------------------------------------------------------------------------------
# point
# --------------------------------------------------------------------------------------------------


def _hardware_profile(device_kind: str) -> str:
    from jaxdist import plan

    if _HARDWARE.value:
        return _HARDWARE.value
    kind = device_kind.lower()
    for name, hw in plan.PROFILES.items():
        if name.split("_")[0] in kind and hw.name != "cpu_here":
            return name
    return "cpu_here"


def _predict(config, n: int, device_kind: str) -> dict:
    from jaxdist import plan

    hw = _hardware_profile(device_kind)
    try:
        p = plan.predict(config, num_devices=n, hw=hw)
    except Exception as e:  # noqa: BLE001 -- a model the planner does not cover
        return {"hardware": hw, "error": _error_line(e)}
    return {
        "hardware": hw,
        "step_time_s": p.step_s,
        "mfu": p.mfu,
        "memory_total_bytes": p.memory["total"],
        "memory_temp_bytes": p.memory["temp"],
    }


def block_matmuls_per_layer(params, num_layers: int) -> int:
    """The blocks' dense weights: stacked parameters [L, ...] of 3 or more dimensions (norms and
    biases are [L, D]); each is one forward and two backward matmuls per layer."""
    import jax

    return sum(1 for p in jax.tree.leaves(params) if p.ndim >= 3 and p.shape[0] == num_layers)


def _fit_layers(config, most: int, device) -> dict:
    """Sets model.num_layers (and scan_unroll) to the most layers, at most `most`, whose
    planner-predicted memory fits 95% of the device's limit (all of them where none is known)."""
    from jaxdist import plan

    limit = (device.memory_stats() or {}).get("bytes_limit")
    hw = _hardware_profile(device.device_kind)
    chosen, predicted = 1, None
    for layers in range(most, 0, -1):
        config.model.num_layers = layers
        try:
            total = plan.predict(config, num_devices=1, hw=hw).memory["total"]
        except Exception:  # noqa: BLE001 -- the planner does not cover it: take the most
            total = None
        if limit is None or total is None or total <= 0.95 * limit:
            chosen, predicted = layers, total
            break
    config.model.num_layers = chosen
    config.model.scan_unroll = chosen
    return {"most": most, "layers": chosen, "predicted_bytes": predicted, "bytes_limit": limit}


def _progress(msg: str) -> None:
    """One line on stderr as the point goes, so a row stopped at its time limit shows its stage."""
    print(f"   {_LABEL.value}: {msg}", file=sys.stderr, flush=True)


def _point_header(config, fit: dict | None, device_kind: str) -> dict:
    """What a point is: its label, command, model and settings (before anything runs)."""
    c, t = config.model, config.train
    return {
        "label": _LABEL.value,
        "command": " ".join(["python", *sys.argv]),
        "model": c.name,
        "layers": c.num_layers,
        "d_model": c.d_model,
        "seq_len": c.seq_len,
        "batch": t.batch_size,
        "remat": t.remat,
        "grad_accum": t.grad_accum,
        "scan_unroll": c.get("scan_unroll", 1),
        "embed_grad": c.get("embed_grad", "scatter"),
        "attention": c.attention,
        "dtype": t.compute_dtype,
        "matmul_precision": t.get("matmul_precision", "default"),
        "fp8_lowering": _FP8_LOWERING.value,
        "fit_layers": fit,
        "gpu_xla_flags": bool(config.runtime.gpu_xla_flags),
        "device_kind": device_kind,
    }


def _save_fp8_hlo(record: dict, hlo: str) -> None:
    """An FP8 point's `f8_census` and its compiled HLO, gzipped, under OUT_DIR/hlo."""
    record["f8_census"] = benchlib.f8_census(hlo)
    _progress(f"FP8 in the compiled HLO: {record['f8_census']}")
    os.makedirs(os.path.join(_OUT_DIR.value, "hlo"), exist_ok=True)
    with gzip.open(os.path.join(_OUT_DIR.value, "hlo", f"{_LABEL.value}.txt.gz"), "wt") as f:
        f.write(hlo)


def _fp8_expectations(record: dict, matmuls: list[tuple[str, bool]], layers: int) -> dict:
    """The FP8 GEMMs an FP8 point should hold, from what `fp8.traced` saw, against its census.

    `fp8.traced` saw each layer body once (a scan) or once per layer: FP8 matmuls per layer = those
    cast × the blocks' matmuls per layer / the matmuls traced; each is 3 GEMMs (forward and both
    gradients)."""
    cast = sum(c8 for _, c8 in matmuls)
    per_layer = cast * record["block_matmuls_per_layer"] / max(len(matmuls), 1)
    expected = round(3 * per_layer * layers)
    fp8_gemms = record["gemms"]["fp8_gemms"]
    return {
        "fp8_matmuls_per_layer": per_layer,
        "fp8_gemms_expected": expected,
        "fp8_gemms_per_layer": fp8_gemms / layers,
        "fp8_all_blocks": fp8_gemms >= expected > 0,
    }


def phase_point() -> dict:
    import jax
    import numpy as np

    from jaxdist import data, fp8, loop, mesh, metrics

    fp8.set_lowering(_FP8_LOWERING.value)
    config = _CONFIG.value
    fit = _fit_layers(config, _FIT_LAYERS.value, jax.devices()[0]) if _FIT_LAYERS.value else None
    c, t = config.model, config.train
    record = _point_header(config, fit, jax.devices()[0].device_kind)
    try:
        m = mesh.make_mesh(config.mesh)
        ds = data.load(config.data, seq_len=c.seq_len, vocab_size=c.vocab_size)
        engine, batches = benchlib.build(config, m, ds)
        batch = batches.get(0)
        t0 = time.perf_counter()
        with fp8.traced() as matmuls:  # the block matmuls, and which of them run in FP8
            lowered = engine.train_step.lower(engine.abstract_state, batch)
        _progress(f"lowered in {time.perf_counter() - t0:.1f}s")
        compiled = lowered.compile()
        record["compile_s"] = time.perf_counter() - t0
        _progress(f"compiled in {record['compile_s']:.1f}s")
        layout = loop.layout_record(engine, compiled, config)
        record["params"] = layout["params_total"]
        record["compiled_bytes"] = layout["bytes_per_device"]
        hlo = compiled.as_text()
        if record["matmul_precision"].startswith("fp8"):
            _save_fp8_hlo(record, hlo)
        state, times = benchlib.timed(compiled, engine.init(), batch, _STEPS.value, _WARMUP.value)
        _progress(
            f"timed {_STEPS.value} steps, median {benchlib.stats(times)['median_s'] * 1e3:.1f} ms"
        )
        record["cudnn_attention_calls"] = {
            "forward": hlo.count('custom_call_target="__cudnn$fmhaSoftmax"')
            + hlo.count('custom_call_target="__cudnn$fmhaSoftmaxDropout"'),
            "backward": hlo.count('custom_call_target="__cudnn$fmhaSoftmaxBackward'),
        }
        record["gemms"] = benchlib.gemm_counts(hlo)
        record["block_matmuls_per_layer"] = block_matmuls_per_layer(
            engine.abstract_state["params"], c.num_layers
        )
        if record["matmul_precision"].startswith("fp8"):
            record |= _fp8_expectations(record, matmuls, c.num_layers)
        if _PROFILE.value:
            state, record["profile"] = _trace_kernels(compiled, state, batch, _PROFILE.value)
        loss = float(jax.device_get(compiled(state, batch)[1]["loss"]))
        record["loss_finite"] = bool(np.isfinite(loss))
        del state
        record["framework"] = benchlib.stats(times)
        n = jax.device_count()
        tokens = t.batch_size * c.seq_len
        record["tokens_per_s"] = tokens / record["framework"]["median_s"]
        record["flops_per_token"] = layout.get("flops_per_token")
        record["mfu_formula"] = MFU_FORMULA
        peak = metrics.peak_flops(jax.devices()[0])
        if peak and record["flops_per_token"]:
            record["mfu"] = metrics.mfu(record["tokens_per_s"], record["flops_per_token"], n, peak)
        if _HAND.value:
            hand = benchlib.hand_written_step(engine)
            _, h_times = benchlib.timed(hand, engine.init(), batch, _STEPS.value, _WARMUP.value)
            record["hand_written"] = benchlib.stats(h_times)
            record["framework_vs_hand"] = (
                record["framework"]["median_s"] / record["hand_written"]["median_s"]
            )
        stats = jax.devices()[0].memory_stats() or {}
        record["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        record["bytes_limit"] = stats.get("bytes_limit")
        record["predicted"] = _predict(config, n, record["device_kind"])
        record["ok"] = record["loss_finite"]
    except Exception as e:  # noqa: BLE001 -- out of memory is a result, not a crash
        record["ok"] = False
        record["error"] = _error_line(e)
        record["oom"] = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
        print(f"{_LABEL.value}: {record['error']}", file=sys.stderr)
    _write(os.path.join("points", f"{_LABEL.value}.json"), record)
    print(_row(record))
    return record


def _kernel_class(name: str) -> str:
    n = name.lower()
    if "fmha" in n or "cudnn" in n or "flash" in n:
        return "attention (cuDNN)"
    if any(k in n for k in ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "wgmma", "matmul")):
        return "matmul"
    if "all-reduce" in n or "nccl" in n:
        return "collective"
    return "other (fusions, copies)"


def _trace_kernels(compiled, state, batch, steps: int):
    """Device time per kernel, per step, over `steps` traced steps (the profiler's own trace).

    Returns the state after those steps and the breakdown."""
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="jaxdist-trace-") as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                state, m = compiled(state, batch)
            jax.block_until_ready((state, m))
        files = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        data = ProfileData.from_file(files[0])
    kernels: dict[str, float] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.duration_ns / 1e6 / steps
    classes: dict[str, float] = {}
    for name, ms in kernels.items():
        classes[_kernel_class(name)] = classes.get(_kernel_class(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return state, {
        "device_ms_per_step": sum(kernels.values()),
        "by_class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [[name[:120], round(ms, 3)] for name, ms in top],
    }


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------

HEADER = (
    "| point | model | batch | remat | attention | precision | XLA flags | step ms (p10–p90) "
    "| tokens/s | MFU | peak mem GiB | compiled GiB | planner ms (pred/meas) | planner GiB "
    "| FP8 GEMMs (per layer) | vs hand-written |"
)


def _precision(r: dict) -> str:
    dtype = {"bfloat16": "bf16", "float32": "f32"}.get(r.get("dtype", "-"), r.get("dtype", "-"))
    return r["matmul_precision"] if r.get("matmul_precision", "").startswith("fp8") else dtype


def _fp8_cell(r: dict) -> str:
    g = r.get("gemms")
    if not g:
        return "—"
    n = g.get("fp8_gemms", g["fp8_cublaslt"])
    cell = f"{n} ({n / max(r['layers'], 1):.1f})"
    if r.get("matmul_precision", "").startswith("fp8"):
        cell += " all blocks" if r.get("fp8_all_blocks") else " **not all blocks**"
    return cell


def _gib(x) -> str:
    return f"{x / 2**30:.2f}" if isinstance(x, int | float) else "—"


def _row(r: dict) -> str:
    attention = r["attention"]
    if r.get("cudnn_attention_calls", {}).get("forward"):
        attention += " (cuDNN)" if attention != "cudnn" else ""
    elif "cudnn_attention_calls" in r:
        attention += " (XLA)" if attention != "xla" else ""
    accum = f" ×{r['grad_accum']} accum" if r.get("grad_accum", 1) > 1 else ""
    base = (
        f"| {r['label']} | {r['model']} L{r['layers']} d{r['d_model']} T{r['seq_len']} "
        f"| {r['batch']}{accum} | {r['remat']} | {attention} | {_precision(r)} "
        f"| {'on' if r['gpu_xla_flags'] else 'off'} "
    )
    if not r.get("ok"):
        why = f"{'OOM' if r.get('oom') else 'failed'}: {r.get('error', '')}"
        return base + f"| {why} |||||||||"
    f, pred = r["framework"], r.get("predicted", {})
    comp = r.get("compiled_bytes", {})
    compiled = (comp.get("arguments") or 0) + (comp.get("temp") or 0)
    ms = f"{f['median_s'] * 1e3:.1f} ({f['p10_s'] * 1e3:.1f}–{f['p90_s'] * 1e3:.1f})"
    mfu = f"{r['mfu']:.1%}" if "mfu" in r else "—"
    if "step_time_s" in pred:
        p_ms = f"{pred['step_time_s'] * 1e3:.1f} ({pred['step_time_s'] / f['median_s']:.2f}×)"
        p_mem = _gib(pred["memory_total_bytes"])
    else:
        p_ms = p_mem = "—"
    hand = f"{r['framework_vs_hand']:.3f}" if "framework_vs_hand" in r else "—"
    return (
        base + f"| {ms} | {r['tokens_per_s']:,.0f} | {mfu} | {_gib(r.get('peak_bytes_in_use'))} "
        f"| {_gib(compiled)} | {p_ms} | {p_mem} | {_fp8_cell(r)} | {hand} |"
    )


def _twin(points: list[dict], label: str) -> dict | None:
    return next((p for p in points if p["label"] == label and p.get("ok")), None)


def _findings(points: list[dict]) -> list[str]:
    """One line per comparison issue 35 asks for: `auto` against the named cuDNN row, each FP8
    row against its bf16 row (tokens/s, GEMMs in FP8), the 8B-shape proxy's layer count."""
    lines = []
    for r in points:
        if not r.get("ok"):
            continue
        ms = r["framework"]["median_s"] * 1e3
        calls = r.get("cudnn_attention_calls", {})
        if r["attention"] == "auto":
            line = (
                f"- `{r['label']}`: attention=auto ran {calls.get('forward', 0)} cuDNN forward and "
                f"{calls.get('backward', 0)} backward fused-attention calls; {ms:.1f} ms a step"
            )
            twin = _twin(points, r["label"].removesuffix("_auto"))
            if twin:
                t_ms = twin["framework"]["median_s"] * 1e3
                line += f" vs {t_ms:.1f} ms with cudnn named ({ms / t_ms:.3f}×)"
            lines.append(line + ".")
        if r.get("matmul_precision", "").startswith("fp8"):
            g = r["gemms"]
            per_layer = r["fp8_matmuls_per_layer"]
            line = (
                f"- `{r['label']}`: {g['fp8_gemms']} FP8 GEMMs ({g['fp8_cublaslt']} cuBLASLt + "
                f"{g['fp8_triton']} Triton; {r['fp8_gemms_per_layer']:.1f} a layer, "
                f"{r['fp8_gemms_expected'] / max(r['layers'], 1):.1f} expected: 3 × "
                f"{per_layer:g} of the {r['block_matmuls_per_layer']} block matmuls pass the "
                f"size rule), other GEMMs: {g['cublas_other']} cuBLAS + "
                f"{g['triton_gemm'] - g['fp8_triton']} Triton"
            )
            twin = _twin(points, r["label"].split("_fp8")[0] + "_bf16")
            if twin:
                line += f"; tokens/s {r['tokens_per_s'] / twin['tokens_per_s']:.3f}× the bf16 row"
            lines.append(line + ".")
        if r.get("fit_layers"):
            f = r["fit_layers"]
            why = (
                f"the most, up to {f['most']}, whose predicted memory "
                f"{_gib(f['predicted_bytes'])} GiB fits 95% of the device's "
                f"{_gib(f['bytes_limit'])} GiB"
                if f["bytes_limit"]
                else f"no device memory limit known: the most asked for, {f['most']}"
            )
            lines.append(f"- `{r['label']}`: {f['layers']} layers ({why}).")
    return lines


DECODE_HEADER = (
    "| batch | jaxdist tokens/s | transformers tokens/s | jaxdist / transformers "
    "| tokens equal | rows identical |"
)


def _decode_lines(d: dict) -> list[str]:
    lines = [
        "## Decode: jaxdist vs transformers' generate",
        "",
        f"{d['config']} with random weights (seed 0) exported to a Hugging Face folder, "
        f"{d['dtype']}, {d['prompt_len']} prompt tokens, {d['new_tokens']} new tokens, greedy; "
        f"transformers on {d['torch_device']} with the {d['hf_cache']} key/value cache; "
        f"tokens/s = {d['tokens_per_s']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in d["versions"].items())
        + ".",
        "",
        DECODE_HEADER,
        "|" + " --- |" * (DECODE_HEADER.count("|") - 1),
    ]
    for row in d["rows"].values():
        a = row["agreement"]
        lines.append(
            f"| {row['batch']} | {row['jaxdist']['tokens_per_s']:,.0f} "
            f"| {row['transformers']['tokens_per_s']:,.0f} | {row['jaxdist_vs_transformers']:.2f}× "
            f"| {a['tokens_equal']:.1%} | {a['rows_identical']}/{a['rows']} |"
        )
    return lines + [""]


def phase_report() -> dict:
    out = _OUT_DIR.value
    read = lambda p: json.load(open(p)) if os.path.exists(p) else None
    env, correct = read(os.path.join(out, "env.json")), read(os.path.join(out, "correct.json"))
    points = [read(p) for p in sorted(glob.glob(os.path.join(out, "points", "*.json")))]
    points.sort(key=lambda r: r.get("order", 0))
    skipped = read(os.path.join(out, "skipped.json")) or []
    decode = read(os.path.join(out, "decode.json"))
    notes_path = os.path.join(out, "notes.txt")
    notes = open(notes_path).read().splitlines() if os.path.exists(notes_path) else []
    lines = ["# GPU check", ""]
    if env:
        v = env["versions"]
        lines.append(
            f"Device: {env['device_kind']} × {env['device_count']} ({env['backend']}), memory limit "
            f"{_gib(env.get('memory_bytes_limit'))} GiB; jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, "
            f"CUDA {env['cuda'] or 'n/a'}, Python {env['python']}."
        )
        lines.append("")
    if correct:
        lines += ["## Correctness", ""]
        lines += [f"- {'ok' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}" for c in correct]
        lines.append("")
    lines += ["## Throughput", "", f"MFU: {MFU_FORMULA}, over the device's dense bf16 peak.", ""]
    lines += [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    lines += [_row(r) for r in points]
    for r in points:
        if r.get("profile"):
            pr = r["profile"]
            lines += [
                "",
                f"Where `{r['label']}`'s device time goes (profiler, ms per step): "
                + ", ".join(f"{k} {v:.1f}" for k, v in pr["by_class_ms"].items())
                + f"; total {pr['device_ms_per_step']:.1f}.",
            ]
    findings = _findings(points)
    if findings:
        lines += ["", *findings]
    lines.append("")
    if decode:
        lines += _decode_lines(decode)
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    lines += ["Commands:", ""] + [
        f"- `{r['label']}`: `{r['command']}`" for r in points if r.get("command")
    ]
    if skipped:
        lines += ["", "Not run (time budget): " + ", ".join(skipped)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(text)
    result = {"env": env, "correct": correct, "points": points, "skipped": skipped}
    result.update({"decode": decode, "notes": notes})
    print(text)
    return result


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    from jaxdist import mesh, xla_flags

    if _PHASE.value == "point":
        config = _CONFIG.value
        xla_flags.apply(config.runtime.gpu_xla_flags, config.runtime.gpu_memory_fraction)
        mesh.configure_cpu_devices(config.runtime.cpu_devices)
    os.makedirs(_OUT_DIR.value, exist_ok=True)
    phase = {"env": phase_env, "correct": phase_correct, "point": phase_point}
    phase["report"] = phase_report
    result = phase[_PHASE.value]()
    if _PHASE.value == "report":
        _write("gpu_check.json", result)
    elif _PHASE.value != "point":
        _write(f"{_PHASE.value}.json", result if _PHASE.value == "env" else result["checks"])


if __name__ == "__main__":
    benchlib.run_main(main)
