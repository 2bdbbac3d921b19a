"""Packed documents (`data.packing=documents`): a packed row's logits and gradients for each
document equal that document run alone (1 device; ring and all-gather context parallelism), the
loss skips targets across a boundary, the loader's rows are a pure function of the step, and a
short training run works end to end."""

from __future__ import annotations

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict

import models
from jaxdist import config as config_lib
from jaxdist import data, loop, pipeline, sharding
from jaxdist import mesh as mesh_lib
from jaxdist.errors import ConfigError
from models import api, moe
from tests.helpers import engine_for
from tests.test_llama import llama_config

T = 16
# Two packed rows of T slots: documents of 5, 7 and 4 tokens; then 3 (the tail of a cut
# document), 9 and 4 slots of padding.
ROWS = [[5, 7, 4], [3, 9]]
DOC_LENGTHS = [n for row in ROWS for n in row]


def _packed(vocab: int, seed: int = 0):
    """(packed batch, the documents' tokens one per row at its start, padded to T)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, vocab, size=n) for n in DOC_LENGTHS]
    inputs, seg, pos, tgt = (np.zeros((len(ROWS), T), np.int32) for _ in range(4))
    tgt[:] = data.NO_TARGET
    alone = np.zeros((len(docs), T), np.int32)
    alone_tgt = np.full((len(docs), T), data.NO_TARGET, np.int32)
    d = 0
    for r, row in enumerate(ROWS):
        at = 0
        for s, n in enumerate(row, 1):
            inputs[r, at : at + n] = docs[d]
            seg[r, at : at + n] = s
            pos[r, at : at + n] = np.arange(n)
            tgt[r, at : at + n - 1] = docs[d][1:]
            alone[d, :n] = docs[d]
            alone_tgt[d, : n - 1] = docs[d][1:]
            at, d = at + n, d + 1
    batch = {"inputs": inputs, "targets": tgt, "segment_ids": seg, "positions": pos}
    return batch, alone, alone_tgt


def _doc_slices():
    """(row, slice in the row) of each document, in DOC_LENGTHS order."""
    out = []
    for r, row in enumerate(ROWS):
        at = 0
        for n in row:
            out.append((r, slice(at, at + n)))
            at += n
    return out


# The MoE families' capacity factors: Mixtral dropless (grouped matmuls; a padded buffer of
# C = n under expert parallelism), Qwen3-MoE 4 of 8 experts' worth, C = ceil(4·n·2/8) = n slots per
# expert: the capacity path, which cannot drop either (a token's k experts are distinct).
MOE = {"mixtral": 0.0, "qwen3_moe": 4.0}


def _model_config(name: str, mode: str = "ring"):
    c = llama_config()
    c.model.name = name
    c.model.seq_len = T
    c.model.vocab_size = 64
    c.model.d_model, c.model.num_heads, c.model.num_kv_heads = 32, 4, 2
    c.model.mlp_dim = 64
    c.model.context_attention = mode
    if name == "gpt":
        c.model.num_kv_heads = 0
    if name in ("qwen3", "qwen3_moe"):
        c.model.head_dim = 16
    if name in MOE:
        c.model.num_experts, c.model.experts_per_token, c.model.mlp_dim = 8, 2, 32
        c.model.moe_capacity_factor = MOE[name]
    return c


@functools.cache
def _model(name: str, mode: str = "ring"):
    """(config.model, abstract model, params) of a tiny `name`."""
    m = _model_config(name, mode).model
    make = models.get(name).make(m, None)
    params = nnx.to_pure_dict(nnx.state(make(nnx.Rngs(0)), nnx.Param))
    return m, api.abstract_model(make), params


def _sum_xent(logits, targets):
    """Summed cross-entropy over the targets >= 0 (float32)."""
    return api.masked_token_cross_entropy(logits, targets) * jnp.sum(targets >= 0)


def _mesh(context: int, expert: int = 1):
    sizes = {a: 1 for a in config_lib.MESH_AXES} | {f"dcn_{a}": 1 for a in config_lib.MESH_AXES}
    sizes["context"], sizes["expert"] = context, expert
    return mesh_lib.make_mesh(sizes, devices=jax.devices()[: context * expert])


@functools.cache
def _reference(name: str):
    """Each document run alone on one device: (logits [docs, T, V], grads of the summed loss)."""
    _, am, params = _model(name)
    _, alone, alone_tgt = _packed(64)

    def loss(p):
        logits = am.merge(p)(jnp.asarray(alone))
        return _sum_xent(logits, jnp.asarray(alone_tgt)), logits

    with sharding.activation_rules(_mesh(1)):
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), jax.device_get(grads)


def _packed_run(name: str, context: int, mode: str = "ring", expert: int = 1):
    """The packed rows on `context` × `expert` devices: (logits [rows, T, V], grads of the
    summed loss)."""
    _, am, params = _model(name, mode)
    batch, _, _ = _packed(64)
    mesh = _mesh(context, expert)
    segs = (jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"]))

    def loss(p):
        with sharding.activation_rules(mesh):
            logits = am.merge(p)(jnp.asarray(batch["inputs"]), segments=segs)
        return _sum_xent(logits, jnp.asarray(batch["targets"])), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), jax.device_get(grads)


def _max_deltas(
    name: str, context: int, mode: str = "ring", expert: int = 1
) -> tuple[float, float]:
    """max |Δ| of the documents' logits and of the gradients, packed vs alone."""
    ref_logits, ref_grads = _reference(name)
    logits, grads = _packed_run(name, context, mode, expert)
    d_logits = max(
        float(np.max(np.abs(logits[r, s] - ref_logits[d, : s.stop - s.start])))
        for d, (r, s) in enumerate(_doc_slices())
    )
    d_grads = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    return d_logits, d_grads


