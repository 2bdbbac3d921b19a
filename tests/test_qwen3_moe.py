"""The Qwen3-MoE family checked by `transformers` itself: one tiny random `Qwen3MoeForCausalLM`
(torch, CPU, float32; 4 heads of 16 on d_model 32, q/k norms, 8 experts of width 24, top-2,
renormalised) imported gives jaxdist's logits, greedy continuations and HF's pooled load-balancing
loss (and its gradient); trained 2 steps on fsdp × tensor × expert and exported, transformers
loads it with jaxdist's logits; pipelined like one device; Qwen3-30B-A3B's shape planned. The
checks are tests/test_mixtral.py's."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs the hf extra: pip install -e '.[hf]' (transformers, torch)"
)
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

import models  # noqa: E402
from jaxdist import config as config_lib  # noqa: E402
from jaxdist import plan, weights  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from models import api  # noqa: E402
from tests.test_hf import VOCAB  # noqa: E402
from tests.test_mixtral import (  # noqa: E402
    E,
    K,
    check_aux_loss,
    check_import_and_greedy,
    check_masked_aux_loss,
    check_pipeline,
    check_train_export,
)

# Qwen3-30B-A3B's parameter count (Qwen/Qwen3-30B-A3B: "30.5B in total"): 2 × 151936 × 2048
# (embedding, head) + 48 × (attention 18,874,368 + q/k norms 256 + router 262,144 + 128 experts
# × 4,718,592 + 2 norms × 2048) + 2048 (final norm).
QWEN3_30B_A3B_PARAMS = 30_532_122_624


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(model, folder, jaxdist run imported from it): a random Qwen3MoeForCausalLM, 2 layers,
    d 32, 4 heads of 16 (N·H ≠ D) sharing 2 key/value heads, 8 SwiGLU experts of 24, top-2
    renormalised, vocabulary 96, `output_router_logits` with coefficient 0.001; every norm (the
    q and k ones too) away from 1."""
    tmp = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp / "hf")
    weights.import_hf(str(tmp / "hf"), str(tmp / "run"))  # what `scripts/hf.py import` runs
    return model, tmp / "hf", tmp / "run"


def test_import_logits_greedy_and_router_loss_equal_transformers(hf_model, tmp_path):
    """Imported logits within 1e-4, greedy = `generate` via `sample.py --prompt_ids`, and the
    pooled load-balancing loss and its gradient equal HF's (`check_import_and_greedy`,
    `check_aux_loss`); the folder's one tensor per expert is what jaxdist's map names."""
    from safetensors import safe_open

    from jaxdist import hf

    model, hf_dir, run = hf_model
    m = weights.resolve(str(run)).config.model
    assert (m.name, m.num_experts, m.experts_per_token, m.mlp_dim) == ("qwen3_moe", E, K, 24)
    with safe_open(str(hf_dir / "model.safetensors"), "np") as f:
        assert set(hf.hf_names(m)) == set(f.keys())
    check_import_and_greedy(model, run, tmp_path, "qwen3_moe")
    check_aux_loss(model, run, "qwen3_moe")


def test_router_aux_loss_skips_padding_as_transformers(hf_model):
    """`check_masked_aux_loss` on the imported Qwen3-MoE."""
    model, _, run = hf_model
    check_masked_aux_loss(model, run, "qwen3_moe")


def test_init_from_trains_sharded_then_exports_to_transformers(hf_model, tmp_path):
    """configs/qwen3_moe_tiny.py from the import, 2 steps on fsdp=2 × tensor=2 × expert=2 →
    export → transformers loads it as Qwen3MoeForCausalLM with no missing or unexpected keys and
    jaxdist's logits within 1e-4 (`check_train_export`)."""
    _, _, run = hf_model
    config = "configs/qwen3_moe_tiny.py"
    check_train_export(run, tmp_path, config, "Qwen3MoeForCausalLM", "qwen3_moe")


def test_pipeline_1f1b_matches_single_device():
    """`check_pipeline` on configs/qwen3_moe_tiny.py (q and k norms in the stages)."""
    import configs.qwen3_moe_tiny

    check_pipeline(configs.qwen3_moe_tiny)


def test_qwen3_30b_a3b_is_validated_and_planned():
    """configs/qwen3_30b_a3b.py: Qwen3-30B-A3B's parameter count, valid on 8 devices, planned
    through the family's `plan_cost` for 64 H100s (a layout that fits)."""
    import configs.qwen3_30b_a3b

    c = configs.qwen3_30b_a3b.get_config()
    config_lib.validate(c, 8)
    family = models.get("qwen3_moe")
    model = api.abstract_model(family.make(c.model, None))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(model.params))
    assert n == QWEN3_30B_A3B_PARAMS
    assert family.plan_cost(c.model, model.params).label == "Qwen3-MoE (8 of 128 experts)"
    best = plan.plan(c, 64, "h100_nvlink_ib", remats=["dots_no_batch"]).recommended
    assert best is not None and best.fits, best
    print(f"qwen3_30b_a3b on 64 H100s: {best.layout}, {best.memory['total'] / 2**30:.1f} GiB")


def test_bad_qwen3_moe_config_is_one_line(hf_model, tmp_path):
    """Unnormalised top-k weights and dense layers among the sparse ones: one line each."""

    _, hf_dir, _ = hf_model
    cfg = json.loads((hf_dir / "config.json").read_text())
    for field, value, want in (
        ("norm_topk_prob", False, "norm_topk_prob=False is not supported"),
        ("mlp_only_layers", [1], r"mlp_only_layers=\[1\]: every layer must be sparse"),
    ):
        folder = tmp_path / field
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
        with pytest.raises(ConfigError, match=want) as e:
            weights.resolve(str(folder))
        assert "\n" not in str(e.value)
