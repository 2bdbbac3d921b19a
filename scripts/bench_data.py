"""Benchmarks of the data and generation paths: tokenizing, loading batches, decoding.

    python scripts/bench_data.py --study=tokenize --corpus_mb=50
    python scripts/bench_data.py --study=loader
    python scripts/bench_data.py --study=decode --config=configs/llama_tiny.py
    python scripts/bench_data.py --study=packing

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
            --new_tokens new ones), compile excluded.
  packing   `data.packing=documents` on --source (default the default job's `stdlib`, one document
            per file) at each of --seq_lens: the packing efficiency (fraction of row slots that
            hold a token, not padding), the fraction of slots with a loss target (`windows`:
            all), segments per row, the fraction of documents cut over rows, and the host time
            of the packing plan (`jaxdist.data.pack_rows`) and of one batch of --batch_size rows.

Every figure is a median over --repeats runs (10th–90th percentile alongside), written to --out.
"""

from __future__ import annotations

import argparse
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


def study_decode(args) -> dict:
    import jax
    from flax import nnx

    import models
    from jaxdist import generate

    m = _config_from(args.config).model
    family = models.get(m.name)
    if family.decoder is None:
        raise ConfigError(f"{args.config}: model.name={m.name!r} cannot generate")
    if args.prompt_len + args.new_tokens > m.seq_len:
        raise ConfigError(f"--prompt_len + --new_tokens passes model.seq_len={m.seq_len}")
    module = family.make(m, None)(nnx.Rngs(0))
    params = jax.device_put(nnx.to_pure_dict(nnx.state(module, nnx.Param)), jax.devices()[0])
    rows = {}
    for batch in (1, 8):
        prompts = [
            [(7 * b + i) % m.vocab_size for i in range(args.prompt_len)] for b in range(batch)
        ]
        prefill, decode = [], []
        for r in range(args.repeats):
            res = generate.generate(family.decoder(m), params, prompts, args.new_tokens, seed=r)
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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
