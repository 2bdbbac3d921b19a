"""Where a run starts: its newest checkpoint (the fast tier's or the persistent one's), the weights
of `train.init_from`, or a fresh state; and what a resume must keep of the saved run's config.

`jaxdist/loop.py` calls `restore_or_init` once, after building the Engine and before compiling;
every line it prints says which source was used and why.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from jaxdist import checkpoint, optim, weights
from jaxdist.checkpoint.fast import FastTier

# What a resume must keep, and why. Everything else may change: the learning rate and the other
# optimizer hyperparameters, train.steps (the schedule is recomputed, and said), the mesh.
RESUME_MUST_MATCH = {
    "model": "the saved weights have its shapes",
    "train.optimizer": "the saved optimizer state is that optimizer's",
    "train.batch_size": "the saved data position counts batches of that size",
    "train.seed": "the saved data position is in that seed's order",
    "data": "the saved data position indexes that data",
}


def schedule_change_note(saved_train: dict[str, Any], train_cfg, step: int) -> str | None:
    """One line saying the LR schedule is recomputed when a resume changes `train.steps`."""
    if saved_train.get("steps", train_cfg.steps) == train_cfg.steps:
        return None
    from ml_collections import ConfigDict

    before = ConfigDict({**train_cfg.to_dict(), **saved_train})
    lr_then = float(optim.schedule(before)(step))
    lr_now = float(optim.schedule(train_cfg)(step))
    return (
        f"train.steps changed from {before.steps} to {train_cfg.steps}: the learning-rate "
        f"schedule is recomputed for {train_cfg.steps} steps (at step {step}: "
        f"{lr_now:.3g}, was {lr_then:.3g})"
    )


def restore_fast(engine, fast: FastTier, latest: int | None, main: bool, clock, cfg_json):
    """(state, start) from the fast tier when it holds a newer step than `latest`, else None.

    Every process calls it (the tiers' steps are agreed on); prints which tier is used.
    """
    step, listing, note = fast.newest_complete(engine.abstract_state)
    persistent = "none" if latest is None else f"step {latest}"
    if step is None or (latest is not None and step <= latest):
        if main and note is not None and (latest is None or note[0] > latest):
            print(
                f"checkpoint tier: {note[1]}; falling back to the persistent tier ({persistent})",
                flush=True,
            )
        elif main:
            newest = "none" if step is None else f"step {step}"
            print(
                f"checkpoint tier: persistent ({persistent}; fast tier newest complete: {newest})",
                flush=True,
            )
        return None
    if main and note is not None:
        print(f"checkpoint tier: {note[1]}; using fast tier step {step} instead", flush=True)
    with clock.charge("restart") if clock is not None else contextlib.nullcontext():
        got = fast.restore(step, listing, engine.abstract_state)
    if got is None:
        if main:
            print(
                f"checkpoint tier: fast tier step {step} unreadable; falling back to the "
                f"persistent tier ({persistent})",
                flush=True,
            )
        return None
    state, manifest, from_peer = got
    checkpoint.check_config_compatible(
        manifest.get("config"), cfg_json, fields=tuple(RESUME_MUST_MATCH), why=RESUME_MUST_MATCH
    )
    if main:
        how = (
            "; process(es) "
            + ", ".join(f"{s} from process {q}'s copy" for s, q in from_peer.items())
            if from_peer
            else ""
        )
        saved_by = int(manifest["process_count"])
        if saved_by != len(listing):
            how += f"; saved by {saved_by} processes, reassembled onto {len(listing)}"
        print(
            f"checkpoint tier: fast (step {step} from process-local copies in {fast.root}{how})",
            flush=True,
        )
    return engine.to_storage(state), int(manifest["step"]), int(manifest["data_position"])


def restore_or_init(
    engine, ckpt, config, cfg_json, init_from, main: bool, clock=None, fast=None, order=None
):
    """(state, start step): the newest checkpoint's, `train.init_from`'s weights, or fresh.

    The newest checkpoint is the fast tier's when it holds a newer step than the persistent one.
    (None, start) when the checkpoint already reached `train.steps`. The read of a checkpoint is
    charged to `clock`'s `restart`. `order` (the loop's data order) gets the restored offset of
    the batches a rollback skipped.
    """
    t = config.train
    latest = ckpt.latest_step()
    if fast is not None:
        got = restore_fast(engine, fast, latest, main, clock, cfg_json)
        if got is not None:
            state, start, position = got
            if order is not None:
                order.offset = position - start  # batches a rollback skipped
            if start >= t.steps:
                if main:
                    print(f"already finished: step {start} of {t.steps} (train.steps)", flush=True)
                return None, start
            if main:
                print(f"resumed from the fast tier at step {start}", flush=True)
            return state, start
    if latest is None:
        if init_from is None:
            return engine.init(), 0
        if main:
            print(f"loading weights from {init_from.path} ...", flush=True)
        params = weights.load_params(init_from, engine.abstract_state["params"])
        if main:
            # The run keeps the tokenizer its weights know (sample.py, eval.py, hf.py export).
            carried = weights.carry_tokenizer(init_from, os.path.dirname(str(ckpt.directory)))
            note = f"; its tokenizer copied: {', '.join(carried)}" if carried else ""
            print(f"initialised from {init_from.path} ({init_from.kind}){note}", flush=True)
        return engine.init(params=params), 0  # its weights, a fresh optimizer, step 0
    saved = ckpt.saved_config()
    checkpoint.check_config_compatible(
        saved, cfg_json, fields=tuple(RESUME_MUST_MATCH), why=RESUME_MUST_MATCH
    )
    if main and latest < t.steps:  # a finished run says only that, below
        print(f"restoring step {latest} from {ckpt.directory} ...", flush=True)
    with clock.charge("restart") if clock is not None else contextlib.nullcontext():
        state, meta = ckpt.restore(engine.abstract_state)
    state = engine.to_storage(state)  # checkpoints hold the stacked layers in [L] order
    start = int(meta.get("step", meta["data_position"]))
    if order is not None:
        order.offset = int(meta["data_position"]) - start  # batches a rollback skipped
    if start >= t.steps:
        # Read back (a damaged newest step falls back and trains on), but nothing left to
        # train: no evaluation record is appended and the checkpoints stay as they are.
        if main:
            print(
                f"already finished: step {start} of {t.steps} (train.steps) in "
                f"{ckpt.directory}; raise train.steps to train on, or use a new --workdir",
                flush=True,
            )
        return None, start
    if main:
        print(f"resumed from {ckpt.directory} at step {int(state['step'])}", flush=True)
        note = schedule_change_note((saved or {}).get("train", {}), t, start)
        if note:
            print(note, flush=True)
    return state, start