@pytest.mark.parametrize(
    "name, context, mode",
    [
        ("llama", 1, "ring"),
        ("llama", 2, "ring"),
        ("llama", 4, "ring"),
        ("llama", 2, "all_gather"),
        ("gpt", 1, "ring"),
        ("qwen3", 1, "ring"),
        ("mixtral", 1, "ring"),
        ("qwen3_moe", 1, "ring"),
    ],
)
def test_packed_documents_equal_each_document_alone(name, context, mode):
    """Logits of each document in a packed row, and the gradients of the summed loss, within
    1e-5 (fp32) of the documents run alone: attention never crosses a document boundary, RoPE
    restarts per document, the loss skips the boundary targets."""
    d_logits, d_grads = _max_deltas(name, context, mode)
    print(f"{name} context={context} {mode}: max|Δlogits|={d_logits:.2e} max|Δgrad|={d_grads:.2e}")
    assert d_logits <= 1e-5
    assert d_grads <= 1e-5


@pytest.mark.parametrize("name", list(MOE))
def test_packed_moe_over_experts_equals_each_document_alone(name):
    """mesh.expert=2 (each device 4 of the 8 experts and one packed row; the experts' all_to_all
    carries the padded buffer with the padding mask): the documents' logits and the gradients
    within 1e-5 of each document run alone on one device."""
    d_logits, d_grads = _max_deltas(name, 1, "ring", expert=2)
    print(f"{name} expert=2: max|Δlogits|={d_logits:.2e} max|Δgrad|={d_grads:.2e}")
    assert d_logits <= 1e-5
    assert d_grads <= 1e-5


@functools.cache
def _jit_loss(name: str):
    _, am, _ = _model(name)
    return jax.jit(lambda p, b: am.merge(p).loss(b))


