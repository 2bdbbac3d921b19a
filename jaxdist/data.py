"""Data: byte-level text, uint16 token files and image arrays, loaded per process into global arrays.

Sources (`data.source`):
* `stdlib`: the Python standard library's `.py` files, read in sorted order as bytes (vocabulary 256).
  Real text on every machine, no download.
* a text file or a directory of text files: the same byte-level tokenisation.
* a `.bin` file of uint16 tokens (nanoGPT format), or a directory with `train.bin` (and `val.bin`);
  with an `index.json` (scripts/tokenize.py) the tokens may be uint32, and are checked against it.
* a `.npz` with `images` [N, H, W(, C)] and integer `labels` [N].
* `digits`: the 8×8 handwritten digits scikit-learn ships (extra `digits`).

A mixture: `data.sources` (a tuple of token sources as above, replacing `data.source`) and
`data.weights` (one per source, default equal): each batch row comes from source k with
probability weights[k] / sum(weights), drawn from (seed, step) like everything else.

Packing (`data.packing`, `PACKINGS`): `windows` cuts each row as a random window of seq_len + 1
tokens across documents (a token attends to the previous document's tail, positions run on);
`documents` packs whole documents into rows (jaxdist/packing.py) and yields, with `inputs` and
`targets`, `segment_ids` (1, 2, ... per document piece in the row, 0 = padding) and `positions`
(restarting at 0 in each piece); a target that would cross into the next document, and padding,
is -1 (the loss skips it). It needs the document starts: file boundaries for `stdlib` and text
sources, `train.docs.npy` / `val.docs.npy` beside token shards (scripts/tokenize.py). With a
mixture each source is packed apart (rows of whole documents of one source); a row's source is
drawn by `data.weights` as for windows, then one of that source's packed rows.

Order is a pure function of (seed, batch index): batch `i` is the same whatever the process count or
restart history, so the iterator position is one integer saved with each checkpoint. Each process
materialises only the rows its devices hold and builds the global array with
`jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zipfile
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxdist.errors import ConfigError
from jaxdist.packing import (  # noqa: F401  (read as data.X by scripts and tests)
    NO_TARGET,
    PACKED_KEYS,
    pack_rows,
    packed_rows,
    packing_stats,
)

_VAL_STREAM = 1_000_003  # separates validation RNG streams from training ones
PACKINGS = ("windows", "documents")  # `data.packing`: the one registry of packing modes


def _text_paths(root: str, suffix: str | None):
    """The files under `root` (or `root` itself), folders and files in sorted order, found
    lazily: a reader that stops early never lists the rest of the tree."""
    if os.path.isfile(root):
        yield root
        return
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if suffix is None or f.endswith(suffix):
                yield os.path.join(d, f)


def _read_text_files(
    root: str, max_bytes: int, suffix: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes of the files under `root`, each file's start offset in them: its documents)."""
    chunks, starts, total = [], [], 0
    for p in _text_paths(root, suffix):
        if total >= max_bytes:
            break
        try:
            with open(p, "rb") as f:
                b = f.read(max_bytes - total)
        except OSError:
            continue  # unreadable file inside a tree: skip it, as a user's `cat` would
        if b:
            starts.append(total)
        chunks.append(b)
        total += len(b)
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if data.size == 0:
        raise ConfigError(f"data.source={root!r}: no readable text found")
    return data, np.asarray(starts, np.int64)


@dataclass
class Dataset:
    """Train/validation arrays plus what the model needs to know about them."""

    kind: str  # "tokens" or "images"
    train: np.ndarray
    val: np.ndarray
    train_labels: np.ndarray | None = None
    val_labels: np.ndarray | None = None
    vocab_size: int = 256
    warnings: list[str] = field(default_factory=list)  # one line each, for the console
    # A mixture (`data.sources`): its token sources and the probability each batch row comes
    # from each; `train`/`val` are then the first source's.
    parts: list[Dataset] | None = None
    weights: np.ndarray | None = None
    # Document starts (token offsets, int64, ascending, the first 0) in `train` / `val`; None
    # when the source has no document index (then only `data.packing=windows` reads it).
    train_docs: np.ndarray | None = None
    val_docs: np.ndarray | None = None
    docs_hint: str = ""  # how to get a document index for this source, for the error

    @property
    def example_shape(self) -> tuple[int, ...]:
        return tuple(self.train.shape[1:])

    @property
    def num_classes(self) -> int:
        return int(self.train_labels.max()) + 1 if self.train_labels is not None else 0


