"""The loop's hooks on their cadence and orbax's save decision, run in-process on a tiny GPT."""

from __future__ import annotations

import json

import pytest

from jaxdist import checkpoint, loop
from jaxdist.errors import NonFiniteError
from tests.helpers import tiny_gpt_config


def test_hook_due_on_its_cadence_and_at_the_end():
    hook = loop.Hook(every=4, fn=lambda *a: None, at_end=True)
    assert [s for s in range(1, 11) if hook.due(s, last_step=10)] == [4, 8, 10]
    never = loop.Hook(every=0, fn=lambda *a: None)
    assert not any(never.due(s, last_step=10) for s in range(1, 11))


def test_log_eval_and_checkpoint_hooks_run_on_their_own_cadences(tmp_path):
    c = tiny_gpt_config(data=8)
    c.train.steps, c.train.log_every, c.train.eval_every = 6, 4, 3
    c.train.eval_batches = 1
    c.checkpoint.every = 4
    last = loop.run(c, str(tmp_path))
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen = [(r.get("kind", "step"), r.get("step"), "eval_loss" in r) for r in records]
    assert seen == [
        ("layout", None, False),
        ("eval", 3, True),  # an eval step that does not log: its own record
        ("step", 4, False),
        ("step", 6, True),  # the last step logs, and its evaluation joins the line
        ("eval", 6, True),  # the final evaluation
        ("goodput", None, False),  # where the wall time went (jaxdist/goodput.py), last
    ]
    assert "predicted_bytes_per_device" not in records[0]  # no planner hook was passed
    # orbax's FixedIntervalPolicy saved step 4; the end of training saves step 6.
    assert checkpoint.committed_steps(tmp_path / "checkpoints") == [4, 6]
    assert last["eval_loss"] == records[-2]["eval_loss"]


def test_layout_extras_and_checks_are_the_callers(tmp_path):
    c = tiny_gpt_config(data=8)
    c.train.steps = 1
    seen = []

    def refuse(config, num_devices):
        seen.append(num_devices)

    loop.run(c, str(tmp_path), checks=[refuse], layout_extras=[lambda cfg, eng: {"extra": 7}])
    layout = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert seen == [8] and layout["extra"] == 7


def test_a_non_finite_loss_raises_its_own_error(tmp_path):
    c = tiny_gpt_config(data=8)
    c.train.steps, c.train.warmup_steps, c.train.learning_rate = 6, 1, 1e30
    c.train.on_nonfinite = "stop"
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient at step \d+"):
        loop.run(c, str(tmp_path))
