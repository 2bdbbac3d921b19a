"""Loss spikes (`train.on_spike`): an injected batch of noise is detected, its update skipped, the
run goes on to the clean run's final loss (within 1%); spikes in a row stop at `train.max_skipped`.

In-process runs of the tiny GPT (40 steps, one compile shared through the compilation cache). The
fault hook `JAXDIST_FAULT_NOISE_AT` (jaxdist/loop.py) makes the named batches (0-based) noise, so
step 32 trains on batch 31 of noise. `rollback` returns to the fast tier's step 30 and skips it.
"""

from __future__ import annotations

import json

import pytest

from jaxdist import loop
from jaxdist.errors import ConfigError, NonFiniteError
from tests.helpers import tiny_gpt_config


def _config(**train):
    c = tiny_gpt_config(data=2, fsdp=2, tensor=2)
    c.train.steps, c.train.log_every, c.train.eval_batches = 40, 1, 1
    c.train.on_spike, c.train.spike_warmup, c.train.spike_k, c.train.spike_decay = (
        "skip",
        20,
        4,
        0.9,
    )
    for k, v in train.items():
        c.train[k] = v
    return c


def _records(workdir, kind=None) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("clean")
    return workdir, loop.run(_config(), str(workdir))


def test_an_injected_spike_is_skipped_and_the_run_ends_at_the_clean_loss(
    clean, tmp_path, monkeypatch, capsys
):
    clean_dir, clean_last = clean
    assert _records(clean_dir, "spike") == []  # no false alarm on the clean run's losses
    monkeypatch.setenv("JAXDIST_FAULT_NOISE_AT", "31")
    last = loop.run(_config(), str(tmp_path))
    out = capsys.readouterr().out
    (spike,) = _records(tmp_path, "spike")
    assert spike["step"] == 32 and spike["action"] == "skip"
    assert spike["loss"] > spike["threshold"] > 0, spike
    lines = [x for x in out.splitlines() if "loss spike" in x]
    assert len(lines) == 1 and lines[0].startswith("step 32: loss spike "), lines
    assert "update skipped (1 in a row; stopping at train.max_skipped=10)" in lines[0]
    steps = _records(tmp_path)
    assert steps[-1]["step"] == 40 and steps[-1]["skipped"] == 1
    assert last["loss"] == pytest.approx(clean_last["loss"], rel=0.01)
    assert last["eval_loss"] == pytest.approx(clean_last["eval_loss"], rel=0.01)


def test_rollback_returns_to_the_fast_tier_and_skips_the_batch(
    clean, tmp_path, monkeypatch, capsys
):
    _, clean_last = clean
    monkeypatch.setenv("JAXDIST_FAULT_NOISE_AT", "31")
    c = _config(on_spike="rollback")
    c.checkpoint.local_every, c.checkpoint.local_dir = 5, str(tmp_path / "local")
    last = loop.run(c, str(tmp_path / "w"))
    out = capsys.readouterr().out
    (spike,) = _records(tmp_path / "w", "spike")
    assert spike["step"] == 32 and spike["action"] == "rollback", spike
    (back,) = _records(tmp_path / "w", "rollback")
    assert (back["step"], back["to_step"], back["skipped_batch"]) == (32, 30, 31), back
    assert "step 32: rolled back to fast-tier step 30; data batch 31 skipped" in out, out
    steps = _records(tmp_path / "w")
    assert steps[-1]["step"] == 40 and steps[-1]["skipped"] == 0  # no update was dropped
    assert max(r["loss"] for r in steps if r["step"] > 32) < spike["threshold"]
    # Each step from 32 on trains on the batch after the clean run's (one was skipped), so the
    # last training losses are of other batches: the held-out loss is the like-for-like figure.
    assert last["eval_loss"] == pytest.approx(clean_last["eval_loss"], rel=0.01)
    (rec,) = _records(tmp_path / "w", "goodput")
    assert rec["recomputed"] > 0, rec  # step 31 trained twice


def test_spikes_in_a_row_stop_at_max_skipped(clean, tmp_path, monkeypatch):
    del clean  # after it: the compile is cached
    monkeypatch.setenv("JAXDIST_FAULT_NOISE_AT", "29,30,31")
    with pytest.raises(NonFiniteError, match=r"2 loss spikes in a row \(30 to 31\).*max_skipped=2"):
        loop.run(_config(max_skipped=2), str(tmp_path))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("on_spike", "ignore", "train.on_spike='ignore' is not valid; choose one of none, skip"),
        ("spike_k", 0.0, "train.spike_k must be > 0"),
        ("on_spike", "rollback", "train.on_spike=rollback returns to the newest fast-tier step"),
    ],
)
def test_bad_spike_settings_are_refused_in_one_line(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loop.run(_config(**{field: value}), str(tmp_path))