def _router_stats(name: str, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """The router statistics (`moe_*` metrics of the family's loss) of a batch, one device."""
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    with sharding.activation_rules(_mesh(1)):
        _, metrics = _jit_loss(name)(_model(name)[2], jb)
    return {k: float(v) for k, v in metrics.items() if k.startswith("moe_")}


def _stats_delta(a: dict[str, float], b: dict[str, float]) -> float:
    assert set(a) == set(b) and "moe_lb_loss" in a and "moe_load_7" in a
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_router_statistics_skip_padding(name):
    """The load-balancing loss, z-loss, expert loads and dropped fraction of a packed batch are
    those of its documents' tokens only: equal (1e-6) to the same documents one per row with
    their padding marked (segment 0), unchanged when the padding's tokens change, and different
    (> 1e-3) from the one-per-row batch whose padding is counted (no segments): the check can
    fail. Nothing is dropped."""
    batch, alone, alone_tgt = _packed(64)
    real = np.arange(T)[None, :] < np.array(DOC_LENGTHS)[:, None]
    marked = {
        "inputs": alone,
        "targets": alone_tgt,
        "segment_ids": real.astype(np.int32),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), alone.shape).copy(),
    }
    packed = _router_stats(name, batch)
    d_alone = _stats_delta(packed, _router_stats(name, marked))
    repadded = dict(batch, inputs=np.where(batch["segment_ids"] > 0, batch["inputs"], 37))
    d_pad = _stats_delta(packed, _router_stats(name, repadded))
    counted = _router_stats(name, {"inputs": alone, "targets": alone_tgt})
    d_counted = _stats_delta(packed, counted)
    print(
        f"{name}: moe_lb_loss={packed['moe_lb_loss']:.6f} |Δ| vs documents alone {d_alone:.1e}, "
        f"padding changed {d_pad:.1e}, padding counted {d_counted:.1e}"
    )
    assert d_alone <= 1e-6 and d_pad <= 1e-6
    assert d_counted > 1e-3
    assert packed["moe_dropped"] == 0


def test_padding_takes_no_expert_capacity():
    """With a finite capacity (C = 4 slots per expert for 8 tokens × top-2 of 4 experts) and
    4 padding tokens ahead of 4 real ones, all 8 to experts 0 and 1: the real tokens keep every
    slot (none dropped, outputs equal dropless ones); counted, the padding takes them all."""
    D, F, E = 8, 16, 4
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (1, 8, D))
    wg, wu = (jax.random.normal(k, (E, D, F)) for k in keys[1:3])
    wd = jax.random.normal(keys[3], (E, F, D))
    idx = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (1, 8, 2))
    w = jnp.full((1, 8, 2), 0.5)
    valid = jnp.arange(8)[None, :] >= 4
    dropless, _ = moe.experts(x, w, idx, wg, wu, wd, factor=0.0)
    masked, dropped = moe.experts(x, w, idx, wg, wu, wd, factor=1.0, valid=valid)
    counted, dropped_counted = moe.experts(x, w, idx, wg, wu, wd, factor=1.0)
    assert int(dropped) == 0 and int(dropped_counted) == 8  # the 4 real tokens' 8 assignments
    # The capacity path (dense einsums over slots) and the dropless one (ragged_dot) sum the same
    # float32 products in different orders: they agree to a few ulps of the outputs' scale (3 ulps,
    # 1.1e-5 at |46.4|, on one machine's XLA:CPU; within 1e-5 on another's).
    scale = np.spacing(np.float32(np.abs(np.asarray(dropless[:, 4:])).max()))
    np.testing.assert_allclose(masked[:, 4:], dropless[:, 4:], rtol=0, atol=4 * scale)
    assert np.all(np.asarray(counted[:, 4:]) == 0)


def test_windows_mode_leaks_across_documents():
    """The check can fail: without segments the second document of a row sees the first."""
    _, am, params = _model("llama")
    batch, _, _ = _packed(64)
    ref_logits, _ = _reference("llama")
    with sharding.activation_rules(_mesh(1)):
        logits = np.asarray(am.merge(params)(jnp.asarray(batch["inputs"])))
    r, s = _doc_slices()[1]
    assert np.max(np.abs(logits[r, s] - ref_logits[1, : s.stop - s.start])) > 1e-3


