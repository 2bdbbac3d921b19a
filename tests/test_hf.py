"""Hugging Face interop checked by `transformers` itself: a tiny random `LlamaForCausalLM` (torch,
CPU, float32) imported with `scripts/hf.py import` gives jaxdist the same logits; exported back with
`scripts/hf.py export`, transformers loads it without warnings and gives jaxdist's logits."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import jax
import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

from jaxdist import weights  # noqa: E402
from models import api  # noqa: E402
from tests.helpers import python  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 96


def hf_tiny(tmp_path, name: str, *, tie: bool, kv_heads: int = 2, rope=None, seed: int = 0):
    """A random LlamaForCausalLM saved as safetensors in tmp_path/name: 2 layers, d 32, 4 heads
    sharing `kv_heads` key/value heads, SwiGLU 64, vocabulary 96."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # logits of a few units, not hundredths: differences show
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **({"rope_parameters": rope} if rope else {}),
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    path = tmp_path / name
    model.save_pretrained(path)
    return model, path


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def jaxdist_logits(path, tokens: np.ndarray) -> np.ndarray:
    """Logits of the jaxdist model whose weights `weights.resolve(path)` finds, on one device."""
    import models

    src = weights.resolve(str(path))
    model = api.abstract_model(models.get(src.config.model.name).make(src.config.model, None))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), model.params
    )
    params = weights.load_params(src, abstract)
    return np.asarray(jax.jit(lambda p, t: model.merge(p)(t))(params, tokens))


def run_script(*args, check=True):
    proc = subprocess.run(
        [python(), os.path.join(REPO, "scripts", "hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(3, 24)).astype(np.int32)


@pytest.mark.parametrize(
    "tie, kv_heads, rope",
    [
        (False, 2, None),
        (True, 1, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}),
    ],
)  # fmt: skip
def test_import_logits_equal_transformers(tmp_path, tie, kv_heads, rope):
    """`hf.py import`, then jaxdist's logits on random tokens: max |Δ| <= 1e-4 against
    transformers' (grouped-query 4:2 untied; 4:1 tied with Llama 3's rope scaling)."""
    model, hf_dir = hf_tiny(tmp_path, "hf", tie=tie, kv_heads=kv_heads, rope=rope)
    run_script("import", hf_dir, "--out", tmp_path / "run")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["name"] == "llama"
    ref = hf_logits(model, TOKENS)
    ours = jaxdist_logits(tmp_path / "run", TOKENS)
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    assert np.abs(ref).max() > 1  # logits of a few units, so 1e-4 is a tight bound
    # The HF folder itself is a valid PATH too (converted on the fly).
    assert np.abs(jaxdist_logits(hf_dir, TOKENS) - ref).max() <= 1e-4


def test_export_loads_in_transformers_with_jaxdist_logits(tmp_path, caplog):
    """import → export (sharded: 3 safetensors files and an index) → from_pretrained: no missing
    or unexpected keys, no warnings, logits within 1e-4 of jaxdist's."""
    _, hf_dir = hf_tiny(tmp_path, "hf", tie=False, seed=1)
    run_script("import", hf_dir, "--out", tmp_path / "run")
    run_script("export", tmp_path / "run", "--out", tmp_path / "out", "--max_shard_bytes", 40_000)
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and "model-00003-of-00003.safetensors" in files
    ours = jaxdist_logits(tmp_path / "run", TOKENS)
    with caplog.at_level(logging.WARNING):
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "out", output_loading_info=True
        )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    theirs = hf_logits(loaded.float().eval(), TOKENS)
    assert np.abs(theirs - ours).max() <= 1e-4, np.abs(theirs - ours).max()


def _break(hf_dir, how: str) -> str:
    """Damages a saved HF folder; returns what the error line must name."""
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if how == "malformed":
        cfg_path.write_text(cfg_path.read_text()[:-20])
        return "config.json: not valid JSON"
    if how == "architecture":
        cfg["architectures"] = ["GPT2LMHeadModel"]
        cfg_path.write_text(json.dumps(cfg))
        return (
            "architectures=['GPT2LMHeadModel'] is not supported; jaxdist imports LlamaForCausalLM"
        )
    if how == "no_weights":
        os.remove(hf_dir / "model.safetensors")
        return "no model.safetensors"
    if how == "shape":
        cfg["intermediate_size"] = 48
        cfg_path.write_text(json.dumps(cfg))
        return "model.layers.0.mlp.gate_proj.weight has shape [64, 32], but config.json implies [48, 32]"
    if how == "field":
        cfg["hidden_size"] = "32"
        cfg_path.write_text(json.dumps(cfg))
        return "hidden_size='32' must be an integer"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["malformed", "architecture", "no_weights", "shape", "field"])
