"""Llama-3.1-8B's shape (~8.03B parameters: 32 layers, d_model 4096, 32 heads sharing 8 key/value
heads of 128, SwiGLU width 14336, 128256 vocabulary, untied head, rope_theta 500000 with Llama 3's
long-context frequencies: factor 8, low/high frequency factors 1/4, original context 8192),
sequence 8192, bfloat16.

    python scripts/train.py --config=configs/llama3_8b.py --workdir=runs/llama3_8b

For 8 or more H100/H200s (docs/CLUSTER.md walks through one node, SLURM and Kubernetes). The
planner's recommended layout for one node of 8 H100s (`python scripts/plan.py
--config=configs/llama3_8b.py --devices=8 --hardware=h100_nvlink_ib`) is FSDP over all 8
(`mesh.fsdp=8`): float32 parameters (32 GB), gradients (32 GB) and Adam's moments (64 GB) do not
fit one 80 GB device; sharded 8 ways they are 16 GB per device, and FSDP's all-gathers and
reduce-scatters stay inside NVLink. Predicted (not measured): 59.0 GiB per device, 0.752 s per
step of 8 × 8192 tokens, 10,890 tokens/s per GPU in bf16 (torchtitan reports 6,667 measured), and
with `--config.train.matmul_precision=fp8` 0.599 s, 13,680 tokens/s per GPU in FP8 (torchtitan
reports 8,532 and Megatron-Bridge 14,451 measured in FP8). The planner's FP8 term (FP8 GEMMs at
twice the bf16 rate, the casts' bytes) is fitted to one H100's gpt_1b, llama_1b and 8B-proxy rows
(docs/PERFORMANCE.md, "FP8 GEMMs on an H100"), where FP8 ran 1.14-1.17x bf16.
This config sets that layout with `mesh.fsdp=-1` (every device), so it also runs on
several nodes, where docs/CLUSTER.md says when to add `mesh.dcn_data`. Activations are
rematerialised except the matmul outputs without batch dimensions; the layers are scanned. To
fine-tune the published weights, import them first (`python scripts/hf.py import HF_DIR --out DIR`)
and add `--config.train.init_from=DIR`.
"""

from jaxdist import recipes
from jaxdist.schema import base_config, locked


def get_config():
    c = base_config()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.model.name = "llama"
    c.model.num_layers = 32
    c.model.d_model = 4096
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 14336
    c.model.vocab_size = 128256
    c.model.seq_len = 8192
    c.model.rope_theta = 500000.0
    c.model.rope_scaling.type = "llama3"
    c.model.rope_scaling.factor = 8.0
    c.model.rope_scaling.low_freq_factor = 1.0
    c.model.rope_scaling.high_freq_factor = 4.0
    c.model.rope_scaling.original_max_len = 8192
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.eos_token_id = 128001
    recipes.accelerator_run(c, batch_size=8, log_every=10, checkpoint_every=500)
    return locked(c)
