"""The periodic log line and the closing lines, as a user reads them (no training here)."""

from __future__ import annotations

import re

from jaxdist import loop
from tests.helpers import suite_xla_flags

# `metrics.human_duration`: 42s, 3m05s or 1h02m (a loaded machine takes minutes).
DURATION = r"(?:\d+s|\d+m\d\ds|\d+h\d\dm)"


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


def test_done_line_has_wall_time_and_mean_throughput_but_no_per_expert_loads():
    evals = {"eval_loss": 1.9226, **{f"eval_moe_load_{e}": 0.125 for e in range(8)}}
    record = {"total": 185.0, "productive": 120.0}
    line = loop.done_line(300, 1.66891, evals, record, (300 * 2048, "tok"))
    assert line == "done: step 300, train loss 1.6689, eval loss 1.9226 │ 3m05s, mean 5.12k tok/s"
    # The loads stay in metrics.jsonl (the eval record); the closing line has no room for them.
    assert "moe_load" not in line


def test_goodput_line_names_the_fraction_and_the_other_causes():
    from jaxdist import goodput

    rec = {c: 0.0 for c in goodput.CAUSES}
    rec.update(productive=90.0, compile=20.0, eval=8.0, idle=2.0, total=120.0, goodput=0.75)
    assert goodput.summary_line(rec) == (
        "goodput │ 75.0% of 2m00s productive; compile 20s, eval 8s, idle 2s"
    )
    # A cause the run charged is named however short (a 4-step run's checkpoint: ~0.05 s, the
    # README's example line names it); one under 5 ms is not.
    rec.update(checkpoint=0.042, data=0.004)
    assert goodput.summary_line(rec) == (
        "goodput │ 75.0% of 2m00s productive; compile 20s, checkpoint 0.04s, eval 8s, idle 2s"
    )


def _train_in_a_terminal(workdir, *flags):
    """scripts/train.py on a pseudo-terminal of 150 columns (the console's tqdm bar): exit, text.

    Started by `subprocess` (fork and exec in C), not `pty.fork`: a fork that runs Python in the
    child of a process whose JAX runs threads may deadlock, and Python warns about it."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = ["--config.model.num_layers=1", "--config.model.d_model=32", "--config.model.seq_len=32"]
    cmd = [sys.executable, os.path.join(root, "scripts/train.py"), f"--workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": suite_xla_flags()}
    fd, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    proc = subprocess.Popen(
        [*cmd, *tiny, *flags],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
        start_new_session=True,
    )
    os.close(terminal)  # the child holds it now: reads see the end once the child exits
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(fd)
    return proc.wait(), out.decode(errors="replace")


def test_a_run_says_what_it_does_before_the_first_step_and_draws_the_bar_once(tmp_path):
    flags = ["--config.train.log_every=2", "--config.checkpoint.every=3"]
    flags += ["--config.train.eval_every=3", "--config.train.eval_batches=1"]
    rc, text = _train_in_a_terminal(tmp_path, "--config.train.steps=6", *flags)
    assert rc == 0, text[-3000:]
    lines = text.replace("\r\n", "\n").split("\n")
    assert lines[0].startswith("loading data.source=stdlib and building the gpt on 8 device(s)")
    assert lines[1] == "compiling the train step ...", lines[:4]
    assert re.fullmatch(r"compiled in \d+\.\ds", lines[2]), lines[:4]
    # tqdm redraws with a carriage return: each drawing of the finished bar is one "6/6".
    assert text.count("6/6 [") == 1, text[-3000:]
    assert re.search(
        rf"\ndone: step 6, train loss \d\.\d{{4}}, eval loss \d\.\d{{4}} │ {DURATION}, mean ", text
    )
    assert re.search(rf"\ngoodput │ \d+\.\d% of {DURATION} productive; compile ", text), text[
        -2000:
    ]
    # A resume says which step it reads before reading it.
    rc, text = _train_in_a_terminal(tmp_path, "--config.train.steps=8", *flags)
    assert rc == 0, text[-3000:]
    lines = text.replace("\r\n", "\n").split("\n")
    assert lines[1] == f"restoring step 6 from {tmp_path}/checkpoints ...", lines[:4]
    assert lines[2] == f"resumed from {tmp_path}/checkpoints at step 6", lines[:4]
    assert text.count("8/8 [") == 1, text[-3000:]


def test_the_plot_command_shown_works_on_the_base_install(tmp_path):
    """Without matplotlib (not in the base install) the outputs say what to install, and
    scripts/plot.py says it in one line instead of a ModuleNotFoundError traceback."""
    import json
    import os
    import subprocess
    import sys

    lines = loop.outputs_lines("/runs/a", "/runs/a/checkpoints", [2], plot_ready=False)
    assert (
        "        │ plot         python scripts/plot.py /runs/a "
        "(needs matplotlib: pip install -e '.[plot]')"
    ) in lines
    ready = loop.outputs_lines("/runs/a", "/runs/a/checkpoints", [2], plot_ready=True)
    assert "        │ plot         python scripts/plot.py /runs/a" in ready
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hide = (  # an interpreter where `import matplotlib` fails, as on `pip install -e .`
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = ['scripts/plot.py', {str(tmp_path)!r}]; "
        "runpy.run_path('scripts/plot.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: plotting needs matplotlib, which is not installed: pip install -e '.[plot]'"
    )
    assert not (tmp_path / "curves.png").exists()


def test_ckpt_inspect_columns_stay_aligned_with_5d_arrays():
    import importlib.util
    import os
    from types import SimpleNamespace

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("ckpt_script", f"{root}/scripts/ckpt.py")
    ckpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ckpt)
    infos = [
        SimpleNamespace(path="step", shape=(), dtype="int32", nbytes=4, sharding="replicated"),
        SimpleNamespace(
            path="opt_state/0/mu/blocks/moe/w_in",
            shape=(32, 8, 4096, 2, 14336),
            dtype="bfloat16",
            nbytes=60129542144,
            sharding="P(None, 'expert', 'fsdp') on mesh(expert=8, fsdp=8)",
        ),
    ]
    lines = ckpt.array_table(infos)
    # Each column starts at the same offset on every line.
    for column in ("shape", "dtype", "sharding"):
        at = lines[0].index(column)
        assert all(line[at - 2 : at] == "  " and line[at] != " " for line in lines), lines
    assert lines[0].index("bytes") + len("bytes") == lines[2].index(" P(None") - 1, lines