def test_rows_keep_documents_and_mask_boundaries():
    """Greedy packing: whole documents, a padded row when the next fits a fresh one, a long one
    cut with its tail a new segment; targets across a boundary and on padding are -1."""
    starts = np.array([0, 3, 5, 15, 17], np.int64)  # documents of 3, 2, 10, 2, 3 tokens
    start, used = data.pack_rows(20, starts, 6)
    np.testing.assert_array_equal(start, [0, 6, 12, 17])
    np.testing.assert_array_equal(used, [6, 6, 5, 3])
    rows = data.packed_rows(np.arange(100, 120), starts, start, used, 6)
    np.testing.assert_array_equal(
        rows["segment_ids"], [[1, 1, 1, 2, 2, 3], [1] * 6, [1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        rows["positions"],
        [[0, 1, 2, 0, 1, 0], list(range(6)), [0, 1, 2, 0, 1, 0], [0, 1, 2] + [0] * 3],
    )
    np.testing.assert_array_equal(
        rows["targets"],
        [
            [101, 102, -1, 104, -1, 106],  # the cut document's head predicts on into row 2
            [107, 108, 109, 110, 111, 112],
            [113, 114, -1, 116, -1, -1],
            [118, 119, -1, -1, -1, -1],
        ],
    )
    stats = data.packing_stats(20, starts, start, used, 6)
    assert stats["efficiency"] == pytest.approx(20 / 24)
    targets = int(np.sum(rows["targets"] >= 0))
    assert targets == 15 and stats["target_fraction"] == pytest.approx(targets / 24)
    assert stats["pieces_per_row"] == pytest.approx(7 / 4)  # 3, 1, 2, 1
    assert stats["cut_documents"] == pytest.approx(1 / 5)


def test_loss_skips_boundary_targets():
    """The family's loss on a packed batch is the mean over the non-boundary targets only, and
    does not depend on what a masked target holds."""
    _, am, params = _model("llama")
    batch, _, _ = _packed(64)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    with sharding.activation_rules(_mesh(1)):
        loss, _ = jax.jit(lambda p, b: am.merge(p).loss(b))(params, jb)
        logits = am.merge(params)(jb["inputs"], segments=(jb["segment_ids"], jb["positions"]))
    t = batch["targets"]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(logits), np.maximum(t, 0)[..., None], -1)[..., 0]
    want = np.sum(np.where(t >= 0, lse - picked, 0)) / np.sum(t >= 0)
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert np.sum(t >= 0) == sum(n - 1 for n in DOC_LENGTHS)


def _stdlib_batches(packing: str, seed: int = 0):
    cfg = ConfigDict(
        {"source": "stdlib", "val_fraction": 0.1, "max_bytes": 300_000, "packing": packing}
    )
    ds = data.load(cfg, seq_len=64, vocab_size=256)
    return data.Batches(ds, batch_size=8, seq_len=64, seed=seed, shardings={}, packing=packing)


def test_rows_are_a_pure_function_of_the_step():
    """Batch i is the same from a fresh loader (a resumed run), rows differ between steps, and
    each row's pieces follow the stdlib files (documents) it was cut from."""
    a, b = _stdlib_batches("documents"), _stdlib_batches("documents")
    for step in (0, 7):
        x, y = a.get_host(step), b.get_host(step)
        assert set(x) == set(data.PACKED_KEYS)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(a.get_host(0)["inputs"], a.get_host(1)["inputs"])
    rows = a.get_host(3, "val")
    seg, pos = rows["segment_ids"], rows["positions"]
    new = np.diff(seg, axis=1) != 0
    assert np.all(pos[:, 1:][new & (seg[:, 1:] > 0)] == 0)  # each piece's positions restart
    assert np.all(rows["targets"][:, :-1][new] == data.NO_TARGET)  # no target across a boundary


def test_bad_packing_is_one_line(tmp_path):
    c = llama_config(data=1)
    c.data.packing = "sequences"
    with pytest.raises(ConfigError, match=r"^data.packing='sequences' is not valid; choose one"):
        config_lib.validate(c, 1)
    c = config_lib.base_config()
    c.model.name, c.data.packing = "mlp", "documents"
    with pytest.raises(ConfigError, match=r"model.name='mlp' does not"):
        config_lib.validate(c, 1)
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")  # nanoGPT: no index
    cfg = ConfigDict({"source": str(tmp_path), "val_fraction": 0.1, "max_bytes": 0})
    cfg.packing = "windows"
    data.load(cfg, seq_len=16, vocab_size=5000)  # windows read it as before
    cfg.packing = "documents"
    with pytest.raises(ConfigError, match=r"train.docs.npy .*re-tokenize .*scripts/tokenize.py"):
        data.load(cfg, seq_len=16, vocab_size=5000)
    np.save(tmp_path / "train.docs.npy", np.array([0, 7, 3], np.int64))  # not ascending
    with pytest.raises(ConfigError, match=r"must hold ascending int64 document starts"):
        data.load(cfg, seq_len=16, vocab_size=5000)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_configs_take_packed_documents(name):
    """configs/{mixtral,qwen3_moe}_tiny.py (fsdp 2 × tensor 2 × expert 2) validate with
    data.packing=documents, and pipelined too, with their pooled load-balancing loss (refused in
    one line before the pipeline linearized it: `pipeline.gradients._linearized_aux`)."""
    spec = importlib.util.spec_from_file_location(name, f"configs/{name}_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.unlock()
    c.data.packing = "documents"
    config_lib.validate(c, 8)
    c.mesh.fsdp, c.mesh.pipeline = 1, 2
    assert c.model.moe_aux_loss_weight > 0
    config_lib.validate(c, 8)


def _mixture(tmp_path, packing: str = "documents"):
    """Two text-folder sources, each file one document of one repeated letter (source 0: a-z,
    source 1: A-Z), 3 to 13 bytes long: a row's tokens say which document each came from."""
    roots = []
    for k, first in enumerate((ord("a"), ord("A"))):
        root = tmp_path / f"source{k}"
        root.mkdir()
        for d in range(40):
            (root / f"{d:03d}.txt").write_bytes(bytes([first + d % 26]) * (3 + (d * 7 + k) % 11))
        roots.append(str(root))
    cfg = ConfigDict({"source": "stdlib", "sources": tuple(roots), "weights": (1.0, 3.0)})
    cfg.update(val_fraction=0.1, max_bytes=100_000, packing=packing)
    ds = data.load(cfg, seq_len=T, vocab_size=256)
    return data.Batches(ds, batch_size=64, seq_len=T, seed=0, shardings={}, packing=packing)


def test_mixture_packs_each_source_by_documents(tmp_path):
    """data.sources with data.packing=documents: each row holds whole documents of one source
    (the tail of a cut one a new segment), segment ids count the pieces, positions restart in
    each, and no target crosses a document boundary or lands on padding; both sources occur."""
    b = _mixture(tmp_path)
    rows = b.get_host(2)
    x, y, seg, pos = (rows[k] for k in data.PACKED_KEYS)
    sources = set()
    for r in range(len(x)):
        real = seg[r] > 0
        sources.add(bool(np.all(x[r][real] >= ord("a"))))  # one source per row (True: source 0)
        assert np.all(x[r][real] >= ord("a")) or np.all(x[r][real] <= ord("Z"))
        assert real[0] and np.all(np.diff(real.astype(int)) <= 0)  # padding only at the end
        for s in range(1, int(seg[r].max()) + 1):
            piece = seg[r] == s
            assert len(set(x[r][piece].tolist())) == 1  # one document per segment
            np.testing.assert_array_equal(pos[r][piece], np.arange(piece.sum()))
        # Every target kept predicts the same document's next token (its own letter); the last
        # slot before a boundary inside the row, and padding, have none.
        kept = y[r] != data.NO_TARGET
        np.testing.assert_array_equal(y[r][kept], x[r][kept])
        boundary = real[:-1] & (seg[r][1:] != seg[r][:-1])
        assert np.all(y[r][:-1][boundary] == data.NO_TARGET)
        assert np.all(y[r][~real] == data.NO_TARGET)
    assert sources == {True, False}
    (tmp_path / "again").mkdir()  # a fresh loader (a resumed run): the same batch
    np.testing.assert_array_equal(_mixture(tmp_path / "again").get_host(2)["inputs"], x)


def test_training_with_packed_documents(tmp_path):
    """A short run with data.packing=documents, ring attention over context=2 (data=4) and two
    accumulated microbatches: the loss is finite and falls."""
    c = llama_config(data=4, context=2)
    c.data.packing = "documents"
    c.model.seq_len = T * 2
    c.train.steps, c.train.log_every, c.train.eval_every = 6, 1, 0
    c.train.eval_batches, c.checkpoint.every, c.train.grad_accum = 1, 0, 2
    c.train.optimizer, c.train.learning_rate = "adamw", 1e-2
    loop.run(c, str(tmp_path))
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r and "step" in r]
    assert len(losses) == 6 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]


