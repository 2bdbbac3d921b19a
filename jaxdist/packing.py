"""`data.packing=documents`: whole documents packed into rows of seq_len slots, and the batch
entries of those rows (`segment_ids`, `positions`, targets cut at each document's end).

Pure numpy over a token stream and its document starts; `jaxdist/data.py` plans each split's rows
once (`pack_rows`) and builds a batch's rows (`packed_rows`); scripts/bench_data.py reports how
well they were filled (`packing_stats`).
"""

from __future__ import annotations

import numpy as np

PACKED_KEYS = ("inputs", "targets", "segment_ids", "positions")  # a `documents` batch
NO_TARGET = -1  # a target the loss skips (a document boundary, padding) under `documents`


def pack_rows(n_tokens: int, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `length` slots that whole documents fill, in order (greedy, first fit).

    A document goes whole into the current row when it fits; one that does not fit but would
    fit an empty row starts the next row and the current one is padded; one longer than a row
    fills the row and its tail goes on in the next, as a new segment. Since documents keep their
    order and padding only ends a row, each row is one contiguous slice of the token stream.

    Args:
      n_tokens: tokens in the stream.
      starts: [D] ascending document starts, the first 0.
      length: slots per row (model.seq_len).

    Returns:
      (start [R] int64: each row's first token in the stream, used [R] int32: its tokens, the rest
      of its `length` slots padding).
    """
    ends = np.append(np.asarray(starts[1:], np.int64), n_tokens)
    row_start, row_used = [], []
    cur, used = 0, 0
    for s, e in zip(np.asarray(starts, np.int64).tolist(), ends.tolist()):
        if used and (used == length or length - used < e - s <= length):
            row_start.append(cur), row_used.append(used)  # full, or padded: the doc fits whole next
            used = 0
        if not used:
            cur = s
        pos = s
        while e - pos > length - used:  # a document longer than the room left: cut it
            pos += length - used
            row_start.append(cur), row_used.append(length)
            cur, used = pos, 0
        used += e - pos
    if used:
        row_start.append(cur), row_used.append(used)
    return np.asarray(row_start, np.int64), np.asarray(row_used, np.int32)


def packed_rows(
    tokens: np.ndarray, starts: np.ndarray, row_start: np.ndarray, row_used: np.ndarray, T: int
) -> dict[str, np.ndarray]:
    """The batch entries of packed rows: `inputs`, `targets` (NO_TARGET across a document
    boundary and on padding), `segment_ids` (1, 2, ... per document piece, 0 on padding) and
    `positions` (0, 1, ... within each piece), each [R, T] int32."""
    t = np.arange(T)
    idx = row_start[:, None] + t[None, :]  # [R, T] stream offsets
    real = t[None, :] < row_used[:, None]
    n = len(tokens)
    idx_c = np.minimum(idx, n - 1)
    doc = np.searchsorted(starts, idx_c, side="right") - 1  # each slot's document
    nxt = np.minimum(idx + 1, n - 1)
    same_next = (np.searchsorted(starts, nxt, side="right") - 1 == doc) & (idx + 1 < n)
    # A row's first piece is a segment even when it is the tail of a cut document.
    seg_start = np.maximum(np.asarray(starts)[doc], row_start[:, None])  # [R, T]
    segment_ids = np.where(real, doc - doc[:, :1] + 1, 0)
    positions = np.where(real, idx - seg_start, 0)
    inputs = np.where(real, np.asarray(tokens[idx_c.ravel()]).reshape(idx.shape), 0)
    targets = np.asarray(tokens[nxt.ravel()]).reshape(idx.shape).astype(np.int64)
    targets = np.where(real & same_next, targets, NO_TARGET)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)
    return {
        "inputs": i32(inputs),
        "targets": i32(targets),
        "segment_ids": i32(segment_ids),
        "positions": i32(positions),
    }


def packing_stats(
    n_tokens: int, starts: np.ndarray, row_start: np.ndarray, row_used: np.ndarray, length: int
) -> dict:
    """How well `pack_rows` filled its rows.

    Returns:
      rows; documents; `efficiency`: the fraction of row slots holding a token (not padding);
      `target_fraction`: the fraction of slots with a loss target (a token followed by one of
      its own document; `windows` has 1.0); `pieces_per_row`: segments per row; `cut_documents`:
      the fraction of documents split over rows.
    """
    starts = np.asarray(starts, np.int64)
    ends = np.append(starts[1:], n_tokens)
    row_end = row_start + row_used
    # A piece loses its last target when its document ends inside the row.
    inside = lambda at: np.searchsorted(ends, at, "right")
    ends_inside = inside(row_end) - inside(row_start)
    first = np.searchsorted(starts, row_start, "right") - 1
    last = np.searchsorted(starts, row_end - 1, "right") - 1
    slots = max(len(row_used) * length, 1)
    cut = np.zeros(len(starts), bool)
    cut[first[row_start != starts[first]]] = True  # a row starting inside a document
    return {
        "rows": int(len(row_used)),
        "documents": int(len(starts)),
        "efficiency": float(row_used.sum() / slots),
        "target_fraction": float((row_used.sum() - ends_inside.sum()) / slots),
        "pieces_per_row": float(np.mean(last - first + 1)) if len(row_used) else 0.0,
        "cut_documents": float(cut.mean()) if len(starts) else 0.0,
    }
