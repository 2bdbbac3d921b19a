"""The periodic log line and the closing lines, as a user reads them (no training here)."""

from __future__ import annotations

from jaxdist import loop


def test_step_line_has_loss_throughput_mfu_step_time_and_eta():
    m = {
        "loss": 4.54912,
        "learning_rate": 2.25e-3,
        "step_time_s": 0.4123,
        "tokens_per_s": 1240.0,
        "mfu": 0.412,
    }
    line = loop.step_line(20, 300, m, eta_s=115.2)
    assert line == (
        "step     20/300 │ loss 4.5491 │ lr 2.25e-03 │ 412.3 ms/step │ 1.24k tok/s │ "
        "MFU 41.2% │ ETA 1m55s"
    )
    # No MFU where the peak is unknown (CPU), no ETA on the last step, examples for classifiers.
    last = loop.step_line(
        300,
        300,
        {"loss": 0.5, "step_time_s": 0.01, "examples_per_s": 3.2e6, "eval_accuracy": 0.9132},
        eta_s=0.0,
    )
    assert last == "step    300/300 │ loss 0.5000 │ 10.0 ms/step │ 3.2M ex/s │ eval accuracy 0.9132"


def test_durations_read_at_a_glance():
    assert [loop._fmt_duration(s) for s in (0.4, 42, 185, 3725, -3)] == [
        "0s",
        "42s",
        "3m05s",
        "1h02m",
        "0s",
    ]


def test_outputs_lines_name_every_output_and_how_to_read_it():
    lines = loop.outputs_lines("/runs/a", "/runs/a/checkpoints", [100, 200, 300, 400])
    text = "\n".join(lines)
    assert lines[0] == "outputs │ /runs/a"
    assert "checkpoints  /runs/a/checkpoints (steps 200, 300, 400)" in text
    assert "/runs/a/metrics.jsonl" in text and "tensorboard --logdir /runs/a" in text
    assert "python scripts/plot.py /runs/a" in text
    assert "python scripts/ckpt.py verify /runs/a/checkpoints" in text
    none = "\n".join(loop.outputs_lines("/runs/b", "/runs/b/checkpoints", []))
    assert "(none saved)" in none and "ckpt.py verify" not in none