def test_bad_hf_folder_is_one_line_exit_2_nothing_written(tmp_path, capsys, how):
    import importlib.util

    _, hf_dir = hf_tiny(tmp_path, "hf", tie=False)
    expected = _break(hf_dir, how)
    spec = importlib.util.spec_from_file_location("hf_script", os.path.join(REPO, "scripts/hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()  # transformers' progress bar while saving
    assert script.main(["import", str(hf_dir), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no run folder, no temporary left behind


def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    proc = run_script("export", tmp_path / "nothing", "--out", tmp_path / "out", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: {tmp_path / 'nothing'}: no such file or directory"
    assert not (tmp_path / "out").exists()


def test_init_from_trains_sharded_then_exports_to_transformers(tmp_path):
    """import → `train.py --config.train.init_from=RUN` for 2 steps on data=2 × fsdp=2 × tensor=2
    (its first loss is the imported weights' own, so it started from them) → export → transformers
    loads the trained weights with jaxdist's logits within 1e-4."""
    from ml_collections import ConfigDict

    from jaxdist import data

    _, hf_dir = hf_tiny(tmp_path, "hf", tie=False, seed=2)
    run_script("import", hf_dir, "--out", tmp_path / "run")
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=20_000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    work = tmp_path / "ft"
    cmd = [
        python(),
        "scripts/train.py",
        "--config=configs/llama_tiny.py",
        f"--workdir={work}",
    ]
    cmd += [
        f"--config.train.init_from={tmp_path / 'run'}",
        f"--config.data.source={tmp_path / 'train.bin'}",
    ]
    cmd += ["--config.train.steps=2", "--config.train.log_every=1", "--config.checkpoint.every=2"]
    cmd += [
        "--config.model.seq_len=32",
        "--config.train.batch_size=8",
        "--config.train.eval_batches=1",
    ]
    cmd += ["--config.train.warmup_steps=0", "--config.train.learning_rate=0.01"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stdout
    records = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    first = next(r for r in records if r.get("step") == 1 and "loss" in r)
    # The loss of step 1 is that of the imported weights on batch 0.
    ds = data.load(ConfigDict({"source": str(tmp_path / "train.bin"), "val_fraction": 0.1,
                               "max_bytes": 0}), seq_len=32, vocab_size=VOCAB)  # fmt: skip
    batch = data.Batches(ds, batch_size=8, seq_len=32, seed=0, shardings={}).get_host(0)
    logits = jaxdist_logits(tmp_path / "run", batch["inputs"]).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref_loss = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
    np.testing.assert_allclose(first["loss"], ref_loss, rtol=1e-5)
    run_script("export", work, "--out", tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ours = jaxdist_logits(work, TOKENS)
    assert np.abs(hf_logits(loaded, TOKENS) - ours).max() <= 1e-4
    assert np.abs(ours - jaxdist_logits(tmp_path / "run", TOKENS)).max() > 1e-3  # it trained


def test_eval_loss_equals_transformers(tmp_path):
    """`eval.py` on an HF folder and a token file: its loss is transformers' mean cross-entropy
    on the same validation windows, within 1e-5 relative."""
    from ml_collections import ConfigDict

    from jaxdist import data

    model, hf_dir = hf_tiny(tmp_path, "hf", tie=True, seed=4)
    np.random.default_rng(2).integers(0, VOCAB, 4000).astype(np.uint16).tofile(tmp_path / "t.bin")
    out = tmp_path / "eval.json"
    cmd = [
        python(),
        "scripts/eval.py",
        f"--checkpoint={hf_dir}",
        f"--data={tmp_path / 't.bin'}",
    ]
    cmd += ["--batches=2", "--batch_size=4", "--seq_len=32", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{hf_dir} (Hugging Face folder) on " in proc.stdout, proc.stdout  # not "(step None)"
    result = json.loads(out.read_text())
    src = ConfigDict({"source": str(tmp_path / "t.bin"), "val_fraction": 0.1, "max_bytes": 0})
    batches = data.Batches(data.load(src, seq_len=32, vocab_size=VOCAB), batch_size=4, seq_len=32,
                           seed=0, shardings={})  # fmt: skip
    losses = []
    for i in range(2):
        b = batches.get_host(i, "val")
        logits = torch.from_numpy(hf_logits(model, b["inputs"]))
        target = torch.from_numpy(b["targets"].astype(np.int64))
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()))
    np.testing.assert_allclose(result["loss"], float(np.mean(losses)), rtol=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]))
