"""Text or JSONL → token shards that `data.source` reads (memory-mapped): the work behind
`python scripts/tokenize.py` (its docstring lists the flags).

Each `--input` is a file, a folder (every file under it) or a glob. A `.jsonl` file holds one
document per line (`--text_key` of each object); any other file is one document. Documents are
tokenized in `--workers` processes, in order, and joined with the EOS token between them; the last
`--val_fraction` of them (at least one) form the validation split. The output folder gets
`train.bin`, `val.bin` (uint16 when the vocabulary fits, else uint32), beside each its document
index `train.docs.npy`, `val.docs.npy` (int64: the token offset where each document starts, for
`data.packing=documents`), `tokenizer.json` and `index.json` (dtype, token and document counts,
vocabulary size, EOS id, the tokenizer's SHA-256), written under a temporary name and renamed;
`jaxdist.data` checks the shards against the index.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

from jaxdist.errors import ConfigError, run_command

EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


def input_files(patterns: list[str]) -> list[str]:
    """Every file the --input arguments name, sorted within each, in argument order."""
    files = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(
                str(p)
                for p in Path(pattern).rglob("*")
                if p.is_file()
                and not any(
                    part.startswith(".") or part == "__pycache__"
                    for part in p.relative_to(pattern).parts
                )
            )
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not found:
            raise ConfigError(f"--input={pattern}: no such file, or no file matches")
        files += found
    return files


def documents(files: list[str], text_key: str) -> list[str]:
    docs = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                if not path.endswith(".jsonl"):
                    docs.append(f.read())
                    continue
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        docs.append(str(json.loads(line)[text_key]))
                    except (ValueError, KeyError, TypeError):
                        raise ConfigError(
                            f"{path}:{n}: not a JSON object with a {text_key!r} field "
                            "(see --text_key)"
                        ) from None
        except OSError as e:
            raise ConfigError(f"{path}: unreadable ({e.strerror})") from None
    docs = [d for d in docs if d]
    if not docs:
        raise ConfigError(f"--input: the {len(files)} file(s) hold no text")
    return docs


def load_tokenizer(args, docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if args.tokenizer:
        path = args.tokenizer
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer={args.tokenizer}: no tokenizer.json there")
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # the library's own error type for a malformed file
            raise ConfigError(f"{path}: not a readable tokenizer.json ({e})") from None
    if args.train_vocab < 257 + 1:
        raise ConfigError(f"--train_vocab={args.train_vocab}: a byte-level BPE needs more than 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.train_vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


_WORKER_TOKENIZER = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(batch: list[str]) -> list[list[int]]:
    # No special tokens: documents are separated by EOS alone.
    return [e.ids for e in _WORKER_TOKENIZER.encode_batch(batch, add_special_tokens=False)]


def run(args) -> dict:
    import numpy as np
    from tqdm import tqdm

    if not 0 < args.val_fraction < 1:
        raise ConfigError(f"--val_fraction={args.val_fraction} must be in (0, 1)")
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers} must be >= 1")
    if bool(args.tokenizer) == bool(args.train_vocab):
        raise ConfigError("give one of --tokenizer=FILE_OR_FOLDER and --train_vocab=N")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out={args.out} already exists and is not empty; choose a new folder")
    docs = documents(input_files(args.input), args.text_key)
    tok = load_tokenizer(args, docs)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_names = [args.eos] if args.eos else EOS_CANDIDATES
    eos = next((tok.token_to_id(t) for t in eos_names if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise ConfigError(
            f"the tokenizer has no {' or '.join(eos_names)} token to separate documents; "
            "name one with --eos"
        )
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    n_val = max(1, round(len(docs) * args.val_fraction))
    splits = {"train": docs[:-n_val] or docs[:1], "val": docs[-n_val:]}
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    counts = {}
    try:
        tok_json = tok.to_str()
        with multiprocessing.get_context("spawn").Pool(
            args.workers, _init_worker, (tok_json,)
        ) as pool:
            for split, split_docs in splits.items():
                batches = [split_docs[i : i + 64] for i in range(0, len(split_docs), 64)]
                counts[split], starts = 0, []
                with open(os.path.join(tmp, f"{split}.bin"), "wb") as f:
                    bar = tqdm(total=len(split_docs), desc=split, unit="doc", file=sys.stderr)
                    for encoded in pool.imap(_encode, batches):
                        for ids in encoded:
                            a = np.asarray([*ids, eos], dtype=dtype)
                            f.write(a.tobytes())
                            starts.append(counts[split])
                            counts[split] += a.size
                        bar.update(len(encoded))
                    bar.close()
                # The document index (jaxdist/data.py `docs_path`): where each document starts.
                np.save(os.path.join(tmp, f"{split}.docs.npy"), np.asarray(starts, np.int64))
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(tok_json)
        index = {
            "format": "jaxdist-tokens/1",
            "dtype": np.dtype(dtype).name,
            "tokens": counts,
            "documents": {k: len(v) for k, v in splits.items()},
            "vocab_size": vocab,
            "eos_id": eos,
            "tokenizer_sha256": hashlib.sha256(tok_json.encode()).hexdigest(),
        }
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f, indent=2)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"wrote {args.out}: {counts['train']} train + {counts['val']} val tokens "
        f"({index['dtype']}, vocabulary {vocab}, EOS id {eos}) from {len(docs)} documents"
    )
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Text or JSONL → token shards for data.source.")
    p.add_argument("--input", action="append", default=[], required=True, help="file, folder, glob")
    p.add_argument("--out", required=True, help="the folder to create")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json, or a folder with one")
    p.add_argument("--train_vocab", type=int, default=0, help="train a byte-level BPE this big")
    p.add_argument("--text_key", default="text", help="the text field of JSONL records")
    p.add_argument("--eos", default="", help="the document separator token (default: found)")
    p.add_argument("--val_fraction", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    return run_command(run, args, extra="hf")
