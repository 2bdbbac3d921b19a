"""Context parallelism (models/attention.py): ring and all-gather attention over `mesh.context`
equal one device's attention, train like one device, and cut per-device memory by ~c."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import config as config_lib
from jaxdist import mesh as mesh_lib
from jaxdist import sharding
from jaxdist.errors import ConfigError
from models import attention
from tests.helpers import compile_step, env_without_cluster, python, train_steps
from tests.test_llama import llama_config


def _qkv(B=2, T=32, N=4, K=2, H=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
    ct = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)  # cotangent for the gradients
    return q, k, v, ct


def _context_mesh(c: int):
    sizes = {a: 1 for a in config_lib.MESH_AXES} | {f"dcn_{a}": 1 for a in config_lib.MESH_AXES}
    sizes.update(data=8 // c, context=c)
    return mesh_lib.make_mesh(sizes)


def _sharded_attention(mesh, mode: str):
    """Attention on natural-order [B, T, ...] arrays, stored in the mode's order over `context`."""
    c = int(mesh.shape["context"])

    def f(q, k, v):
        T = q.shape[1]
        order = attention.sequence_order(T, c, mode)
        pos = np.arange(T) if order is None else order
        with sharding.activation_rules(mesh):
            perm = (lambda x: x) if order is None else (lambda x: x[:, order])
            o = attention.context_attention(perm(q), perm(k), perm(v), pos, mode)
            return o if order is None else o[:, np.argsort(order)]

    return f


def _reference(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
@pytest.mark.parametrize("c, per", [(2, 1), (4, 1), (4, 2), (8, 1)])
def test_attention_equals_one_device(mode, c, per):
    """Forward and gradients (w.r.t. q, k, v) within 1e-5 of one device's causal attention at
    T = 8·c·k."""
    mesh = _context_mesh(c)
    q, k, v, ct = _qkv(B=8 // c, T=8 * c * per)
    spec = NamedSharding(mesh, P("data", "context"))
    args = [jax.device_put(a, spec) for a in (q, k, v)]
    fn = _sharded_attention(mesh, mode)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * ct)
    out = jax.jit(fn)(*args)
    np.testing.assert_allclose(out, _reference(q, k, v), rtol=0, atol=1e-5)
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(*args)
    ref_grads = jax.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5)


def test_zigzag_order_balances_causal_work():
    """Every device holds the same number of (query, key) pairs a causal mask keeps."""
    T, c = 64, 4
    order = attention.sequence_order(T, c, "ring").reshape(c, -1)
    assert sorted(order.reshape(-1).tolist()) == list(range(T))
    work = [int(np.sum(row[:, None] >= np.arange(T)[None, :])) for row in order]
    assert len(set(work)) == 1, work
    contiguous = [
        int(np.sum(row[:, None] >= np.arange(T)[None, :])) for row in np.arange(T).reshape(c, -1)
    ]
    assert len(set(contiguous)) == c  # the imbalance zig-zag removes


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_context4_data2_trains_like_one_device(mode):
    """Four SGD steps on context=4 × data=2: losses within 1e-5 of one device."""
    base = llama_config()
    base.model.context_attention = mode
    ref, _ = train_steps(base, 4)
    c = llama_config(data=2, context=4)
    c.model.context_attention = mode
    losses, _ = train_steps(c, 4)
    np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "mode, mesh",
    [
        ("ring", dict(context=2, fsdp=2, tensor=2)),
        ("all_gather", dict(context=2, data=2, tensor=2)),
    ],
)
def test_context_composes_with_fsdp_and_tensor(mode, mesh):
    """Context with FSDP-stored weights and heads split over tensor: losses within 1e-5."""
    base = llama_config()
    ref, _ = train_steps(base, 4)
    c = llama_config(**mesh)
    c.model.context_attention = mode
    losses, _ = train_steps(c, 4)
    np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-5)


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("c", [2, 4])
def test_ring_hlo_has_c_minus_1_kv_permutes_per_layer(c):
    """The compiled loss (layers unrolled, so each layer's ops appear once) holds (c − 1)·L
    collective-permutes forward; all_gather holds none."""
    cfg = llama_config(data=8 // c, context=c)
    cfg.model.scan_unroll = cfg.model.num_layers
    L = cfg.model.num_layers
    for mode, want in (("ring", (c - 1) * L), ("all_gather", 0)):
        cfg.model.context_attention = mode
        text = _forward_hlo(cfg)
        assert _count(r"= \S+ collective-permute(-start)?\(", text) == want, mode


def _forward_hlo(cfg) -> str:
    from tests.helpers import engine_for

    eng, batches = engine_for(cfg)
    shapes = batches.global_shapes()
    batch = eng.abstract_batch(shapes, {"inputs": np.int32, "targets": np.int32})
    return eng.eval_step.lower(eng.abstract_state, batch).compile().as_text()


def temp_bytes(context: int, mode: str, T: int = 4096) -> int:
    """Compiled temp bytes per device of the train step, one sequence per data replica (so the
    per-device batch is equal: one sequence, split over `context` devices)."""
    cfg = llama_config(data=8 // context, context=context)
    cfg.model.context_attention = mode
    cfg.model.seq_len = T
    cfg.model.num_layers = 1
    cfg.train.batch_size = 8 // context
    cfg.data.max_bytes = 200_000
    _, compiled = compile_step(cfg)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_context4_temp_memory_at_most_035x(mode):
    """Compiled temp memory of the train step at T=4096: context=4 ≤ 0.35 × context=1."""
    one, four = temp_bytes(1, mode), temp_bytes(4, mode)
    assert four <= 0.35 * one, (four, one, four / one)


@pytest.mark.parametrize(
    "mode, seq_len, want",
    [
        ("ring", 36, "model.seq_len=36 must be divisible by 8 (2·mesh.context zig-zag chunks"),
        ("all_gather", 34, "model.seq_len=34 must be divisible by 4 (mesh.context"),
    ],
)
def test_bad_length_is_one_line(mode, seq_len, want):
    c = llama_config(data=2, context=4)
    c.model.context_attention = mode
    c.model.seq_len = seq_len
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c, 8)
    assert str(e.value).startswith(want) and "\n" not in str(e.value)


def train_llama(workdir, steps: int, *flags: str):
    """scripts/train.py on configs/llama_tiny.py with test_reshard's tiny settings and `flags`."""
    import subprocess

    from tests.test_reshard import ROOT, TINY

    env = env_without_cluster()
    env["JAX_PLATFORMS"] = "cpu"
    args = ["--config=configs/llama_tiny.py", f"--workdir={workdir}", *TINY, *flags]
    proc = subprocess.run(
        [python(), "scripts/train.py", *args, f"--config.train.steps={steps}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_checkpoint_restores_across_context_sizes(tmp_path):
    """Steps 1–4 on context=4 × data=2 (ring), then 5–6 on context=2 × data=4: the losses equal
    an uninterrupted context=4 run within 1e-5."""
    from tests.test_reshard import losses, mesh_flags

    train = train_llama
    flags = ("--config.model.num_kv_heads=2",)
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(ref, 6, *flags, *mesh_flags(8, data=2), "--config.mesh.context=4")
    train(run, 4, *flags, *mesh_flags(8, data=2), "--config.mesh.context=4")
    proc = train(run, 6, *flags, *mesh_flags(8, data=4), "--config.mesh.context=2")
    assert "at step 4" in proc.stdout
    want, got = losses(ref), losses(run)
    np.testing.assert_allclose([got[5], got[6]], [want[5], want[6]], rtol=0, atol=1e-5)
