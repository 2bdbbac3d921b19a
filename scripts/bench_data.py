"""Benchmarks of the data and generation paths: tokenizing, loading batches, decoding.

    python scripts/bench_data.py --study=tokenize --corpus_mb=50
    python scripts/bench_data.py --study=loader
    python scripts/bench_data.py --study=decode --config=configs/llama_tiny.py
    python scripts/bench_data.py --study=packing
    python scripts/bench_data.py --study=decode --vs_transformers --config=configs/llama_tiny.py

Studies:
  tokenize  tokens/s of scripts/tokenize.py (jaxdist/token_shards.py: worker processes, shards
            written) with 1 and 2 workers on --corpus_mb of the standard library's source (one
            document per file, repeated to the size), against the `tokenizers` library's own
            `encode_batch` on the same documents in this one process (the ceiling: no shards, no
            workers). A byte-level BPE of --vocab tokens is trained first on a 5 MB sample.
  loader    host time to build one global batch of the default job (`Batches.get`: the window
            draw, the copy out of the source, `make_array_from_process_local_data` onto 8 CPU
            devices) for the in-memory byte source (`stdlib`) and for memory-mapped token shards,
            next to the default job's own step time: the loader must be a small fraction of it.
  decode    `jaxdist.generate` on one device with random weights of --config's model: prefill
            time and decode tokens/s for batch 1 and 8 (--prompt_len prompt tokens,
            --new_tokens new ones), compile excluded. With --vs_transformers: the same weights
            exported to a Hugging Face folder (`jaxdist.hf.write_hf`, what `scripts/hf.py export`
            writes), loaded by `transformers` and run with its `generate` (greedy, --hf_cache
            `static` key/value cache by default) in this process on the same device kind, on the
            same prompts, at --batch_sizes (default 1,8,64) in --dtype: tokens/s of both (new
            tokens over the wall time of prefill + decode, each side's compile or warm-up call
            excluded) and their token-for-token agreement.
  packing   `data.packing=documents` on --source (default the default job's `stdlib`, one document
            per file) at each of --seq_lens: the packing efficiency (fraction of row slots that
            hold a token, not padding), the fraction of slots with a loss target (`windows`:
            all), segments per row, the fraction of documents cut over rows, and the host time
            of the packing plan (`jaxdist.packing.pack_rows`) and of one batch of --batch_size rows.

Every figure is a median over --repeats runs (10th–90th percentile alongside), written to --out.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchlib import build as _build  # noqa: E402
from benchlib import stats as _stats  # noqa: E402

from jaxdist.errors import ConfigError  # noqa: E402


def _corpus(mb: float) -> list[str]:
    """The standard library's .py files as documents, repeated until `mb` megabytes."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")
    )
    docs, size = [], 0
    while size < mb * 1e6:
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if not text:  # an empty file is no document (token_shards skips it too)
                continue
            docs.append(text)
            size += len(text.encode())
            if size >= mb * 1e6:
                break
    return docs


def _config_from(path: str):
    """`get_config()` of an experiment file, unlocked so the study can set its data fields."""
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.unlock()
    return config