# The packed rows as a batch of 4 (row 0 three times): with 2 microbatches or 2 data replicas
# the pieces hold different target counts (26 and 23).
PIPE_ROWS = [0, 1, 0, 0]


def _engine_batch(name: str, schedule: str = "1f1b", **mesh):
    """(engine, the packed rows `PIPE_ROWS` as a batch on its mesh) of a tiny `name`, packed
    documents, `mesh` sizes (default all 1), 2 pipeline microbatches."""
    c = _model_config(name)
    for axis, size in mesh.items():
        c.mesh[axis] = size
    c.data.packing = "documents"
    c.train.batch_size = len(PIPE_ROWS)
    c.pipeline.schedule, c.pipeline.microbatches = schedule, 2
    c.model.vocab_size = 256  # the data's (byte) vocabulary, which train.build checks
    if name in MOE:  # the pipeline's router statistics are means per microbatch (26 and 23
        # real tokens here), averaged: not the batch's means (docs/MODELS.md, packed documents)
        c.model.moe_aux_loss_weight = c.model.moe_z_loss_weight = 0.0
    eng, _ = engine_for(c)
    batch, _, _ = _packed(256)
    put = lambda k, v: jax.device_put(jnp.asarray(v[PIPE_ROWS]), eng.batch_shardings[k])
    return eng, {k: put(k, v) for k, v in batch.items()}