NOISE_BITS_PER_BYTE = 7.5  # text is ~4-5 bits/byte; random or compressed bytes are ~8


def byte_entropy(data: np.ndarray) -> float:
    """Shannon entropy of the byte histogram, bits per byte (8 = uniform: noise)."""
    p = np.bincount(np.asarray(data, dtype=np.uint8), minlength=256) / max(len(data), 1)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def noise_warning(source: str, data: np.ndarray, sample: int = 1 << 20) -> str | None:
    """A one-line warning when text bytes look like noise (a near-uniform byte histogram).

    A model learns nothing from such data (its loss stays near ln 256 = 5.55); it is usually a
    binary or compressed file passed as text. Needs 4 KiB to judge; a smaller sample passes.
    """
    head = data[:sample]
    if len(head) < 4096:
        return None
    bits = byte_entropy(head)
    if bits < NOISE_BITS_PER_BYTE:
        return None
    return (
        f"data.source={source!r} looks like noise, not text: its bytes are near-uniform "
        f"({bits:.2f} bits/byte; text has about 4-5), so the loss will stay near ln 256 = 5.55; "
        "is it a binary or compressed file? (token files end in .bin)"
    )


def _check_token_file(src: str, path: str, dtype: np.dtype) -> None:
    """ConfigError unless `path` (data.source, or its val.bin) holds whole `dtype` tokens."""
    size, width, name = os.path.getsize(path), dtype.itemsize, dtype.name
    what = f"data.source={src!r}" + (f": {path}" if path != src else "")
    if size % width:
        raise ConfigError(
            f"{what} is {size} bytes, not a whole number of {name} tokens ({width} bytes each): "
            f"a truncated or non-token file; write tokens with numpy's .astype(np.{name}).tofile()"
        )
    if size == 0:
        raise ConfigError(f"{what} is empty; it should hold {name} tokens")


_TOKEN_CHUNK = 1 << 24  # tokens per step of the scan: 32-64 MiB of the memory map at a time
_max_ids: dict[tuple[str, int, int], int] = {}  # (path, size, mtime_ns) -> its largest token id


def token_max(path: str, dtype: np.dtype) -> int:
    """The largest token id in the token file `path`, read in chunks through a memory map.

    Remembered for the process by (path, size, modification time), so a file read again (the
    trainer, then eval) is scanned once. -1 for an empty file.
    """
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _max_ids:
        tokens = np.memmap(path, dtype=dtype, mode="r") if st.st_size else np.empty(0, dtype)
        top = -1
        for start in range(0, len(tokens), _TOKEN_CHUNK):
            top = max(top, int(tokens[start : start + _TOKEN_CHUNK].max()))
        _max_ids[key] = top
    return _max_ids[key]


def _check_token_ids(src: str, path: str, dtype: np.dtype, vocab_size: int) -> None:
    """ConfigError naming the file, the offset and the id of the first token >= `vocab_size`."""
    if token_max(path, dtype) < vocab_size:
        return
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _TOKEN_CHUNK):
        bad = np.flatnonzero(tokens[start : start + _TOKEN_CHUNK] >= vocab_size)
        if bad.size:
            offset = start + int(bad[0])
            raise ConfigError(
                f"data.source={src!r}: {path} has token id {int(tokens[offset])} at token offset "
                f"{offset} (byte {offset * dtype.itemsize}); model.vocab_size={vocab_size} must "
                "exceed it"
            )


TOKEN_INDEX = "index.json"  # scripts/tokenize.py's description of train.bin / val.bin


def is_token_source(src: str) -> bool:
    """A `.bin` token file, or a folder with `train.bin` (nanoGPT's, or scripts/tokenize.py's)."""
    return src.endswith(".bin") or os.path.isfile(os.path.join(src, "train.bin"))


