"""Loss and perplexity of a model on held-out data, or its lm-eval-harness scores.

    python scripts/eval.py --checkpoint=PATH --data=SOURCE [--batches=N] [--batch_size=B]
        [--seq_len=T] [--seed=S] [--step=S] [--data_parallel=D] [--tensor=T] [--out=FILE.json]
    python scripts/eval.py --checkpoint=PATH --lm_eval_tasks=TASK[,TASK] [--lm_eval_include=DIR]
        [--lm_eval_builtin] [--lm_eval_limit=N] [--batch_size=B] [--step=S] [--data_parallel=D] [--tensor=T]
        [--out=FILE.json]

PATH is a jaxdist run folder, a checkpoints folder or a Hugging Face folder; SOURCE anything
`data.source` accepts (token shards from scripts/tokenize.py, a uint16 `.bin`, text read as bytes,
`stdlib`). The loss is the mean next-token cross-entropy over `--batches` batches of the source's
validation split (the same windows for every checkpoint: they depend only on the seed), on a mesh
of data_parallel × tensor devices (simulated on a CPU). By default the windows are those of the
run's own final evaluation (`train.eval_batches` batches of `train.batch_size` rows of
`model.seq_len` tokens, seed `train.seed`), so on the run's `data.source` the two agree; the line
printed says what was evaluated.

With `--lm_eval_tasks`, lm-eval-harness (the `eval` extra) runs those tasks, groups or tags through
jaxdist's own sharded forward (log-likelihoods) and key/value-cache generation
(jaxdist/lm_eval_adapter.py); it prints one line per task and metric, `--out` writes them as JSON.
`--lm_eval_include=DIR` (repeatable) names folders of task YAML, such as the shipped
configs/lm_eval_tasks (`jaxdist_choice`, multiple choice; `jaxdist_copy`, generation; over local
JSONL). lm-eval's own tasks are searched with `--lm_eval_builtin` or when no folder is given (a
minute of indexing); nothing is downloaded, so those run when their datasets are already in the
local cache.
Task names and files are checked before the model is loaded or compiled.
Bad input: one `error: ...` line, exit 2.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxdist.errors import ConfigError, run_command  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    from jaxdist import mesh as mesh_lib

    if not mesh_lib.accelerator_present():
        mesh_lib.configure_cpu_devices(args.data_parallel * args.tensor)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import models
    from jaxdist import data, sharding, weights

    src = weights.resolve(args.checkpoint, args.step)
    config = src.config
    m = config.model
    _defaults_from_run(args, src)
    seq_len = _checked(args, src, jax.device_count())
    run_source = config.data.source
    config.data.source = args.data
    if config.data.get("packing", "windows") == "documents":  # the held-out loss reads windows
        config.data.packing = "windows"
    m.seq_len = seq_len
    ds = data.load(config.data, seq_len=seq_len, vocab_size=m.vocab_size)
    models.get(m.name).check_data(config, ds)
    family, model, mesh, params = weights.load_onto_mesh(
        src, ds, data=args.data_parallel, tensor=args.tensor
    )
    axes = family.batch_axes(m, ds)
    batch_shardings = {
        k: jax.sharding.NamedSharding(
            mesh, sharding.logical_to_spec(v, sharding.COMPUTE_RULES, mesh)
        )
        for k, v in axes.items()
    }
    batches = data.Batches(
        ds, batch_size=args.batch_size, seq_len=seq_len, seed=args.seed, shardings=batch_shardings
    )
    dtype = jnp.dtype(config.train.compute_dtype)

    @jax.jit
    def loss_fn(params, batch):
        with sharding.activation_rules(mesh):
            p = jax.tree.map(lambda x: x.astype(dtype), params)
            return family.loss(model.merge(p), batch)[0]

    t0 = time.perf_counter()
    losses = [float(loss_fn(params, batches.get(i, "val"))) for i in range(args.batches)]
    loss = float(np.mean(losses))
    result = {
        "checkpoint": args.checkpoint,
        "step": src.step,
        "data": args.data,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": args.batches * args.batch_size * seq_len,
        "windows": {
            "batches": args.batches,
            "batch_size": args.batch_size,
            "seq_len": seq_len,
            "seed": args.seed,
        },
        "seconds": time.perf_counter() - t0,
    }
    what = f"step {src.step}" if src.kind == "jaxdist" else "Hugging Face folder"
    print(
        f"{args.checkpoint} ({what}) on {args.data}: loss {loss:.4f}, perplexity "
        f"{result['perplexity']:.3f} over {result['tokens']} tokens ({args.batches} batches × "
        f"{args.batch_size} × {seq_len} of the validation split, seed {args.seed})"
    )
    note = _trainer_comparison(args, src, run_source, seq_len)
    if note:
        print(note)
    _write(args.out, result)
    return result


def run_lm_eval(args: argparse.Namespace) -> dict:
    """lm-eval's tasks through jaxdist's forward and generation: {task: {metric: value}}."""
    names = [n.strip() for n in args.lm_eval_tasks.split(",")]
    from jaxdist import weights

    weights.resolve(args.checkpoint, args.step)  # a bad PATH fails before lm-eval loads
    if args.lm_eval_limit is not None and args.lm_eval_limit < 1:
        raise ConfigError(f"--lm_eval_limit={args.lm_eval_limit} must be >= 1")
    from jaxdist import mesh as mesh_lib

    if not mesh_lib.accelerator_present():
        mesh_lib.configure_cpu_devices(args.data_parallel * args.tensor)
    from jaxdist import lm_eval_adapter

    tasks = lm_eval_adapter.load_tasks(
        names, args.lm_eval_include, builtin=args.lm_eval_builtin
    )  # before any compile
    t0 = time.perf_counter()
    lm = lm_eval_adapter.JaxdistLM(
        args.checkpoint,
        step=args.step,
        data=args.data_parallel,
        tensor=args.tensor,
        batch_size=args.batch_size or 8,
    )
    out = lm_eval_adapter.evaluate(lm, tasks, limit=args.lm_eval_limit)
    scores = {
        task: {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not k.endswith("stderr") and "," in k
        }
        for task, metrics in out["results"].items()
    }
    what = f"step {lm.src.step}" if lm.src.kind == "jaxdist" else "Hugging Face folder"
    counts = {t: len(s) for t, s in out.get("samples", {}).items()}
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            print(f"{task}: {metric} {value:.4f} over {counts.get(task, '?')} items")
    seconds = time.perf_counter() - t0
    print(f"{args.checkpoint} ({what}), lm-eval {','.join(names)}: {seconds:.1f} s")
    result = {"checkpoint": args.checkpoint, "step": lm.src.step, "lm_eval": scores,
              "items": counts, "seconds": seconds}  # fmt: skip
    _write(args.out, result)
    return result


def _write(out: str, result: dict) -> None:
    """`result` as JSON to `out` (if given), whole or not at all."""
    if out:
        tmp = f"{out}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, out)


def _defaults_from_run(args: argparse.Namespace, src) -> None:
    """Unset window flags take the run's own final evaluation's: `train.eval_batches` batches of
    `train.batch_size` rows, seed `train.seed` (a Hugging Face folder: jaxdist's defaults)."""
    t = src.config.train
    if args.batches is None:
        args.batches = int(t.eval_batches)
    if args.batch_size is None:
        args.batch_size = int(t.batch_size)
    if args.seed is None:
        args.seed = int(t.seed)


def _trainer_comparison(args: argparse.Namespace, src, run_source: str, seq_len: int) -> str:
    """For a jaxdist run evaluated on other windows than its final evaluation: which it used."""
    if src.kind != "jaxdist":
        return ""
    t, m = src.config.train, src.config.model
    same = args.data == run_source and (args.batches, args.batch_size, args.seed, seq_len) == (
        t.eval_batches,
        t.batch_size,
        t.seed,
        m.seq_len,
    )
    if same:
        return "the same windows as the run's final evaluation"
    return (
        f"the run's final evaluation read other windows: {t.eval_batches} batches × "
        f"{t.batch_size} × {m.seq_len} of data.source={run_source}, seed {t.seed}"
    )


def _checked(args: argparse.Namespace, src, device_count: int) -> int:
    """The sequence length to evaluate at; ConfigError for flags the run cannot honour."""
    from jaxdist import data

    m = src.config.model
    # A run evaluates at the length it trained at; a Hugging Face folder's model.seq_len is its
    # longest context (often 128k), so it is capped.
    seq_len = args.seq_len or (m.seq_len if src.kind == "jaxdist" else min(m.seq_len, 1024))
    if seq_len > m.seq_len:
        raise ConfigError(f"--seq_len={seq_len} is longer than model.seq_len={m.seq_len}")
    n = args.data_parallel * args.tensor
    if n > device_count:
        raise ConfigError(f"--data_parallel×--tensor = {n}, but {device_count} devices")
    if args.batch_size % args.data_parallel:
        raise ConfigError(f"--batch_size={args.batch_size} must divide by --data_parallel")
    text = args.data != "digits" and not data.is_token_source(args.data)
    if text and src.file("tokenizer.json"):
        raise ConfigError(
            f"--data={args.data} is text, which jaxdist reads as bytes, but {args.checkpoint} has "
            "its own tokenizer; tokenize it first: python scripts/tokenize.py"
        )
    return seq_len


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint", required=True, help="run folder, checkpoints folder or HF folder"
    )
    p.add_argument("--data", default=None, help="a data.source: token shards, .bin, text, stdlib")
    p.add_argument(
        "--lm_eval_tasks",
        default=None,
        help="lm-eval task, group or tag names, comma-separated (instead of --data)",
    )
    p.add_argument(
        "--lm_eval_include",
        action="append",
        default=[],
        help="a folder of lm-eval task YAML files (repeatable), e.g. configs/lm_eval_tasks",
    )
    p.add_argument(
        "--lm_eval_builtin",
        action="store_true",
        help="search lm-eval's own tasks too (their datasets must be in the local cache)",
    )
    p.add_argument("--lm_eval_limit", type=int, default=None, help="at most N items per task")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--batches", type=int, default=None, help="default: train.eval_batches")
    p.add_argument("--batch_size", type=int, default=None, help="default: train.batch_size")
    p.add_argument(
        "--seq_len", type=int, default=0, help="0 = model.seq_len (an HF folder's: at most 1024)"
    )
    p.add_argument("--seed", type=int, default=None, help="default: train.seed")
    p.add_argument("--data_parallel", type=int, default=1, help="devices the batch is split over")
    p.add_argument("--tensor", type=int, default=1, help="devices the heads are split over")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    return run_command(_checked_run, args, extra="eval" if args.lm_eval_tasks else "")


def _checked_run(args: argparse.Namespace) -> None:
    if (args.data is None) == (args.lm_eval_tasks is None):
        raise ConfigError(
            "give one of --data=SOURCE (held-out loss) or --lm_eval_tasks=TASK[,TASK]"
        )
    if args.lm_eval_include and args.lm_eval_tasks is None:
        raise ConfigError("--lm_eval_include needs --lm_eval_tasks")
    if args.lm_eval_tasks is not None:
        if args.batch_size is not None and args.batch_size < 1:
            raise ConfigError("--batch_size must be >= 1")
        run_lm_eval(args)
        return
    if (args.batches is not None and args.batches < 1) or (
        args.batch_size is not None and args.batch_size < 1
    ):
        raise ConfigError("--batches and --batch_size must be >= 1")
    run(args)


if __name__ == "__main__":
    sys.exit(main())
