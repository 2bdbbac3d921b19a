"""The Qwen3 family checked by `transformers` itself: a tiny random `Qwen3ForCausalLM` (torch, CPU,
float32; head dim 16 on d_model 32 with 4 heads, so N·H ≠ D) imported with `scripts/hf.py import`
gives jaxdist's logits and greedy continuations; trained 2 sharded steps from it and exported,
transformers loads it with jaxdist's logits; pipelined like one device; Qwen3-0.6B's shape planned."""

from __future__ import annotations

import json
import subprocess

import jax
import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

from jaxdist import config as config_lib  # noqa: E402
from jaxdist import plan, weights  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from tests.helpers import python, train_steps  # noqa: E402
from tests.test_hf import REPO, TOKENS, VOCAB, hf_logits, jaxdist_logits, run_script  # noqa: E402
from tests.test_sample import hf_greedy  # noqa: E402

PROMPTS = [[5, 17, 3], [40, 20, 9, 9, 11, 60, 7], [88], [10, 30, 31, 32, 50]]
# Qwen3-0.6B's parameter count (Qwen/Qwen3-0.6B: 0.6B in all, 0.44B without the embedding):
# 151936 × 1024 (tied embedding) + 28 × 15,730,944 (a block) + 1024 (final norm).
QWEN3_0_6B_PARAMS = 596_049_920


def hf_qwen3(tmp_path, name: str, *, tie: bool, seed: int = 0):
    """A random Qwen3ForCausalLM saved as safetensors in tmp_path/name: 2 layers, d 32, 4 heads of
    16 sharing 2 key/value heads, SwiGLU 64, vocabulary 96; every norm (the q and k ones too)
    away from 1, so a swapped or missing norm weight shows."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    path = tmp_path / name
    model.save_pretrained(path)
    return model, path


def test_import_logits_and_greedy_generation_equal_transformers(tmp_path):
    """`hf.py import` → jaxdist's logits within 1e-4 of transformers' (fp32); `sample.py
    --prompt_ids` on data=2 × tensor=2 continues each prompt as `generate(do_sample=False)` does,
    token for token."""
    model, hf_dir = hf_qwen3(tmp_path, "hf", tie=True, seed=3)
    proc = run_script("import", hf_dir, "--out", tmp_path / "run")
    assert f"→ {tmp_path / 'run'}: qwen3, 2 layers" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["name"] == "qwen3"
    ref = hf_logits(model, TOKENS)
    ours = jaxdist_logits(tmp_path / "run", TOKENS)
    print(f"qwen3 imported logits max |Δ| = {np.abs(ours - ref).max():.3g}")
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    assert np.abs(ref).max() > 1  # logits of a few units, so 1e-4 is a tight bound

    expected = [hf_greedy(model, ids) for ids in PROMPTS]
    assert all(len(set(e)) > 1 for e in expected)  # not one repeated token
    out = tmp_path / "out.jsonl"
    cmd = [python(), "scripts/sample.py", f"--checkpoint={tmp_path / 'run'}"]
    cmd += [f"--prompt_ids={json.dumps(ids)}" for ids in PROMPTS]
    cmd += ["--max_new_tokens=32", "--temperature=0", f"--out={out}", "--data=2", "--tensor=2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in records] == expected


def test_init_from_trains_sharded_then_exports_to_transformers(tmp_path, capsys):
    """import → `train.py --config=configs/qwen3_tiny.py --config.train.init_from=RUN`, 2 steps on
    data=2 × fsdp=2 × tensor=2 → export → transformers loads it with no missing or unexpected
    keys, and its logits are jaxdist's within 1e-4."""
    _, hf_dir = hf_qwen3(tmp_path, "hf", tie=False, seed=2)
    weights.import_hf(str(hf_dir), str(tmp_path / "run"))
    np.random.default_rng(1).integers(0, VOCAB, 20_000).astype(np.uint16).tofile(tmp_path / "t.bin")
    work = tmp_path / "ft"
    cmd = [
        python(),
        "scripts/train.py",
        "--config=configs/qwen3_tiny.py",
        f"--workdir={work}",
    ]
    cmd += [f"--config.train.init_from={tmp_path / 'run'}"]
    cmd += [f"--config.data.source={tmp_path / 't.bin'}", "--config.model.seq_len=32"]
    cmd += ["--config.train.steps=2", "--config.checkpoint.every=2", "--config.train.batch_size=8"]
    cmd += ["--config.train.eval_batches=1", "--config.train.warmup_steps=0"]
    cmd += ["--config.train.learning_rate=0.01"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stdout
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    run_script("export", work, "--out", tmp_path / "out")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = jaxdist_logits(work, TOKENS)
    delta = np.abs(hf_logits(loaded.float().eval(), TOKENS) - ours).max()
    print(f"qwen3 trained, exported, reloaded logits max |Δ| = {delta:.3g}")
    assert delta <= 1e-4, delta
    assert np.abs(ours - jaxdist_logits(tmp_path / "run", TOKENS)).max() > 1e-3  # it trained


def _tiny(**mesh_sizes):
    """configs/qwen3_tiny.py on a subset of the 8 devices, SGD (as tests/test_llama.py, why)."""
    import configs.qwen3_tiny

    c = configs.qwen3_tiny.get_config()
    c.unlock()
    for axis in config_lib.MESH_AXES:
        c.mesh[axis] = mesh_sizes.get(axis, 1)
    c.model.seq_len, c.train.batch_size, c.train.warmup_steps = 32, 8, 0
    c.train.optimizer, c.train.learning_rate = "sgd", 0.5
    c.data.max_bytes = 400_000
    return c


def test_pipeline_1f1b_matches_single_device():
    """1F1B over 2 stages × data=2, 4 microbatches, tied embeddings: 3 float32 steps' losses
    (rtol 1e-5) and parameters (q and k norms included, atol 1e-5) equal one device's."""
    ref_losses, ref_params = train_steps(_tiny(), 3)
    c = _tiny(pipeline=2, data=2)
    c.pipeline.schedule, c.pipeline.microbatches = "1f1b", 4
    losses, params = train_steps(c, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    assert "q_norm" in params["layers"] and "k_norm" in params["layers"]
    flat = jax.tree_util.tree_leaves_with_path(params)
    for (path, a), b in zip(flat, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_qwen3_0_6b_is_validated_and_planned():
    """configs/qwen3_0_6b.py: Qwen3-0.6B's parameter count, valid on 8 devices, and planned for
    8 H100s (a layout that fits)."""
    import configs.qwen3_0_6b
    import models
    from models import api

    c = configs.qwen3_0_6b.get_config()
    config_lib.validate(c, 8)
    model = api.abstract_model(models.get("qwen3").make(c.model, None))
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(model.params)) == QWEN3_0_6B_PARAMS
    best = plan.plan(c, 8, "h100_nvlink_ib", remats=["dots_no_batch"]).recommended
    assert best is not None and best.fits, best


def test_bad_qwen3_config_is_one_line(tmp_path):
    """A sliding-window Qwen3 and a dense family given experts: one ConfigError line each."""
    _, hf_dir = hf_qwen3(tmp_path, "hf", tie=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(cfg | {"use_sliding_window": True}))
    with pytest.raises(ConfigError, match="use_sliding_window=true") as e:
        weights.resolve(str(hf_dir))
    assert "\n" not in str(e.value)
    c = _tiny()
    c.model.num_experts = 4
    with pytest.raises(ConfigError, match="model.num_experts=4: model.name='qwen3' is the dense"):
        config_lib.validate(c, 1)
