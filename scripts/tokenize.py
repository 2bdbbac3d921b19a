"""Text or JSONL → token shards that `data.source` reads (memory-mapped).

    python scripts/tokenize.py --input=PATH [--input=PATH ...] --out=DIR
        (--tokenizer=FILE_OR_FOLDER | --train_vocab=N) [--text_key=text] [--eos=TOKEN]
        [--val_fraction=0.05] [--workers=2]

Each `--input` is a file, a folder (every file under it) or a glob. A `.jsonl` file holds one
document per line (`--text_key` of each object); any other file is one document. Documents are
tokenized in `--workers` processes, in order, and joined with the EOS token between them; the last
`--val_fraction` of them (at least one) form the validation split. `--tokenizer` takes a Hugging
Face `tokenizer.json` (or a folder with one, e.g. an imported model); `--train_vocab=N` trains a
byte-level BPE of N tokens on the inputs instead. DIR gets `train.bin`, `val.bin` (uint16 when the
vocabulary fits, else uint32), their document indexes `train.docs.npy`, `val.docs.npy` (int64
document starts, read by `data.packing=documents`), `tokenizer.json` and `index.json` (dtype,
token and document counts, vocabulary size, EOS id, the tokenizer's SHA-256), written under a
temporary name and renamed.
Train on it with `--config.data.source=DIR`. Bad input: one `error: ...` line, exit 2. The work
is done by jaxdist/token_shards.py.

This file's name is the standard library's `tokenize`, and `scripts/` is the first entry of
`sys.path` for every script here, so `import tokenize` (which `inspect` and `linecache` do) finds
it: imported under that name, it hands the importer the standard library's module instead.
"""

import sys

if __name__ == "tokenize":  # imported as the standard library's module: hand that over
    import importlib.util
    import os
    import sysconfig

    _spec = importlib.util.spec_from_file_location(
        __name__, os.path.join(sysconfig.get_paths()["stdlib"], "tokenize.py")
    )
    _stdlib_tokenize = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _stdlib_tokenize  # what `import tokenize` returns
    _spec.loader.exec_module(_stdlib_tokenize)
elif __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jaxdist import token_shards

    sys.exit(token_shards.main())
