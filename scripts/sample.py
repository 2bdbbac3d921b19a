"""Generate text from a model: a jaxdist run folder, a checkpoints folder or a Hugging Face folder.

    python scripts/sample.py --checkpoint=PATH --prompt=TEXT [--prompt=TEXT ...] --max_new_tokens=N \\
        [--temperature=0] [--top_k=K] [--top_p=P] [--seed=S] [--out=FILE.jsonl] [--data=D --tensor=T]
    python scripts/sample.py --checkpoint=PATH --prompt_ids='[5, 17, 33]' --max_new_tokens=N ...

Prompts go through the model's tokenizer: the `tokenizer.json` in its folder (an imported or
fine-tuned Hugging Face model's, or the token shards' it trained on), or UTF-8 bytes for a run that
trained on bytes (`data.source` text or `stdlib`). A folder with neither has no tokenizer: it says
so and takes `--prompt_ids` (token ids) or `--bytes` (encode text prompts as UTF-8 bytes anyway).
Prompts are decoded together with a fixed-size key/value cache: one jitted prefill, then one jitted
loop of decode steps (jaxdist/generate.py). Temperature 0 is greedy. `--data`/`--tensor` split the
prompts and the attention heads over that many devices (simulated on a CPU). Prints each
continuation (control characters escaped, so model output cannot drive the terminal) and the
decode speed; `--out` writes one JSON object per prompt: `prompt`, `tokens` (the new ids), `text`
(null without a tokenizer). Bad input: one `error: ...` line, exit 2.
"""

import argparse
import json
import os
import sys
import unicodedata
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

    if not args.prompt and not args.prompt_ids:
        raise ConfigError("give at least one --prompt=TEXT or --prompt_ids='[ID, ...]'")
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
    tok, why = _tokenizer(src, args.bytes)
    id_prompts = [_parse_ids(text) for text in args.prompt_ids]
    labels = [*args.prompt, *id_prompts]  # what each output record names as its prompt
    encoder = tok if tok is not None else tokenizer.Bytes()  # lengths are checked first
    prompts = [encoder.encode(p) for p in args.prompt] + id_prompts
    _check_prompts(args, labels, prompts, tok, encoder, m)
    print(f"tokenizer: {why}")
    n = args.data * args.tensor
    if n > jax.device_count():
        raise ConfigError(f"--data×--tensor = {n} devices, but {jax.device_count()} are present")
    if len(prompts) % args.data:
        raise ConfigError(f"{len(prompts)} prompts do not split over --data={args.data}")
    _, _, mesh, params = weights.load_onto_mesh(src, None, data=args.data, tensor=args.tensor)
    dtype = jnp.dtype(config.train.compute_dtype)
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    eos = m.eos_token_id if m.eos_token_id >= 0 else (tok.eos_id if tok is not None else None)
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
    for label, new in zip(labels, result.tokens):
        out = tok.decode(new) if tok is not None else None
        records.append({"prompt": label, "tokens": new, "text": out})
        if isinstance(label, str):
            print(f"--- {label!r}\n{escape(label + out)}")
        else:
            print(f"--- {label}\n" + (escape(out) if out is not None else f"new ids: {new}"))
    print(
        f"{len(prompts)} prompts × {args.max_new_tokens} new tokens on {n} device(s) "
        f"({jax.devices()[0].platform}): prefill {result.prefill_s * 1e3:.1f} ms, decode "
        f"{result.decode_tokens_per_s:.1f} tokens/s"
    )
    if args.out:
        _write_records(args.out, records)
    return 0


def _check_prompts(args, labels, prompts, tok, encoder, m) -> None:
    """Refuses (ConfigError) an empty prompt, one that leaves no room for --max_new_tokens within
    model.seq_len, text without a tokenizer, and ids outside the model's vocabulary."""
    for label, ids in zip(labels, prompts):
        flag = _prompt_flag(label)
        if not ids:
            raise ConfigError(f"{flag} is empty; a prompt needs at least one token")
        if len(ids) + args.max_new_tokens > m.seq_len:
            raise ConfigError(
                f"{flag} is {len(ids)} tokens; with --max_new_tokens="
                f"{args.max_new_tokens} that passes model.seq_len={m.seq_len}"
            )
    if tok is None and args.prompt:
        raise ConfigError(
            f"{args.checkpoint} has no tokenizer (no tokenizer.json, and it did not train on "
            "bytes): give prompts as token ids, --prompt_ids='[5, 17, 33]', or encode the text "
            "as UTF-8 bytes with --bytes"
        )
    for label, ids in zip(labels, prompts):
        if max(ids) >= m.vocab_size or min(ids) < 0:
            flag = _prompt_flag(label)
            by = f"the tokenizer ({encoder.name}) gives" if isinstance(label, str) else "it has"
            raise ConfigError(
                f"{by} id {max(ids) if max(ids) >= m.vocab_size else min(ids)} for {flag}, "
                f"but model.vocab_size={m.vocab_size} (ids 0 to {m.vocab_size - 1})"
            )


def _prompt_flag(label) -> str:
    """The flag that gave a prompt, as an error names it: its text's start, or --prompt_ids."""
    return f"--prompt={label[:40]!r}" if isinstance(label, str) else "--prompt_ids"


def _write_records(path: str, records: list[dict]) -> None:
    """One JSON line per prompt, written whole (a temporary file renamed over `path`)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def _tokenizer(src, force_bytes: bool):
    """(tokenizer or None, what it is, in words): the folder's tokenizer.json; UTF-8 bytes for a
    run that trained on bytes or with --bytes; None when the folder has no tokenizer."""
    from jaxdist import data, tokenizer

    path = src.file("tokenizer.json")
    if path is not None:
        if force_bytes:
            raise ConfigError(f"--bytes, but {src.path} has a tokenizer ({path}); drop --bytes")
        return tokenizer.load(path), path
    source = src.config.data.source
    if force_bytes:
        return tokenizer.Bytes(), "UTF-8 bytes (--bytes)"
    trained_on_bytes = (
        src.kind == "jaxdist" and source != "digits" and not data.is_token_source(source)
    )
    if trained_on_bytes:
        return tokenizer.Bytes(), f"UTF-8 bytes (the run trained on data.source={source} as bytes)"
    return None, "none (prompts given as ids)"


def _parse_ids(text: str) -> list[int]:
    """`'[5, 17, 33]'` → [5, 17, 33]; ConfigError for anything else."""
    try:
        ids = json.loads(text)
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ConfigError(
            f"--prompt_ids={text!r}: expected a JSON list of token ids, e.g. '[5, 17, 33]'"
        )
    return ids


def escape(text: str) -> str:
    """`text` with control characters (but newline and tab) as escapes, e.g. `\\x1b`: what a model
    generates must not move the cursor, clear the screen or retitle the terminal."""
    return "".join(
        c
        if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Cn")
        else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint", required=True, help="run folder, checkpoints folder or HF folder"
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument(
        "--prompt_ids",
        action="append",
        default=[],
        help="a prompt as token ids, e.g. '[5, 17, 33]' (a model folder without a tokenizer)",
    )
    p.add_argument(
        "--bytes",
        action="store_true",
        help="without a tokenizer: encode --prompt as UTF-8 bytes (ids 0-255) anyway",
    )
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
