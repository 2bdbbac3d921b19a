"""Inspect, export and verify jaxdist checkpoints, without the model, the mesh or an accelerator.

    python scripts/ckpt.py inspect runs/default/checkpoints [--step S]
    python scripts/ckpt.py export runs/default/checkpoints --out params.npz [--step S] [--force]
    python scripts/ckpt.py verify runs/default/checkpoints [--step S]
    python scripts/ckpt.py bench configs/gpt_small.py [--repeats N] [--dir D]

`export` writes `.safetensors` instead when --out ends so; it refuses an existing --out unless
--force, and refuses a step whose CRC-32 checksums do not match (nothing is written). `bench` times saving a config's freshly
initialised train state (params and optimizer state) on one device: the blocking part (until
`save` returns), the total (until the step is committed) and the size on disk. Exit codes: 0 fine;
1 verify found a problem, or a checkpoint could not be read; 2 bad arguments, missing directory,
no checkpoint, or no such step. Errors are one line on stderr. Runs on the CPU (JAX_PLATFORMS=cpu unless set), so it
can run beside a training job without touching its accelerators.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxdist import checkpoint as ckpt  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.metrics import human_bytes  # noqa: E402
from jaxdist.orbax_reads import silence_orphaned_reads  # noqa: E402


def array_table(infos) -> list[str]:
    """The arrays as aligned columns (path, shape, dtype, bytes, sharding), each as wide as its
    longest entry: a 5-D shape or a long path does not push the later columns out of line."""
    rows = [("path", "shape", "dtype", "bytes", "sharding")]
    rows += [(i.path, str(i.shape), str(i.dtype), str(i.nbytes), str(i.sharding)) for i in infos]
    w = [max(len(r[c]) for r in rows) for c in range(4)]
    return [f"{p:<{w[0]}}  {s:<{w[1]}}  {d:<{w[2]}}  {b:>{w[3]}}  {sh}" for p, s, d, b, sh in rows]


def cmd_inspect(args: argparse.Namespace) -> int:
    steps = ckpt.committed_steps(args.dir)
    meta = ckpt.read_metadata(args.dir, args.step)  # validates dir and step
    infos = ckpt.array_paths(args.dir, meta["step"])
    print(f"checkpoint directory: {args.dir}")
    print(f"steps: {', '.join(map(str, steps))} (latest {steps[-1]})")
    print(
        f"step {meta['step']}: data_position={meta.get('data_position', '?')} "
        f"jaxdist={meta.get('jaxdist_version', '?')} mesh={meta.get('mesh', '?')} "
        f"processes={meta.get('process_count', '?')}"
    )
    print("\n".join(array_table(infos)))
    total = sum(i.nbytes for i in infos)
    params = [i for i in infos if i.path.startswith("params/")]
    print(f"total: {len(infos)} arrays, {total} bytes ({human_bytes(total)})")
    print(
        f"params: {len(params)} arrays, {sum(i.nbytes for i in params)} bytes, "
        f"{sum(math.prod(i.shape) for i in params)} values"
    )
    print("config:")
    print(json.dumps(meta.get("config"), indent=2, sort_keys=True))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    arrays = ckpt.export_params(args.dir, args.out, args.step, force=args.force)
    total = sum(a.nbytes for a in arrays.values())
    print(f"wrote {args.out}: {len(arrays)} parameter arrays, {total} bytes ({human_bytes(total)})")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    silence_orphaned_reads()  # the read failures themselves are reported by verify
    report = ckpt.verify_checkpoint(args.dir, args.step)
    for note in report.notes:  # e.g. a step removed by a trainer's retention while it was read
        print(f"note: {note}", file=sys.stderr)
    if report.problems:
        shown = "; ".join(report.problems[:5])
        more = f"; and {len(report.problems) - 5} more" if len(report.problems) > 5 else ""
        print(f"verify failed for step {report.step} in {args.dir}: {shown}{more}", file=sys.stderr)
        return 1
    print(
        f"ok: step {report.step} in {args.dir}: {report.arrays} arrays ({report.nbytes} bytes) "
        "read back, all finite; storage and metadata agree"
    )
    return 0


def _load_config(path: str):
    """`get_config()` of an ml_collections config file, e.g. configs/gpt_small.py."""
    import importlib.util

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location("_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_bench(args: argparse.Namespace) -> int:
    import shutil
    import tempfile
    import time

    import jax

    from jaxdist import config as config_lib
    from jaxdist import data, train
    from jaxdist import mesh as mesh_lib

    config = _load_config(args.config)
    for axis in mesh_lib.MESH_AXES:  # one device: the whole state on it
        config.mesh[axis] = 1
        if f"dcn_{axis}" in config.mesh:
            config.mesh[f"dcn_{axis}"] = 1
    config.data.max_bytes = min(config.data.max_bytes, 1_000_000)  # shapes do not depend on it
    device = jax.devices()[:1]
    mesh = mesh_lib.make_mesh(config.mesh, device)
    ds = data.load(config.data, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size)
    engine = train.build(config, mesh, ds)
    t0 = time.perf_counter()
    state = jax.block_until_ready(engine.init())
    init_s = time.perf_counter() - t0
    if not args.as_initialised:
        # Freshly initialised moments are zeros, which compress to nothing; a trained optimizer
        # state does not. Noise stands in for it, so the size and the time are a trained run's.
        import numpy as np

        rng = np.random.default_rng(0)

        def noise(x):
            if not np.issubdtype(x.dtype, np.floating) or x.size <= 1:
                return x
            values = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
            return jax.device_put(values, x.sharding)

        state["opt_state"] = jax.tree.map(noise, state["opt_state"])
    leaves = jax.tree.leaves(state)
    state_bytes = sum(x.nbytes for x in leaves)
    print(
        f"{args.config}: {engine.num_params:,} parameters; train state {len(leaves)} arrays, "
        f"{human_bytes(state_bytes)} on {device[0].device_kind} (init {init_s:.1f} s); optimizer "
        + ("state as initialised" if args.as_initialised else "moments filled with noise")
    )
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="jaxdist-bench-"))
    cfg_json = config_lib.to_json_dict(config)
    try:
        with ckpt.Checkpointer(directory, every=1, keep=1, config_json=cfg_json) as saver:
            for i in range(args.repeats):
                step = (saver.latest_step() or 0) + 1
                t0 = time.perf_counter()
                saver.save(step, state, data_position=0, force=True)
                t1 = time.perf_counter()
                saver.wait()
                t2 = time.perf_counter()
                size = _disk_bytes(directory / str(step))
                print(
                    f"save {i + 1}: blocking {t1 - t0:.2f} s, total {t2 - t0:.2f} s "
                    f"(committed), {human_bytes(size)} on disk, "
                    f"{state_bytes / (t2 - t0) / 2**20:.0f} MiB/s"
                )
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "inspect": (cmd_inspect, "list steps; the arrays (path, shape, dtype, bytes, sharding)"),
        "export": (cmd_export, "write the parameters as one .npz or .safetensors file"),
        "verify": (cmd_verify, "read every array back; name what is missing, unreadable, NaN"),
    }
    for name, (fn, help_) in commands.items():
        p = sub.add_parser(name, help=help_)
        p.add_argument("dir", help="checkpoint directory, e.g. runs/default/checkpoints")
        p.add_argument("--step", type=int, default=None, help="step to use (default: the latest)")
        if name == "export":
            p.add_argument("--out", required=True, help="a file ending in .npz or .safetensors")
            p.add_argument("--force", action="store_true", help="overwrite an existing --out")
        p.set_defaults(fn=fn)
    bench = sub.add_parser("bench", help="time saving a config's initial train state on 1 device")
    bench.add_argument("config", help="an ml_collections config file, e.g. configs/gpt_small.py")
    bench.add_argument("--repeats", type=int, default=2, help="saves to time (default 2)")
    bench.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    bench.add_argument(
        "--as_initialised",
        action="store_true",
        help="save the optimizer state as initialised (zeros) instead of filled with noise",
    )
    bench.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # an unreadable checkpoint: one line, not an orbax traceback
        print(f"error: {ckpt.one_line_error(err, limit=500)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
