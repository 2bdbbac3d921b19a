"""PyTorch DDP's side of the network study (scripts/ddp_gpt.py) on 2 emulated hosts at 50 Mbit/s."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.test_netem import _can_make_namespaces, _launch, clean  # noqa: F401 (a fixture)

needs_torch_and_namespaces = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or _can_make_namespaces() is not None,
    reason=f"needs torch (the hf extra) and network namespaces: {_can_make_namespaces() or 'ok'}",
)

# The network study's GPT (scripts/network_study.py MODEL), 2 steps.
MODEL = (
    "--config.model.num_layers=2",
    "--config.model.d_model=128",
    "--config.model.num_heads=4",
    "--config.model.seq_len=64",
    "--config.model.vocab_size=256",
    "--config.train.batch_size=16",
    "--config.train.learning_rate=3e-3",
    "--config.train.warmup_steps=5",
    "--config.train.eval_batches=1",
    "--config.data.max_bytes=200000",
    "--config.train.steps=2",
)


def _jaxdist_gpt_params() -> int:
    """jaxdist's own GPT at the study's shape, counted from its parameter shapes."""
    import jax
    from flax import nnx

    from jaxdist.config import base_config
    from models.gpt import GPT

    cfg = base_config().model
    cfg.num_layers, cfg.d_model, cfg.num_heads = 2, 128, 4
    cfg.seq_len, cfg.vocab_size = 64, 256
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


@needs_torch_and_namespaces
def test_ddp_two_hosts_at_50mbit_sends_the_ring_bytes(tmp_path, clean):  # noqa: F811
    """2 DDP steps over 2 hosts at 50 Mbit/s: jaxdist's parameter count, and each step's link
    bytes per host within 10% of gloo's ring all-reduce of the float32 gradient,
    2(N-1)/N·4·params (frames add ~7%: headers and the ACKs of what the host receives)."""
    run = _launch(
        "--network=rate=50mbit",
        "--num_processes=2",
        "--devices_per_process=1",
        "--platform=cpu",
        "--",
        sys.executable,
        "scripts/ddp_gpt.py",
        f"--workdir={tmp_path}",
        *MODEL,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    layout = recs[0]
    params = _jaxdist_gpt_params()
    assert layout["params_total"] == params == 459392
    expected = 2 * (2 - 1) / 2 * 4 * params
    assert layout["cross_process_bytes_per_step"] == [expected, expected]
    steps = [r for r in recs if "loss" in r and r.get("kind") is None]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    net = [r for r in recs if r.get("kind") == "net"]
    assert [r["step"] for r in net] == [1, 2]
    for r in net:
        for host in ("host0", "host1"):
            sent = r["hosts"][host]["tx_bytes_per_step"]
            assert abs(sent - expected) <= 0.1 * expected, (r, expected)


def _study():
    sys.path.insert(0, "scripts")
    import network_study

    return network_study


def test_ddp_rows_launch_one_process_per_device_with_the_same_model_flags():
    ns = _study()
    cmd = ns._command("w", "ddp_powersgd", "rate=50mbit", 10, 3, devices=2)
    assert cmd[cmd.index("--") + 2].endswith("ddp_gpt.py")
    assert "--num_processes=4" in cmd and "--processes_per_host=2" in cmd
    assert [a for a in cmd if a in ns.MODEL] == list(ns.MODEL)
    assert cmd[-2:] == ["--ddp_hook=powersgd", "--powersgd_rank=4"]
    assert ns.framework("ddp_fp16") == "ddp" and ns.framework("bf16") == "jaxdist"
    jax_cmd = ns._command("w", "xla", None, 10, 3, devices=1)
    assert "--config.mesh.data=2" in jax_cmd and "--devices_per_process=1" in jax_cmd


def test_side_by_side_pairs_each_jaxdist_method_with_ddps_same_bytes():
    ns = _study()

    def row(method, step, base):
        return {
            "framework": ns.framework(method), "method": method, "link": "rate=50mbit",
            "step_time_s": step, "step_time_p10_s": step, "step_time_p90_s": step,
            "compute_only_step_time_s": base, "exposed_comm_s": step - base,
            "kernel_bytes_per_step": [100.0, 300.0], "load_avg": [3.0, 4.0],
            "compute_only_load_avg": [2.0, 9.0],
        }  # fmt: skip

    runs = [row("xla", 0.9, 0.4), row("ddp", 0.6, 0.3), row("powersgd", 0.5, 0.45)]
    lines = ns.side_by_side({"runs": runs}).splitlines()
    assert len(lines) == 3  # head, rule, xla | ddp (powersgd has no DDP row here)
    assert lines[2] == (
        "| rate=50mbit | xla | 0.900 (0.900-0.900) | 0.400 | 0.500 | 200 | ddp | 0.600 "
        "(0.600-0.600) | 0.300 | 0.300 | 200 | 2-9; 2-9 |"
    )


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (the hf extra)")
def test_the_torch_gpt_computes_jaxdists_loss_from_jaxdists_parameters():
    """scripts/ddp_gpt.py's model is jaxdist's GPT: loaded with jaxdist's parameters, it gives
    jaxdist's loss on the same batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx

    from jaxdist.config import base_config
    from models.gpt import GPT

    sys.path.insert(0, "scripts")
    import ddp_gpt

    cfg = base_config()
    m = cfg.model
    m.num_layers, m.d_model, m.num_heads, m.seq_len, m.vocab_size = 2, 128, 4, 64, 256
    jx = GPT(m, rngs=nnx.Rngs(3))
    # weights 3x their initial scale: logits far from uniform, so the loss depends on every piece
    state = nnx.state(jx, nnx.Param)
    nnx.update(jx, jax.tree.map(lambda x: x * 3.0, state))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 65)).astype(np.int32)
    want, _ = jx.loss(
        {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    )
    pt = ddp_gpt._model(cfg)
    assert sum(p.numel() for p in pt.parameters()) == ddp_gpt.gpt_param_count(cfg)
    ddp_gpt.load_jaxdist_params(pt, nnx.to_pure_dict(nnx.state(jx, nnx.Param)))
    with torch.no_grad():
        got = pt(torch.from_numpy(tokens[:, :-1]).long(), torch.from_numpy(tokens[:, 1:]).long())
    assert abs(float(want) - math.log(256)) > 0.5  # not the uniform guess
    # matched: 5e-7 apart (float32); the exact GELU instead of tanh's moves it by 1.2e-5
    assert abs(float(got) - float(want)) < 3e-6, (float(got), float(want))


def test_ddp_init_jaxdist_starts_from_a_jaxdist_runs_parameters():
    """`ddp_gpt.py --init=jaxdist`: the parameters a jaxdist run of the same config initialises
    (its engine's `init`, on the 8 devices), bit for bit, and the torch model holds them."""
    import jax
    import numpy as np

    sys.path.insert(0, "scripts")
    import ddp_gpt

    from tests.helpers import engine_for

    args, cfg = ddp_gpt._parse(["--workdir=unused", "--init=jaxdist", *_study().MODEL])
    assert args.init == "jaxdist"
    want = jax.device_get(engine_for(cfg)[0].init()["params"])
    got = ddp_gpt.jaxdist_initial_params(cfg)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    pt = ddp_gpt._model(cfg)
    ddp_gpt.load_jaxdist_params(pt, got)
    np.testing.assert_array_equal(pt.blocks[1].w_up.detach().numpy(), got["blocks"]["w_up"][1])
    np.testing.assert_array_equal(
        pt.blocks[0].wqkv.detach().numpy(), got["blocks"]["wqkv"][0].reshape(128, 384)
    )