def study_tokenize(args) -> dict:
    from tokenizers import Tokenizer

    from jaxdist import token_shards

    docs = _corpus(args.corpus_mb)
    n_bytes = sum(len(d.encode()) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        with open(corpus, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        sample = os.path.join(tmp, "sample.jsonl")
        with open(sample, "w") as f:
            for d in _corpus(min(5.0, args.corpus_mb)):
                f.write(json.dumps({"text": d}) + "\n")
        common = {"text_key": "text", "eos": "", "val_fraction": 0.01}
        trained = argparse.Namespace(
            input=[sample],
            out=os.path.join(tmp, "bpe"),
            tokenizer="",
            train_vocab=args.vocab,
            workers=1,
            **common,
        )
        token_shards.run(trained)
        tok_file = os.path.join(tmp, "bpe", "tokenizer.json")
        rows = {}
        for workers in (1, 2):
            times, tokens = [], 0
            for r in range(args.repeats):
                ns = argparse.Namespace(
                    input=[corpus],
                    out=os.path.join(tmp, f"w{workers}-{r}"),
                    tokenizer=tok_file,
                    train_vocab=0,
                    workers=workers,
                    **common,
                )
                t0 = time.perf_counter()
                index = token_shards.run(ns)
                times.append(time.perf_counter() - t0)
                tokens = sum(index["tokens"].values())
            rows[f"token_shards_{workers}_workers"] = {"tokens": tokens, "seconds": _stats(times)}
        tok = Tokenizer.from_file(tok_file)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            enc = tok.encode_batch(docs, add_special_tokens=False)
            times.append(time.perf_counter() - t0)
        ceiling = sum(len(e.ids) for e in enc) + len(docs)  # + one EOS per document
        rows["tokenizers_encode_batch"] = {"tokens": ceiling, "seconds": _stats(times)}
    if len({row["tokens"] for row in rows.values()}) != 1:  # the same work, or no comparison
        raise RuntimeError(f"token counts differ: { {k: r['tokens'] for k, r in rows.items()} }")
    for name, row in rows.items():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]["median_s"]
        print(f"{name:28s} {row['tokens']:>11,d} tokens  {row['tokens_per_s'] / 1e6:6.2f} M tok/s")
    return {"study": "tokenize", "corpus_bytes": n_bytes, "documents": len(docs), "rows": rows}


def study_loader(args) -> dict:
    import jax

    from jaxdist import data, mesh, token_shards

    mesh.configure_cpu_devices(8)
    cfg = _config_from("configs/default.py")  # the default job: its model, batch and mesh
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ns = argparse.Namespace(
            input=[os.path.join(sysconfig.get_paths()["stdlib"], "*.py")],
            out=os.path.join(tmp, "shards"),
            tokenizer="",
            train_vocab=2048,
            workers=2,
            text_key="text",
            eos="",
            val_fraction=0.05,
        )
        token_shards.run(ns)
        for name, source, vocab in (
            ("stdlib (in memory)", "stdlib", 256),
            ("token shards (memory-mapped)", ns.out, 2048),
        ):
            cfg.data.source, cfg.model.vocab_size = source, vocab
            ds = data.load(cfg.data, seq_len=cfg.model.seq_len, vocab_size=vocab)
            engine, batches = _build(cfg, mesh.make_mesh(cfg.mesh), ds)
            times = []
            for step in range(args.steps):
                t0 = time.perf_counter()
                jax.block_until_ready(batches.get(step))
                times.append(time.perf_counter() - t0)
            rows[name] = {"host_s_per_batch": _stats(times)}
            if source == "stdlib":  # the default job's step, for scale
                state = engine.init()
                step_times = []
                for step in range(args.steps + 3):
                    batch = batches.get(step)
                    t0 = time.perf_counter()
                    state, m = engine.train_step(state, batch)
                    jax.block_until_ready(m)
                    step_times.append(time.perf_counter() - t0)
                rows["default job train step"] = {"step_s": _stats(step_times[3:])}
    step = rows["default job train step"]["step_s"]["median_s"]
    for name, row in rows.items():
        if "host_s_per_batch" in row:
            row["fraction_of_step"] = row["host_s_per_batch"]["median_s"] / step
            print(
                f"{name:30s} {row['host_s_per_batch']['median_s'] * 1e3:7.2f} ms/batch "
                f"({100 * row['fraction_of_step']:.1f}% of a {step * 1e3:.1f} ms step)"
            )
    return {
        "study": "loader",
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.model.seq_len,
        "rows": rows,
    }


def _decode_model(args):
    """--config's model, its decoder family and random weights (seed --seed) on one device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models

    m = _config_from(args.config).model
    family = models.get(m.name)
    if family.decoder is None:
        raise ConfigError(f"{args.config}: model.name={m.name!r} cannot generate")
    if args.prompt_len + args.new_tokens > m.seq_len:
        raise ConfigError(f"--prompt_len + --new_tokens passes model.seq_len={m.seq_len}")
    module = family.make(m, None)(nnx.Rngs(args.seed))
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    dtype = jnp.dtype(args.dtype)
    on_device = jax.device_put(jax.tree.map(lambda p: p.astype(dtype), params), jax.devices()[0])
    return m, family, params, on_device, dtype


def _batch_sizes(args, default: str) -> list[int]:
    text = args.batch_sizes or default
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch_sizes={text!r}: give positive integers, e.g. 1,8,64")
    return sizes


def study_decode(args) -> dict:
    import jax

    from jaxdist import generate

    if args.vs_transformers:
        return study_decode_vs_transformers(args)
    m, family, _, params, dtype = _decode_model(args)
    rows = {}
    for batch in _batch_sizes(args, "1,8"):
        prompts = [
            [(7 * b + i) % m.vocab_size for i in range(args.prompt_len)] for b in range(batch)
        ]
        run = generate.prepare(
            family.decoder(m), params, prompts, args.new_tokens, cache_dtype=dtype
        )
        prefill, decode = [], []
        for r in range(args.repeats):
            res = run(r)
            prefill.append(res.prefill_s)
            decode.append(res.decode_s)
        d = _stats(decode)
        rows[f"batch {batch}"] = {
            "prefill_s": _stats(prefill),
            "decode_s": d,
            "decode_tokens_per_s": batch * (args.new_tokens - 1) / d["median_s"],
            "decode_step_s": d["median_s"] / (args.new_tokens - 1),
        }
        row = rows[f"batch {batch}"]
        print(
            f"batch {batch}: prefill {row['prefill_s']['median_s'] * 1e3:.1f} ms "
            f"({args.prompt_len} tokens), decode step {row['decode_step_s'] * 1e3:.2f} ms, "
            f"{row['decode_tokens_per_s']:.0f} tokens/s"
        )
    return {
        "study": "decode",
        "config": args.config,
        "device": jax.devices()[0].device_kind,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def study_packing(args) -> dict:
    from jaxdist import config as config_lib
    from jaxdist import data

    d = config_lib.base_config().data
    d.source, d.packing = args.source, "documents"
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    ds = data.load(d, seq_len=max(seq_lens), vocab_size=args.vocab)
    rows = {}
    for T in seq_lens:
        batches = data.Batches(
            ds, batch_size=args.batch_size, seq_len=T, seed=0, shardings={}, packing="documents"
        )
        plan_times, batch_times = [], []
        for _ in range(args.repeats):
            batches._plans.clear()
            t0 = time.perf_counter()
            start, used = batches.plan("train")
            plan_times.append(time.perf_counter() - t0)
        for step in range(args.steps):
            t0 = time.perf_counter()
            batches.get_host(step)
            batch_times.append(time.perf_counter() - t0)
        row = data.packing_stats(len(ds.train), ds.train_docs, start, used, T)
        row |= {"plan_s": _stats(plan_times), "host_s_per_batch": _stats(batch_times)}
        rows[f"seq_len {T}"] = row
        print(
            f"seq_len {T:5d}: {row['rows']:7d} rows, efficiency {row['efficiency']:.4f}, "
            f"targets {row['target_fraction']:.4f}, {row['pieces_per_row']:.2f} segments/row, "
            f"{100 * row['cut_documents']:.1f}% of {row['documents']} documents cut, plan "
            f"{row['plan_s']['median_s']:.2f} s, {row['host_s_per_batch']['median_s'] * 1e3:.2f} "
            f"ms/batch of {args.batch_size}"
        )
    return {
        "study": "packing",
        "source": args.source,
        "train_tokens": int(len(ds.train)),
        "batch_size": args.batch_size,
        "rows": rows,
    }


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Token-for-token agreement of two sets of greedy continuations (same prompts, same length):
    the fraction of positions equal, the rows equal throughout, and where each row first differs
    (None where it never does)."""
    first = []
    for a, b in zip(ours, theirs, strict=True):
        diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        first.append(diff[0] if diff else None)
    total = sum(len(a) for a in ours)
    equal = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    return {
        "tokens_equal": equal / total,
        "rows_identical": sum(f is None for f in first),
        "rows": len(ours),
        "first_difference": first,
    }


def study_decode_vs_transformers(args) -> dict:
    """jaxdist's `generate` beside transformers' `generate` on the same exported weights."""
    import jax
    import numpy as np

    from jaxdist import generate, hf

    try:
        import torch
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"--vs_transformers needs transformers and torch ({e.name} is missing): "
            "pip install -e '.[hf]'"
        ) from None
    m, family, host, params, dtype = _decode_model(args)
    if family.hf is None:
        raise ConfigError(f"{args.config}: model.name={m.name!r} has no Hugging Face form")
    if args.hf_cache not in ("static", "dynamic"):
        raise ConfigError(f"--hf_cache={args.hf_cache!r}: choose static or dynamic")
    if args.hf_compile not in ("auto", "off"):
        raise ConfigError(f"--hf_compile={args.hf_compile!r}: choose auto or off")
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf.write_hf(jax.device_get(host), m, tmp, dtype=args.dtype)
        del host
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=getattr(torch, args.dtype)
        )
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # exactly --new_tokens on both sides
    # transformers compiles the static cache's forward on a GPU unless told not to
    model.generation_config.disable_compile = args.hf_compile == "off"
    export_s = time.perf_counter() - t0

    hf_generate = functools.partial(_hf_generate, model, args=args, device=device, gpu=gpu)
    rng = np.random.default_rng(args.seed)
    rows = {}
    record = _decode_header(args, str(device), export_s)
    record["rows"] = rows
    for batch in _batch_sizes(args, "1,8,64"):
        prompts = rng.integers(0, m.vocab_size, (batch, args.prompt_len), dtype=np.int64)
        t0 = time.perf_counter()
        run = generate.prepare(
            family.decoder(m), params, prompts.tolist(), args.new_tokens, cache_dtype=dtype
        )
        ours_compile_s = time.perf_counter() - t0
        ours, ours_s = _time_jaxdist(run, args.repeats)
        theirs, theirs_s, theirs_warmup_s = _time_transformers(hf_generate, prompts, args)
        new = batch * args.new_tokens
        row = {
            "batch": batch,
            "jaxdist": {
                "generate_s": _stats(ours_s),
                "tokens_per_s": new / _stats(ours_s)["median_s"],
                "compile_s": ours_compile_s,
            },
            "transformers": {
                "generate_s": _stats(theirs_s),
                "tokens_per_s": new / _stats(theirs_s)["median_s"],
                "warmup_s": theirs_warmup_s,
            },
            "agreement": _agreement(ours, theirs),
        }
        row["jaxdist_vs_transformers"] = (
            row["jaxdist"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        )
        rows[f"batch {batch}"] = row
        _write(args.out, record)  # each batch as it is measured: a time limit keeps the rest
        a = row["agreement"]
        print(
            f"batch {batch}: jaxdist {row['jaxdist']['tokens_per_s']:,.0f} tokens/s, "
            f"transformers {row['transformers']['tokens_per_s']:,.0f} tokens/s "
            f"({row['jaxdist_vs_transformers']:.2f}×); tokens equal {a['tokens_equal']:.1%}, "
            f"rows identical {a['rows_identical']}/{a['rows']}"
        )
    return record


def _decode_header(args, torch_device: str, export_s: float) -> dict:
    """--vs_transformers' JSON before its rows: the settings, the versions, the export's time."""
    import importlib.metadata as md

    import jax

    return {
        "study": "decode_vs_transformers",
        "config": args.config,
        "device": jax.devices()[0].device_kind,
        "torch_device": torch_device,
        "dtype": args.dtype,
        "hf_cache": args.hf_cache,
        "hf_compile": args.hf_compile,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tokens_per_s": "batch × new tokens / median wall seconds of one generate (prefill + "
        "decode; compile and warm-up excluded)",
        "export_and_load_s": export_s,
        "versions": {p: md.version(p) for p in ("jax", "jaxlib", "torch", "transformers")},
    }


def _hf_generate(model, prompts, *, args, device, gpu: bool) -> list[list[int]]:
    """transformers' greedy `generate` of --new_tokens after each row of prompts [B, T]."""
    import torch

    ids = torch.tensor(prompts, device=device)
    kwargs = {"cache_implementation": "static"} if args.hf_cache == "static" else {}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    if gpu:
        torch.cuda.synchronize()
    return out[:, prompts.shape[1] :].tolist()


def _time_jaxdist(run, repeats: int) -> tuple[list[list[int]], list[float]]:
    """(tokens, prefill + decode seconds of each of `repeats` runs of a prepared generate)."""
    ours, times = None, []
    for r in range(repeats):
        res = run(r)
        ours = res.tokens
        times.append(res.prefill_s + res.decode_s)
    return ours, times


def _time_transformers(hf_generate, prompts, args) -> tuple[list[list[int]], list[float], float]:
    """(tokens, wall seconds of each of --repeats generates, the warm-up's seconds)."""
    t0 = time.perf_counter()
    hf_generate(prompts)  # warm-up: torch.compile of the static cache's forward, if any
    warmup_s = time.perf_counter() - t0
    theirs, times = None, []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        theirs = hf_generate(prompts)
        times.append(time.perf_counter() - t0)
    if any(len(r) != args.new_tokens for r in theirs):
        raise RuntimeError(f"transformers stopped early: {[len(r) for r in theirs]}")
    return theirs, times, warmup_s


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", choices=["tokenize", "loader", "decode", "packing"], required=True)
    p.add_argument("--corpus_mb", type=float, default=50.0, help="tokenize: corpus size")
    p.add_argument("--vocab", type=int, default=8192, help="tokenize: the BPE's vocabulary")
    p.add_argument("--steps", type=int, default=30, help="loader: batches timed")
    p.add_argument("--config", default="configs/llama_tiny.py", help="decode: the model")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--source", default="stdlib", help="packing: data.source")
    p.add_argument("--seq_lens", default="64,256,1024,4096", help="packing: row lengths")
    p.add_argument("--batch_size", type=int, default=16, help="packing: rows per batch")
    p.add_argument("--batch_sizes", default="", help="decode: e.g. 1,8,64 (default 1,8; 1,8,64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0, help="decode: random weights and prompts")
    p.add_argument(
        "--vs_transformers", action="store_true", help="decode: beside transformers' generate"
    )
    p.add_argument("--hf_cache", default="static", help="--vs_transformers: static or dynamic")
    p.add_argument(
        "--hf_compile",
        default="auto",
        help="--vs_transformers: auto (transformers' own choice: it compiles the static cache's "
        "forward on a GPU, in the untimed warm-up) or off",
    )
    p.add_argument("--out", default="runs/bench/data.json")
    args = p.parse_args(argv)
    studies = {
        "tokenize": study_tokenize,
        "loader": study_loader,
        "decode": study_decode,
        "packing": study_packing,
    }
    try:
        result = studies[args.study](args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    _write(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