def _token_index(folder: str, vocab_size: int) -> dict | None:
    """The folder's index.json (scripts/tokenize.py), checked against its .bin files; None when
    there is none (then the files are nanoGPT's uint16)."""
    path = os.path.join(folder, TOKEN_INDEX)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            index = json.load(f)
        dtype = np.dtype(index["dtype"])
        counts = {k: int(v) for k, v in index["tokens"].items()}
        index_vocab = int(index.get("vocab_size", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        why = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{path}: malformed token index ({type(e).__name__}: {why})") from None
    for split in counts:
        if split not in ("train", "val"):
            raise ConfigError(f"{path}: tokens of split {split!r}; the splits are train and val")
    if dtype not in (np.uint16, np.uint32):
        raise ConfigError(f"{path}: dtype={index['dtype']!r}; token shards are uint16 or uint32")
    for split, count in counts.items():
        shard = os.path.join(folder, f"{split}.bin")
        size = os.path.getsize(shard) if os.path.isfile(shard) else -1
        if size != count * dtype.itemsize:
            raise ConfigError(
                f"{shard}: {size} bytes, but {path} says {count} {dtype.name} tokens "
                f"({count * dtype.itemsize} bytes); re-run scripts/tokenize.py"
            )
    if index_vocab > vocab_size:
        raise ConfigError(
            f"{path}: the tokenizer has {index['vocab_size']} tokens, more than "
            f"model.vocab_size={vocab_size}"
        )
    return {**index, "dtype": dtype}


def _checked_images(src: str, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """ConfigError unless an .npz holds numeric `images` [N, ...] and integer `labels` [N] >= 0
    (N >= 2: one example for each split); returns the labels as int32."""
    what = f"data.source={src!r}"
    if images.ndim < 2 or not (np.issubdtype(images.dtype, np.number) or images.dtype == np.bool_):
        raise ConfigError(
            f"{what}: 'images' is {images.dtype} of shape {list(images.shape)}; expected numbers "
            "of shape [N, H, W] or [N, H, W, C]"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(
            f"{what}: 'labels' is {labels.dtype} of shape {list(labels.shape)}; expected integers "
            f"of shape [N] (N = {len(images)} images)"
        )
    if len(labels) != len(images) or len(images) < 2:
        raise ConfigError(
            f"{what}: {len(images)} images and {len(labels)} labels; expected as many of each, "
            "at least 2 (one for validation)"
        )
    if labels.min() < 0 or labels.max() >= 2**31:
        raise ConfigError(
            f"{what}: labels range over {labels.min()}..{labels.max()}; class ids are 0..N-1"
        )
    return labels.astype(np.int32)


def _split(x: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(x) * val_fraction))
    return x[:-n_val], x[-n_val:]


def _split_docs(starts: np.ndarray, n_train: int) -> tuple[np.ndarray, np.ndarray]:
    """Document starts of a stream cut at token `n_train` into (train, val): the val split
    starts with the cut document's tail, a document of its own."""
    val = starts[starts > n_train] - n_train
    return starts[starts < n_train], np.concatenate([[0], val]).astype(np.int64)


DOCS_SUFFIX = ".docs.npy"  # `train.bin` -> `train.docs.npy`: int64 document starts


def docs_path(bin_path: str) -> str:
    """The document index beside a token shard: `X.bin` -> `X.docs.npy`."""
    return os.path.splitext(bin_path)[0] + DOCS_SUFFIX


def _load_docs(src: str, bin_path: str, n_tokens: int) -> np.ndarray | None:
    """The shard's document starts (memory-mapped), checked; None when it has no index."""
    path = docs_path(bin_path)
    if not os.path.isfile(path):
        return None
    try:
        starts = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"data.source={src!r}: {path} is no readable .npy ({e})") from None
    ok = starts.ndim == 1 and starts.dtype == np.int64 and len(starts) >= 1
    ok = ok and int(starts[0]) == 0 and int(starts[-1]) < n_tokens
    if not ok or (len(starts) > 1 and not bool(np.all(np.diff(starts) > 0))):
        raise ConfigError(
            f"data.source={src!r}: {path} must hold ascending int64 document starts from 0, "
            f"each below the shard's {n_tokens} tokens; re-run scripts/tokenize.py"
        )
    return starts


def load(data_cfg, *, seq_len: int, vocab_size: int) -> Dataset:
    """Reads `data.source` (or each of `data.sources`) into memory, or memory-maps it.

    Raises ConfigError on a bad path.
    """
    sources = tuple(data_cfg.get("sources", ()) or ())
    if not sources:
        ds = _load_one(data_cfg.source, data_cfg, seq_len=seq_len, vocab_size=vocab_size)
        if data_cfg.get("packing", "windows") == "documents":
            _check_documents(data_cfg.source, ds)
        return ds
    weights = np.asarray(tuple(data_cfg.get("weights", ()) or (1.0,) * len(sources)), np.float64)
    parts = [_load_one(s, data_cfg, seq_len=seq_len, vocab_size=vocab_size) for s in sources]
    for s, part in zip(sources, parts):
        if part.kind != "tokens":
            raise ConfigError(
                f"data.sources: {s!r} holds {part.kind}; a mixture mixes token sources"
            )
        if data_cfg.get("packing", "windows") == "documents":
            _check_documents(s, part)
    return Dataset(
        "tokens",
        parts[0].train,
        parts[0].val,
        vocab_size=max(p.vocab_size for p in parts),
        warnings=[w for p in parts for w in p.warnings],
        parts=parts,
        weights=weights / weights.sum(),
    )


def _check_documents(src: str, ds: Dataset) -> None:
    """ConfigError unless `ds` can be packed by documents (tokens with a document index)."""
    if ds.kind != "tokens":
        raise ConfigError(
            f"data.packing='documents' needs token data, but data.source={src!r} holds "
            f"{ds.kind}; set data.packing=windows"
        )
    if ds.train_docs is None or ds.val_docs is None:
        hint = ds.docs_hint or "it has no document index; set data.packing=windows"
        raise ConfigError(f"data.packing='documents': data.source={src!r} cannot be packed: {hint}")


def _load_one(src: str, data_cfg, *, seq_len: int, vocab_size: int) -> Dataset:
    """One source: `stdlib`, `digits`, a text file or folder, a token `.bin` / folder, an `.npz`."""
    vf = data_cfg.val_fraction
    if src == "stdlib":
        tokens, starts = _read_text_files(
            sysconfig.get_paths()["stdlib"], data_cfg.max_bytes, ".py"
        )
        train, val = _split(tokens, vf)
        tr_docs, va_docs = _split_docs(starts, len(train))
        return Dataset("tokens", train, val, vocab_size=256, train_docs=tr_docs, val_docs=va_docs)
    if src == "digits":
        return _load_digits(vf)
    if not os.path.exists(src):
        raise ConfigError(f"data.source={src!r}: no such file or directory (or use 'stdlib')")
    if src.endswith(".npz"):
        return _load_npz(src, vf)
    bin_train = src if src.endswith(".bin") else os.path.join(src, "train.bin")
    if os.path.isfile(bin_train):
        return _load_token_shards(src, bin_train, vf, seq_len=seq_len, vocab_size=vocab_size)
    tokens, starts = _read_text_files(src, data_cfg.max_bytes, None)
    train, val = _split(tokens, vf)
    if len(val) <= seq_len + 1 or len(train) <= seq_len + 1:
        raise ConfigError(f"data.source={src!r} is too short for model.seq_len={seq_len}")
    warning = noise_warning(src, tokens)
    tr_docs, va_docs = _split_docs(starts, len(train))
    return Dataset(
        "tokens",
        train,
        val,
        vocab_size=256,
        warnings=[warning] if warning else [],
        train_docs=tr_docs,
        val_docs=va_docs,
    )


def _load_digits(vf: float) -> Dataset:
    """scikit-learn's 8×8 digits (the `digits` extra), scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ConfigError(
            "data.source='digits' needs scikit-learn: pip install -e '.[digits]'"
        ) from e
    d = load_digits()
    images = (d.images / 16.0).astype(np.float32)
    tr, va = _split(images, vf)
    ltr, lva = _split(d.target.astype(np.int32), vf)
    return Dataset("images", tr, va, ltr, lva)


def _load_npz(src: str, vf: float) -> Dataset:
    """An `.npz` of `images` and `labels` (no pickle), uint8 images scaled to [0, 1]."""
    try:
        with np.load(src, allow_pickle=False) as f:
            if "images" not in f or "labels" not in f:
                raise ConfigError(
                    f"data.source={src!r}: an .npz needs arrays 'images' and 'labels', has {sorted(f.files)}"
                )
            images, labels = f["images"], f["labels"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"data.source={src!r}: not a readable .npz ({e})") from None
    labels = _checked_images(src, images, labels)
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / 255.0
    tr, va = _split(images.astype(np.float32), vf)
    ltr, lva = _split(labels, vf)
    return Dataset("images", tr, va, ltr, lva)


def _load_token_shards(
    src: str, bin_train: str, vf: float, *, seq_len: int, vocab_size: int
) -> Dataset:
    """Memory-mapped token shards (`train.bin`, `val.bin` or a split of the one file), every id
    checked against the vocabulary, with their document index when there is one."""
    index = _token_index(os.path.dirname(bin_train), vocab_size)
    dtype = np.dtype(np.uint16 if index is None else index["dtype"])
    _check_token_file(src, bin_train, dtype)
    tokens = np.memmap(bin_train, dtype=dtype, mode="r")
    val_path = os.path.join(os.path.dirname(bin_train), "val.bin")
    files = [bin_train]
    starts = _load_docs(src, bin_train, len(tokens))
    if os.path.isfile(val_path) and val_path != bin_train:
        _check_token_file(src, val_path, dtype)
        train, val = tokens, np.memmap(val_path, dtype=dtype, mode="r")
        files.append(val_path)
        val_docs = _load_docs(src, val_path, len(val))
        docs = (starts, val_docs) if starts is not None and val_docs is not None else None
    else:
        train, val = _split(tokens, vf)
        docs = None if starts is None else _split_docs(np.asarray(starts), len(train))
    for path in files:  # every token, not a sample: one bad id turns the loss into NaN
        _check_token_ids(src, path, dtype, vocab_size)
    for name, arr in (("train", train), ("validation", val)):
        if len(arr) <= seq_len + 1:
            raise ConfigError(
                f"data.source={src!r}: the {name} split has {len(arr)} tokens, fewer than "
                f"model.seq_len+1={seq_len + 1}"
            )
    return Dataset(
        "tokens",
        train,
        val,
        vocab_size=vocab_size,
        train_docs=None if docs is None else docs[0],
        val_docs=None if docs is None else docs[1],
        docs_hint=f"it has no {docs_path(bin_train)} (the document index that "
        "scripts/tokenize.py writes beside each shard); re-tokenize the text with "
        "scripts/tokenize.py, or set data.packing=windows",
    )


def process_row_range(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous block of batch rows this process's devices hold."""
    rows = set()
    for idx in sharding.addressable_devices_indices_map(global_shape).values():
        sl = idx[0]
        start, stop, _ = sl.indices(global_shape[0])
        rows.update(range(start, stop))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError("this process's devices hold non-contiguous batch rows; check mesh.dcn_*")
    return lo, hi


class Batches:
    """Deterministic batches of a Dataset, built as global jax.Arrays with the given sharding."""

    def __init__(
        self,
        ds: Dataset,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        shardings: dict,
        packing: str = "windows",
    ):
        self.ds, self.batch_size, self.seq_len, self.seed = ds, batch_size, seq_len, seed
        self.shardings, self.packing = shardings, packing
        self._plans: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        if packing not in PACKINGS:
            raise ConfigError(f"data.packing={packing!r} is not valid; choose one of {PACKINGS}")
        if packing == "documents":
            for k, part in enumerate(ds.parts or [ds]):
                _check_documents("the dataset" if ds.parts is None else f"source {k}", part)
        if ds.kind == "tokens":
            for part in ds.parts or [ds]:
                for name, arr in (("train", part.train), ("validation", part.val)):
                    if len(arr) <= seq_len + 1:
                        raise ConfigError(
                            f"data: the {name} split has {len(arr)} tokens, fewer than "
                            f"model.seq_len+1={seq_len + 1}"
                        )

    def _part(self, source: int) -> Dataset:
        return self.ds if self.ds.parts is None else self.ds.parts[source]

    def plan(self, split: str = "train", source: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """`data.packing=documents`: the split's packed rows (`pack_rows`) of one source (of a
        mixture; the dataset's own otherwise), computed once."""
        if (split, source) not in self._plans:
            part = self._part(source)
            docs = part.train_docs if split == "train" else part.val_docs
            arr = self._split_of(part, split)
            self._plans[split, source] = pack_rows(len(arr), docs, self.seq_len)
        return self._plans[split, source]

    def _indices(self, step: int, split: str) -> np.ndarray:
        """Window starts or packed rows (tokens), example indices (images) for batch `step`."""
        B = self.batch_size
        if self.ds.kind == "tokens":
            stream = 0 if split == "train" else _VAL_STREAM
            rng = np.random.default_rng([self.seed, stream, step])
            if self.packing == "documents" and self.ds.parts is None:  # drawn with replacement
                return rng.integers(0, len(self.plan(split)[0]), size=B)
            if self.ds.parts is not None:  # [B, 2]: (source, window start or packed row)
                which = rng.choice(len(self.ds.parts), size=B, p=self.ds.weights)
                if self.packing == "documents":
                    rows = np.array(
                        [len(self.plan(split, k)[0]) for k in range(len(self.ds.parts))]
                    )
                    return np.stack([which, (rng.random(B) * rows[which]).astype(np.int64)], 1)
                sizes = np.array([len(self._split_of(p, split)) for p in self.ds.parts])
                starts = (rng.random(B) * (sizes[which] - self.seq_len - 1)).astype(np.int64)
                return np.stack([which, starts], axis=1)
            arr = self._split_of(self.ds, split)
            return rng.integers(0, len(arr) - self.seq_len - 1, size=B)
        if split != "train":  # evaluation walks the validation set in order, wrapping
            return (np.arange(B) + step * B) % len(self.ds.val)
        n = len(self.ds.train)
        pos = np.arange(step * B, (step + 1) * B)
        out = np.empty(B, dtype=np.int64)
        for epoch in np.unique(pos // n):  # a fresh permutation each epoch
            perm = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
            sel = pos // n == epoch
            out[sel] = perm[pos[sel] % n]
        return out

    @staticmethod
    def _split_of(ds: Dataset, split: str) -> np.ndarray:
        return ds.train if split == "train" else ds.val

    def _rows(self, idx: np.ndarray, split: str) -> dict[str, np.ndarray]:
        if self.ds.kind == "tokens":
            T = self.seq_len
            if self.packing == "documents":
                return self._packed(idx, split)
            if idx.ndim == 2:  # a mixture: (source, start)
                arrs = [self._split_of(p, split) for p in self.ds.parts]
                windows = [arrs[k][s : s + T + 1] for k, s in idx]
            else:
                arr = self._split_of(self.ds, split)
                windows = [arr[s : s + T + 1] for s in idx]
            win = np.stack([np.asarray(w, dtype=np.int32) for w in windows])
            return {"inputs": win[:, :-1], "targets": win[:, 1:]}
        x = self.ds.train if split == "train" else self.ds.val
        y = self.ds.train_labels if split == "train" else self.ds.val_labels
        return {"inputs": x[idx], "targets": y[idx]}

    def _packed(self, idx: np.ndarray, split: str) -> dict[str, np.ndarray]:
        """The packed rows `idx` ([B]: rows of the plan; a mixture's [B, 2]: (source, row))."""
        which, rows = (np.zeros_like(idx), idx) if idx.ndim == 1 else (idx[:, 0], idx[:, 1])
        out = {k: np.zeros((len(rows), self.seq_len), np.int32) for k in PACKED_KEYS}
        for k in np.unique(which).tolist():
            part, sel = self._part(k), which == k
            docs = part.train_docs if split == "train" else part.val_docs
            start, used = self.plan(split, k)
            arr, T = self._split_of(part, split), self.seq_len
            got = packed_rows(arr, docs, start[rows[sel]], used[rows[sel]], T)
            for key, v in got.items():
                out[key][sel] = v
        return out

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        B = self.batch_size
        if self.ds.kind == "tokens":
            keys = PACKED_KEYS if self.packing == "documents" else ("inputs", "targets")
            return {k: (B, self.seq_len) for k in keys}
        return {"inputs": (B, *self.ds.example_shape), "targets": (B,)}

    def get(self, step: int, split: str = "train") -> dict[str, jax.Array]:
        """Global batch `step`; this process reads only its rows."""
        idx = self._indices(step, split)
        shapes = self.global_shapes()
        lo, hi = process_row_range(self.shardings["inputs"], shapes["inputs"])
        local = self._rows(idx[lo:hi], split)
        return {
            k: jax.make_array_from_process_local_data(self.shardings[k], v, shapes[k])
            for k, v in local.items()
        }

    def get_host(self, step: int, split: str = "train") -> dict[str, np.ndarray]:
        """The whole global batch on the host (for references and tests)."""
        return self._rows(self._indices(step, split), split)
