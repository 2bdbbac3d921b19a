"""Hugging Face checkpoints in and out of jaxdist (the families with an HF form: Llama, Qwen3).

    python scripts/hf.py import HF_DIR --out DIR
    python scripts/hf.py export PATH --out HF_DIR [--step S] [--dtype float32|bfloat16]

`import` reads `HF_DIR/config.json` and its safetensors (one file, or the shards an index names)
and writes the jaxdist run folder DIR: `config.json`, `checkpoints/0` and the tokenizer files, which
`sample.py`, `eval.py`, `ckpt.py`, `hf.py export` and `train.init_from=DIR` accept. `export` turns a
run folder or checkpoints folder back into `config.json` + safetensors (sharded past
`--max_shard_bytes`) that `transformers.AutoModelForCausalLM.from_pretrained` loads. No network;
nothing is unpickled. Bad input: one `error: ...` line, exit 2, nothing written. Runs on the CPU
(JAX_PLATFORMS=cpu unless set).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxdist.errors import run_command  # noqa: E402
from jaxdist.metrics import human_bytes  # noqa: E402


def cmd_import(args: argparse.Namespace) -> int:
    from jaxdist import weights

    s = weights.import_hf(args.hf_dir, args.out)
    m = s["config"].model
    files = s["tokenizer_files"]
    if "tokenizer.json" in files:
        tok = f"tokenizer files: {', '.join(files)}"
    else:  # generation_config.json alone is no tokenizer
        tok = "no tokenizer (sample.py then takes --prompt_ids, or --bytes)"
    also = f"; also copied: {', '.join(s['other_files'])}" if s["other_files"] else ""
    print(
        f"imported {args.hf_dir} → {args.out}: {m.name}, {m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads} heads ({m.num_kv_heads} key/value), vocab {m.vocab_size}, "
        f"{s['params']:,} parameters ({human_bytes(s['bytes'])} float32); {tok}{also}"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from jaxdist import weights

    s = weights.export_hf(
        args.path, args.out, step=args.step, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes
    )
    print(
        f"exported step {s['step']} of {args.path} → {args.out}: {s['tensors']} tensors, "
        f"{human_bytes(s['bytes'])} {args.dtype} in {', '.join(s['files'])}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face folder → a jaxdist run folder")
    imp.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="the run folder to create (new or empty)")
    imp.set_defaults(fn=cmd_import)
    exp = sub.add_parser(
        "export", help="a jaxdist run or checkpoints folder → a Hugging Face folder"
    )
    exp.add_argument("path", help="a run folder (with checkpoints/) or a checkpoints folder")
    exp.add_argument("--out", required=True, help="the Hugging Face folder to create")
    exp.add_argument("--step", type=int, default=None, help="step to export (default: the latest)")
    exp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    exp.add_argument(
        "--max_shard_bytes",
        type=int,
        default=5 * 2**30,
        help="start a new safetensors file past this size (default 5 GiB)",
    )
    exp.set_defaults(fn=cmd_export)
    args = parser.parse_args(argv)
    return run_command(args.fn, args, extra="hf")


if __name__ == "__main__":
    sys.exit(main())
