"""Generate text from a model: a jaxdist run folder, a checkpoints folder or a Hugging Face folder.

    python scripts/sample.py --checkpoint=PATH --prompt=TEXT [--prompt=TEXT ...] --max_new_tokens=N \\
        [--temperature=0] [--top_k=K] [--top_p=P] [--seed=S] [--out=FILE.jsonl] [--data=D --tensor=T]

Prompts go through the run's tokenizer (the `tokenizer.json` in the folder, else UTF-8 bytes) and
are decoded together with a fixed-size key/value cache: one jitted prefill, then one jitted loop of
decode steps (jaxdist/generate.py). Temperature 0 is greedy. `--data`/`--tensor` split the prompts
and the attention heads over that many devices (simulated on a CPU). Prints each continuation and
the decode speed; `--out` writes one JSON object per prompt: `prompt`, `tokens` (the new ids),
`text`. Bad input: one `error: ...` line, exit 2.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxdist.errors import ConfigError, run_command  # noqa: E402


def run(args: argparse.Namespace) -> int:
    from jaxdist import mesh as mesh_lib

    if not mesh_lib.accelerator_present():
        mesh_lib.configure_cpu_devices(args.data * args.tensor)
    import jax
    import jax.numpy as jnp

    import models
    from jaxdist import generate, tokenizer, weights

    if not args.prompt:
        raise ConfigError("give at least one --prompt=TEXT")
    src = weights.resolve(args.checkpoint, args.step)
    config = src.config
    m = config.model
    family = models.get(m.name)
    if family.decoder is None:
        able = [n for n in models.names() if models.get(n).decoder is not None]
        raise ConfigError(
            f"model.name={m.name!r} in {args.checkpoint} cannot generate text; "
            f"families that can: {', '.join(able)}"
        )
    tok = tokenizer.load(src.file("tokenizer.json"))
    prompts = [tok.encode(p) for p in args.prompt]
    for text, ids in zip(args.prompt, prompts):
        if len(ids) + args.max_new_tokens > m.seq_len:
            raise ConfigError(
                f"--prompt={text[:40]!r} is {len(ids)} tokens; with --max_new_tokens="
                f"{args.max_new_tokens} that passes model.seq_len={m.seq_len}"
            )
        if ids and max(ids) >= m.vocab_size:
            raise ConfigError(
                f"the tokenizer ({tok.name}) gives id {max(ids)} for --prompt={text[:40]!r}, "
                f"but model.vocab_size={m.vocab_size}"
            )
    n = args.data * args.tensor
    if n > jax.device_count():
        raise ConfigError(f"--data×--tensor = {n} devices, but {jax.device_count()} are present")
    if len(prompts) % args.data:
        raise ConfigError(f"{len(prompts)} prompts do not split over --data={args.data}")
    _, _, mesh, params = weights.load_onto_mesh(src, None, data=args.data, tensor=args.tensor)
    dtype = jnp.dtype(config.train.compute_dtype)
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    eos = m.eos_token_id if m.eos_token_id >= 0 else tok.eos_id
    result = generate.generate(
        family.decoder(m),
        params,
        prompts,
        args.max_new_tokens,
        sampling=generate.Sampling(args.temperature, args.top_k, args.top_p),
        eos_id=eos,
        seed=args.seed,
        mesh=mesh,
        cache_dtype=dtype,
    )
    records = []
    for text, new in zip(args.prompt, result.tokens):
        out = tok.decode(new)
        records.append({"prompt": text, "tokens": new, "text": out})
        print(f"--- {text!r}\n{text}{out}")
    print(
        f"{len(prompts)} prompts × {args.max_new_tokens} new tokens on {n} device(s) "
        f"({jax.devices()[0].platform}): prefill {result.prefill_s * 1e3:.1f} ms, decode "
        f"{result.decode_tokens_per_s:.1f} tokens/s"
    )
    if args.out:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint", required=True, help="run folder, checkpoints folder or HF folder"
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--max_new_tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = no limit")
    p.add_argument("--top_p", type=float, default=1.0, help="1 = no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write one JSON object per prompt here")
    p.add_argument("--data", type=int, default=1, help="devices the prompts are split over")
    p.add_argument("--tensor", type=int, default=1, help="devices the heads are split over")
    args = p.parse_args(argv)
    return run_command(run, args, extra="hf")


if __name__ == "__main__":
    sys.exit(main())