@functools.cache
def _one_device_grads(name: str):
    """The packed batch's loss and gradients on one device, no pipeline (host params too)."""
    eng, batch = _engine_batch(name)
    params = eng.init()["params"]

    def grads(params, batch):
        with sharding.activation_rules(eng.mesh):
            return jax.value_and_grad(lambda p: eng.merge(p).loss(batch)[0])(params)

    loss, g = jax.jit(grads)(params, batch)
    return float(loss), jax.device_get(g), jax.device_get(params)


@pytest.mark.parametrize(
    "name, schedule, mesh",
    [
        ("llama", "1f1b", {}),
        ("qwen3", "1f1b", {}),
        ("gpt", "gpipe", dict(data=2)),
        ("llama", "zb", dict(context=2)),
        ("mixtral", "1f1b", dict(expert=2)),
    ],
)
def test_packed_documents_through_the_pipeline(name, schedule, mesh):
    """mesh.pipeline=2, two microbatches with different target counts: the packed batch's loss
    and gradients equal the one-device model's within 1e-5 (fp32): segment ids and positions
    reach every stage (ring context attention inside them too), and the loss is the batch's
    masked mean, not a mean of microbatch (or replica) means."""
    ref_loss, ref_grads, host_params = _one_device_grads(name)
    eng, batch = _engine_batch(name, schedule, pipeline=2, **mesh)
    shardings = eng.state_shardings["params"]
    params = eng.to_storage(jax.device_put(host_params, shardings), shardings)
    fn, _ = pipeline.make_gradients(
        eng.config, eng.mesh, eng.stages, eng.param_axes, eng.batch_axes
    )
    loss, _, grads = jax.jit(fn)(params, batch)
    grads = jax.device_get(eng.to_user(grads, shardings))
    d_grads = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    d_loss = abs(float(loss) - ref_loss)
    print(f"{name} {schedule} pipeline=2 {mesh}: |Δloss|={d_loss:.2e} max|Δgrad|={d_grads:.2e}")
    assert d_loss <= 1e-5 and d_grads <= 1e-5
