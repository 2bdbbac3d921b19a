"""Every shell command README.md and docs/*.md show, run as written from the repository root.

How commands are found (the rule a doc writer can rely on):
1. Fenced code blocks tagged `bash`, `sh`, `shell` or `console`: every line that is not blank
   and not a `#` comment is a command. In an untagged block, only lines starting with `$ `,
   `python` or `bash scripts/` are (the other untagged blocks are file trees, schedules and
   sample output). `python` blocks are library examples, not shell: CHECKPOINTS.md's plain-orbax
   block is run as written by tests/test_checkpoint.py.
2. A line ending in `\\` continues on the next; a heredoc (`<<'EOF'` ... `EOF`) belongs to the
   command that opens it. A leading `$ ` is a prompt: the lines after it, up to the next prompt or
   the end of the block, are the output the command must print, and are compared exactly.
3. Inline code spans in prose that start with `python scripts/`, `python3 scripts/` or
   `bash scripts/`, or with environment assignments (`NAME=value`) or `mpirun ...` before one
   of those.
4. `a && b` is split into its commands. Optional parts in `[...]` are left out; when a command
   has any, it also runs once with all of them in, with placeholders (`S`) filled from the fixture.
   A command with a literal `...` is a template, not something to run.

How they run: the commands of a walkthrough doc (WALKTHROUGHS: each command reads what the one
before it wrote) run in order in one copy; every other command runs in a fresh copy of the repository's source that also holds `runs/default` from
the fixture run (the state a user is in after the quickstart), with `python` on PATH being this
interpreter, on CPU. A command passes when it exits 0 (or prints exactly the output its doc shows)
and prints no traceback.

Not every command can run here as written. Those that take minutes or need a GPU run with flags
appended (absl flags: the last value wins), listed in SHORTENED with the reason; those that need a
cluster, the network or another host are only parsed (`bash -n`) and their repository files and
pip extras checked, listed in NOT_RUN with the reason. A study another test already runs as
written (flags appended, what it wrote checked there) is in NOT_RUN as `run by tests/FILE::TEST`,
and that test must pass the command's words one after another, as documented. Both lists must name documented
commands, so they cannot go stale.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import python

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SHELL_TAGS = {"bash", "sh", "shell", "console"}
UNTAGGED_COMMAND = re.compile(r"^(\$ |python|bash scripts/)")
INLINE_COMMAND = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=(?:<[^>]*>|\S+)\s+)*(?:mpirun\s.*?)?(?:python3?|bash) scripts/\S"
)
WALKTHROUGHS = ("docs/MODELS.md",)  # run in document order, in one copy
PLACEHOLDERS = {"S": "2"}  # `--step S`: a committed step of the fixture run (it saves 2 and 4)

_TINY_BENCH_MODEL = (
    "--config.model.num_layers=1 --config.model.d_model=64 --config.model.num_heads=2 "
    "--config.model.seq_len=32 --steps=2 --warmup=1 --repeats=1"
)
# configs/llama3_8b.py shrunk to compile in a minute on a CPU (docs/CLUSTER.md's rehearsal sizes)
_TINY_LLAMA = (
    "--config.model.num_layers=2 --config.model.d_model=64 --config.model.num_heads=4 "
    "--config.model.num_kv_heads=2 --config.model.head_dim=16 --config.model.mlp_dim=128 "
    "--config.model.vocab_size=512 --config.model.seq_len=64"
)
_BATCH_STUDY = (
    "--batch_sizes=16,32 --lr_grid=1 --max_steps=2 --target_loss=100 --eval_every_examples=32 "
    "--val_examples=8 --config.model.num_layers=1 --config.model.d_model=32 "
    "--config.data.max_bytes=200000",
    "each optimizer's study is tens of training runs of up to 500 steps (an hour on 2 loaded "
    "cores); one batch pair for 2 steps runs the same code",
)
_TINY_MOMENTS = "--max_steps=4 --config.model.num_layers=1 --config.model.d_model=32"
# command as documented -> (flags appended, why it cannot run as written here)
SHORTENED = {
    "python scripts/train.py": (
        "--config.train.steps=4 --config.train.log_every=2 --config.checkpoint.every=2",
        "the default job's 300 steps take minutes on 2 cores; this run is also the fixture "
        "`runs/default` the other commands read",
    ),
    "python scripts/launch.py --num_processes=2 --devices_per_process=4 -- "
    "python scripts/train.py --workdir=runs/mp": (
        "--config.train.steps=2",
        "the default job's 300 steps, in 2 processes",
    ),
    "python scripts/bench_gpu.py --phase=point --config=configs/gpt_1b.py "
    "--config.model.attention=cudnn --config.train.batch_size=16 "
    "--config.train.remat=dots_no_batch --hand --profile=2": (
        "--config.model.attention=xla --config.model.num_layers=1 --config.model.d_model=64 "
        "--config.model.num_heads=2 --config.model.seq_len=32 --config.model.scan_unroll=1 "
        "--config.model.vocab_size=256 --steps=2 --warmup=1 --out_dir=runs/gpu_point",
        "an H100 measurement (cuDNN is refused on a CPU): the same flags run a tiny model with "
        "XLA attention (gpt_1b's 50,257-token head alone took 9 of its 12 CPU s here)",
    ),
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16 --lr_grid=0.25,1,4 --target_loss=2.35 "
    "--max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --optimizers=adamw "
    "--out=docs/data/batch_study_adamw_sweep.json": _BATCH_STUDY,
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16,256,64,128,32 --lr_grid=0.25,1,4 --target_loss=2.35 "
    "--max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --optimizers=adamw "
    "--tuned=adamw=0.003 --out=docs/data/batch_study_adamw.json": _BATCH_STUDY,
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16,32,64,128,256 --lr_grid=0.25,1,4 --target_loss=2.35 "
    "--max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --optimizers=lamb "
    "--out=docs/data/batch_study_lamb.json": _BATCH_STUDY,
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16,32,64,128,256 --lr_grid=0.25,1,4 --target_loss=2.35 "
    "--max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --optimizers=muon "
    "--out=docs/data/batch_study_muon.json": _BATCH_STUDY,
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16,256,64 --retune=2 --target_loss=2.35 --max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --retune_only --optimizers=adamw "
    "--tuned=adamw=0.003 --out=docs/data/batch_study_adamw_retune.json": _BATCH_STUDY,
    "python scripts/bench.py --study=batch --config.runtime.cpu_devices=1 --config.mesh.data=1 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.d_model=64 "
    "--config.model.seq_len=32 --config.train.schedule=constant --config.train.warmup_steps=10 "
    "--batch_sizes=16,64,256,32,128,512 --lr_grid=0.25,1,4 --retune=0.5,2 --target_loss=2.35 "
    "--max_steps=500 --max_examples=16384 --eval_every_examples=320 --val_examples=128 "
    "--partial --optimizers=muon,lamb,adamw --out=docs/data/batch_study_all.json": (
        _BATCH_STUDY[0] + " --optimizers=muon --retune=2",
        "three optimizers' studies in one, about 70 training runs (an hour and a half on 2 cores); "
        "one optimizer's batch pair for 2 steps, with one re-tune, runs the same code",
    ),
    "python scripts/bench.py --study=batch --config=configs/llama_tiny.py "
    "--config.runtime.cpu_devices=1 --config.mesh.data=1 --config.mesh.fsdp=1 "
    "--config.mesh.tensor=1 --config.model.seq_len=32 --config.train.schedule=constant "
    "--config.train.warmup_steps=10 --batch_sizes=16,64,256,32,128,512 --lr_grid=0.25,1,4 "
    "--retune=0.5,2 --target_loss=2.35 --max_steps=500 --max_examples=16384 "
    "--eval_every_examples=320 --val_examples=128 --partial --optimizers=muon,lamb,adamw "
    "--out=docs/data/batch_study_llama_tiny.json": (
        _BATCH_STUDY[0] + " --optimizers=muon --retune=2",
        "three optimizers' studies on llama_tiny, 54 training runs (half an hour on 2 cores); one "
        "optimizer's batch pair for 2 steps, with one re-tune, runs the same code",
    ),
    "python scripts/bench.py --study=moments --out=docs/data/moments_default.json": (
        _TINY_MOMENTS,
        "the default job's 300 steps three times (float32, bfloat16 nearest and stochastic) take "
        "minutes on 2 cores; 4 steps of a 1-layer, 32-wide GPT run the same study",
    ),
    "python scripts/bench.py --study=moments --config.train.seed=1 "
    "--out=docs/data/moments_default_seed1.json": (
        _TINY_MOMENTS,
        "the moments study's 300 steps three times (another seed) take minutes on 2 cores; 4 "
        "steps of a 1-layer, 32-wide GPT run the same study",
    ),
    "python scripts/bench.py --study=moments --config.train.seed=2 "
    "--out=docs/data/moments_default_seed2.json": (
        _TINY_MOMENTS,
        "the moments study's 300 steps three times (another seed) take minutes on 2 cores; 4 "
        "steps of a 1-layer, 32-wide GPT run the same study",
    ),
    "python scripts/bench.py --study=fp8 --out=docs/data/fp8_default.json": (
        "--max_steps=2 --config.model.num_layers=1 --config.model.d_model=32",
        "300 steps at two precisions take minutes on CPU; 2 steps of a 1-layer, 32-wide GPT "
        "run the same study",
    ),
    "python scripts/bench.py --study=fp8 --config=configs/llama_tiny.py "
    "--out=docs/data/fp8_llama_tiny.json": (
        "--max_steps=2",
        "300 steps at two precisions take minutes on CPU; 2 steps run the same study",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py "
    "--config.train.matmul_precision=fp8_all --workdir=runs/llama_fp8": (
        "--config.train.steps=2",
        "llama_tiny's 200 steps",
    ),
    "python scripts/train.py --workdir=runs/fast --config.checkpoint.local_every=5 "
    "--config.train.on_spike=rollback": (
        "--config.train.steps=6 --config.train.log_every=2",
        "the default job's 300 steps",
    ),
    "python scripts/train.py --config=configs/default.py --config.mesh.data=2 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=2 --config.mesh.pipeline=2 "
    "--config.model.num_layers=4 --config.pipeline.schedule=1f1b --config.pipeline.microbatches=4 "
    "--workdir=runs/pipeline": (
        "--config.train.steps=2 --config.model.d_model=32",
        "the default job's 300 steps; 2 steps of the same 4 stages 32 wide",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_own "
    "--config.data.source=runs/tokens --config.model.vocab_size=512 --config.train.steps=60 "
    "--config.checkpoint.every=60": (
        "--config.train.steps=6 --config.checkpoint.every=6",
        "60 steps of the walkthrough's model; 6 make the run folder the next commands read",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_ft "
    "--config.train.init_from=runs/llama_imported --config.data.source=runs/tokens "
    "--config.train.steps=20 --config.train.learning_rate=1e-3 --config.checkpoint.every=20": (
        "--config.train.steps=4 --config.checkpoint.every=4",
        "20 fine-tuning steps; 4 make the run folder the export reads",
    ),
    "python scripts/bench.py --study=context --config=configs/llama_tiny.py --lengths=256,1024 "
    "--steps=3 --warmup=1 --out=runs/bench/context.json": (
        "--lengths=32 --contexts=1,2 --steps=1 --warmup=0",
        "16 compiles and timed runs up to T=1024 take ~15 minutes on 2 cores; T=32 on context 1 "
        "and 2 runs the same code (tests/test_context.py checks every context size)",
    ),
    "python scripts/bench.py --study=moe --config=configs/llama_tiny.py --steps=5 --warmup=2 "
    "--out=runs/bench/moe.json": (
        "--experts=4 --steps=1 --warmup=0",
        "6 compiles take minutes on 2 cores; the 4-expert rows run the same code",
    ),
    "python scripts/bench.py --study=aggregation --parts=staleness --taus=0,1,2,4 --max_steps=300 "
    "--eval_every=10 --target_loss=2.5 --out=runs/bench/staleness.json": (
        _TINY_BENCH_MODEL + " --taus=0,1 --max_steps=2 --eval_every=2",
        "four training runs of 300 steps take many minutes on 2 cores",
    ),
    "python scripts/bench.py --study=aggregation --parts=staleness --taus=0,1,4 --max_steps=300 "
    "--eval_every=10 --target_loss=2.5 --config.train.learning_rate=1e-3 "
    "--out=runs/bench/staleness_lr1e-3.json": (
        _TINY_BENCH_MODEL + " --taus=0,1 --max_steps=2 --eval_every=2",
        "three training runs of 300 steps take many minutes on 2 cores",
    ),
    "python scripts/bench.py --study=aggregation --parts=per_hop --config.mesh.data=8 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --max_steps=300 --out=runs/bench/per_hop.json": (
        _TINY_BENCH_MODEL + " --max_steps=2 --rows=4,5",
        "five training runs of 300 steps take many minutes on 2 cores; rows 4 and 5 (int8 over "
        "the whole reduction and at every ring hop) run the table's code",
    ),
    "python scripts/bench.py --study=aggregation --parts=compress_over --config.mesh.data=8 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --max_steps=300 "
    "--out=runs/bench/compress_over.json": (
        _TINY_BENCH_MODEL + " --max_steps=2 --rows=5,6",
        "six training runs of 300 steps take many minutes on 2 cores; rows 5 and 6 (int8 over the "
        "whole reduction, hierarchical + int8 across hosts) run the table's code",
    ),
    "python scripts/bench.py --study=aggregation --parts=per_hop_topk --config.mesh.data=8 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --max_steps=300 "
    "--out=runs/bench/per_hop_topk.json": (
        _TINY_BENCH_MODEL + " --max_steps=2",
        "two training runs of 300 steps take minutes on 2 cores",
    ),
    "python scripts/launch.py --num_processes=2 --devices_per_process=4 -- python scripts/bench.py "
    "--study=aggregation --parts=compress_over --config.mesh.data=8 --config.mesh.fsdp=1 "
    "--config.mesh.tensor=1 --config.mesh.dcn_data=2 --max_steps=300 "
    "--out=runs/bench/compress_over_2proc.json": (
        _TINY_BENCH_MODEL + " --max_steps=2 --rows=5,6",
        "six training runs of 300 steps on 2 processes take many minutes on 2 cores; rows 5 and "
        "6 (int8 over the whole reduction, hierarchical + int8 across hosts) run the table's code",
    ),
    "python scripts/bench.py --study=aggregation --parts=streaming "
    "--config.grad_sync.local_steps=10 --config.grad_sync.outer_optimizer=nesterov "
    "--max_steps=300 --out=runs/bench/streaming.json": (
        _TINY_BENCH_MODEL + " --max_steps=2 --rows=4,5",
        "five training runs of 300 steps take many minutes on 2 cores; rows 4 and 5 (streaming "
        "with overlap and int8 / int4 outer gradients) run the table's code",
    ),
    "python scripts/train.py --config.mesh.data=8 --config.mesh.fsdp=1 --config.mesh.tensor=1 "
    "--config.grad_sync.algorithm=ps --workdir=runs/ps": (
        "--config.train.steps=2",
        "the default job's 300 steps",
    ),
    "python scripts/launch.py --num_processes=2 --devices_per_process=4 -- python scripts/train.py "
    "--config.mesh.data=4 --config.mesh.fsdp=1 --config.mesh.tensor=2 --config.mesh.dcn_data=2 "
    "--config.grad_sync.algorithm=hierarchical --workdir=runs/hierarchical": (
        "--config.train.steps=2",
        "the default job's 300 steps, in 2 processes",
    ),
    "python scripts/bench_pipeline.py --ms=8 --steps=0 --fsdp=2 --schedules=gpipe,1f1b,zb": (
        "--schedules=1f1b",
        "3 compiles on 8 devices; one row runs the same code",
    ),
    "python scripts/bench_pipeline.py --ms=8 --steps=0 --fsdp=2 --schedules=gpipe,1f1b,zb "
    "--fsdp_gather_once": (
        "--schedules=1f1b",
        "3 compiles on 8 devices; one row runs the same code",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/context "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.context=4 --config.train.steps=20": (
        "--config.train.steps=2",
        "20 steps of the tiny Llama; 2 compile and run the same context-parallel step",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/moe "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.expert=4 "
    "--config.model.num_experts=8 --config.train.steps=20": (
        "--config.train.steps=2",
        "20 steps of the tiny Llama; 2 compile and run the same expert-parallel step",
    ),
    "python scripts/plan.py --config=configs/gpt_1b.py --devices=64 --hardware=h100_nvlink_ib "
    "[--top=10] [--out=plan.json] [--plot=scaling.png] [--config.train.batch_size=256]": (
        "--plot_max_devices=64",
        "the scaling plot plans every layout of 8 to 4096 devices (17 s of CPU); up to 64 devices "
        "runs the same code (3.4 s)",
    ),
    "python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/packed "
    "--config.data.packing=documents --config.train.steps=20": (
        "--config.train.steps=2",
        "20 steps of the tiny Llama; 2 compile and run the same packed step",
    ),
    "python scripts/train.py --config=configs/llama3_8b.py --workdir=runs/llama3_8b": (
        _TINY_LLAMA + " --config.runtime.cpu_devices=8 --config.train.steps=2 "
        "--config.train.batch_size=8 --config.train.eval_batches=1 --config.checkpoint.every=2",
        "8B parameters need 8 GPUs: the same config and layout (FSDP over all 8 devices) with the "
        "model shrunk, on 8 simulated CPU devices",
    ),
    "python scripts/bench_pipeline.py --ms=4,8,32 --steps=0": (
        "--ms=4 --schedules=1f1b",
        "12 schedule × microbatch compiles; one row runs the same code",
    ),
    "python scripts/bench_pipeline.py --ms=4,8,32 --steps=0 --schedules=gpipe,1f1b,zb "
    "--remat=full": (
        "--ms=4 --schedules=zb",
        "9 schedule × microbatch compiles; one row runs the same code",
    ),
}
_SETUP = "sets up an environment (a venv, packages from the network); this test runs in one"
_CLUSTER = "needs a cluster (SLURM, Docker, Kubernetes), not this machine"
_NETEM = (
    "needs root (CAP_NET_ADMIN) for network namespaces; tests/test_netem.py runs such launches "
    "and skips where namespaces cannot be made"
)
NOT_RUN = {
    "python scripts/restart_bench.py --num_processes=4 --devices_per_process=1 "
    "--out=runs/restart4.json": (
        "a benchmark: two 4-process jobs, each killed and restarted (minutes); "
        "tests/test_fast_tier.py runs the same kill -9 and fast-tier restore with 2 processes"
    ),
    "python scripts/restart_bench.py --num_processes=2 --elastic --out=runs/restart_elastic.json": (
        "a benchmark: two 2-process jobs, each killed and restarted on 1 process (minutes); "
        "tests/test_fast_tier.py runs the same reassembly onto 1 process"
    ),
    "python3 -m venv .venv": _SETUP,
    ". .venv/bin/activate": _SETUP,
    "pip install -U pip": _SETUP,
    "pip install -e .": _SETUP,
    "pip install --no-compile -e '.[test,hf,eval]'": _SETUP,
    'pip install -e . "jax[cuda13]"': _SETUP + " and a GPU",
    'pip install -e . "jax[cuda12]"': _SETUP + " and a GPU",
    'pip install -e . "jax[tpu]"': _SETUP + " and a TPU",
    "JAXDIST_TEST_FAST_CODEGEN=1 python -m pytest -q -n 2 --dist loadfile": (
        "the test suite this test is part of"
    ),
    # Studies whose test runs the documented command as written, with flags appended (a shorter
    # run, a temporary --out), and checks what it wrote: running it here too would only repeat it
    # (test_run_by_names_a_test_that_runs_the_command checks the test holds the command's words).
    "python scripts/bench.py": (
        "run by tests/test_bench.py::test_overhead_study_end_to_end (+ a one-layer model, 3 "
        "steps, 1 round: 3 rounds of 20 timed steps per side take ~40 s)"
    ),
    "python scripts/bench_data.py --study=decode --config=configs/llama_tiny.py": (
        "run by tests/test_bench_data.py::test_decode_study_times_prefill_and_decode "
        "(+ --new_tokens=4 --repeats=1: 3 repeats of 32 decode steps take a minute)"
    ),
    "python scripts/bench.py --study=aggregation --parts=algorithms --config.mesh.data=8 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --out=runs/bench/aggregation.json": (
        "run by tests/test_bench.py::test_aggregation_study_end_to_end (+ a one-layer model for "
        "1 step, with the staleness and per-hop parts: six algorithms timed for 20 steps on the "
        "default GPT take minutes)"
    ),
    "python scripts/bench_data.py --study=loader": (
        "run by tests/test_bench_data.py::test_loader_study_sets_the_loader_beside_the_step "
        "(+ --steps=2: 2 of the 30 timed batches)"
    ),
    "python scripts/bench_data.py --study=tokenize --corpus_mb=50": (
        "run by tests/test_bench_data.py::test_tokenize_study_compares_the_same_work "
        "(+ --corpus_mb=0.5 --vocab=512 --repeats=1: 50 MB three times takes minutes)"
    ),
    "python scripts/bench_data.py --study=packing": (
        "run by tests/test_bench_data.py::test_packing_study_reports_the_efficiency "
        "(+ --seq_lens=64,256 --repeats=1 --steps=2: two of the four row lengths, once)"
    ),
    "python scripts/bench_data.py --study=decode --vs_transformers --config=configs/llama_tiny.py": (
        "run by tests/test_bench_data.py::test_decode_vs_transformers_agrees_token_for_token "
        "(+ --batch_sizes=1,2 --new_tokens=8 --repeats=1: batch 64 and 3 repeats take minutes)"
    ),
    "python scripts/bench.py --study=compression --config.mesh.data=8 --config.mesh.fsdp=1 "
    "--config.mesh.tensor=1 --max_steps=200": (
        "run by tests/test_bench.py::test_compression_study_end_to_end (+ a one-layer model, "
        "--max_steps=4 and four compressors: every compressor for 200 steps takes many minutes)"
    ),
    "python scripts/bench.py --study=compression --table=small --config.mesh.data=8 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.model.num_layers=1 "
    "--config.model.d_model=32 --config.model.seq_len=16 --config.train.batch_size=16 "
    "--config.train.warmup_steps=10 --config.data.max_bytes=400000 --max_steps=150 "
    "--sgd_learning_rate=0.3 --max_loss_vs_baseline=0.05 --out=docs/data/compression_small.json": (
        "run by tests/test_bench.py::test_compression_small_table_fails_the_rows_over_the_bound "
        "(+ --max_steps=3, two methods and a bound they miss: nine runs of 150 steps are a study)"
    ),
    "bash scripts/gpu_check.sh runs/gpu_check": (
        "run by tests/test_gpu_check.py (the same CPU dry run into a temporary folder, its JSON and "
        "table checked there)"
    ),
    "bash scripts/gpu_check.sh": (
        "its OUT_DIR defaults to runs/gpu_check: the run above, which tests/test_gpu_check.py "
        "makes (100 s of CPU, every row of issue 35, run twice otherwise)"
    ),
    "bash scripts/gpu_check.sh OUT --wheels .whl --only gpt_1b_bf16,gpt_1b_fp8,"
    "llama3_8b_proxy_bf16,llama3_8b_proxy_fp8,correct --budget_s 480 --row_s 160": (
        "a GPU window's rows (--only names GPU rows, which the CPU dry run has not; "
        "tests/test_gpu_check.py runs the dry run and checks --only)"
    ),
    "python scripts/bench_gpu.py --phase=point ...": (
        "a template; `bash scripts/gpu_check.sh` (run here) runs every point of it"
    ),
    "mpirun -np 4 -x JAXDIST_COORDINATOR=host0:8476 python scripts/train.py ...": (
        "a template (`...`) for MPI on several hosts"
    ),
    "JAXDIST_COORDINATOR=host0:8476 JAXDIST_NUM_PROCESSES=2 JAXDIST_PROCESS_ID=<0 or 1> "
    "python scripts/train.py ...": "a template for two hosts; launch.py runs the same locally",
    "sbatch scripts/slurm/train.sbatch --config=configs/default.py "
    "--workdir=/shared/runs/slurm": _CLUSTER,
    "sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-task=1 scripts/slurm/train.sbatch "
    "--config=configs/default.py --workdir=/shared/runs/slurm": _CLUSTER,
    "PYTHON=/path/to/venv/bin/python JAXDIST_COORDINATOR_PORT=29500 sbatch "
    "scripts/slurm/train.sbatch ...": _CLUSTER,
    "squeue --me; tail -f jaxdist-<jobid>.out": _CLUSTER,
    "docker build -t jaxdist:latest -f- . <<'EOF'\nFROM python:3.11-slim\nWORKDIR /app\n"
    "COPY . /app\nRUN pip install --no-cache-dir -e .\nEOF": _CLUSTER,
    "kind load docker-image jaxdist:latest": _CLUSTER,
    "kubectl apply -f scripts/k8s/jobset.yaml": _CLUSTER,
    "kubectl get pods -l jobset.sigs.k8s.io/jobset-name=jaxdist": _CLUSTER,
    "kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=jaxdist --prefix --max-log-requests=16": (
        _CLUSTER
    ),
    "kubectl delete jobset jaxdist": _CLUSTER,
    "sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-task=8 scripts/slurm/train.sbatch "
    "--config=configs/llama3_8b.py --workdir=/shared/runs/llama3_8b --config.mesh.data=4 "
    "--config.mesh.fsdp=8 --config.mesh.dcn_data=4 --config.train.batch_size=32": _CLUSTER
    + "; docs/CLUSTER.md's rehearsal runs its layout (data × fsdp with dcn_data) in 2 processes",
    "docker build -t jaxdist:cuda -f- . <<'EOF'\nFROM python:3.11-slim\nWORKDIR /app\n"
    'COPY . /app\nRUN pip install --no-cache-dir -e . "jax[cuda12]"\nEOF': _CLUSTER,
    "kubectl apply -f scripts/k8s/llama3_8b.yaml": _CLUSTER
    + "; tests/test_config_llama3_8b.py checks the file against the planner's flags",
    "kubectl logs -f -l jobset.sigs.k8s.io/jobset-name=jaxdist-llama3-8b --prefix "
    "--max-log-requests=16": _CLUSTER,
    "python scripts/launch.py --network=rate=50mbit --num_processes=2 --devices_per_process=2 "
    "-- python scripts/train.py --workdir=runs/netem --config.train.steps=20 --config.mesh.data=4 "
    "--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.dcn_data=2": _NETEM,
    "python scripts/bench.py --study=network --out=docs/data/network_rate50.json "
    "--methods=xla,ring,hierarchical,ps,int8,powersgd --links=rate=50mbit "
    "--network_steps=10": _NETEM + "; 12 training runs take ~30 min on 2 loaded cores",
    "python scripts/bench.py --study=network --out=docs/data/network_rate50_first.json "
    "--methods=xla,hierarchical --links=rate=50mbit --network_steps=12": _NETEM,
    "python scripts/bench.py --study=network --out=docs/data/network_ddp_rate50.json "
    "--methods=xla,ring,bf16,powersgd,ddp,ddp_fp16,ddp_powersgd --links=rate=50mbit "
    "--network_steps=10 --network_devices=1": _NETEM
    + "; the DDP rows need torch (hf extra); tests/test_ddp_network.py runs one over 50 Mbit/s",
    "python scripts/bench.py --study=network --out=docs/data/network_rate50_more.json "
    "--methods=halving_doubling,tree,sharded_ps,bf16 --links=rate=50mbit "
    "--network_steps=10": _NETEM,
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts.json "
    "--methods=xla,ddp,ring,bf16,ddp_fp16,powersgd,ddp_powersgd,int8,onebit_adam,diloco_h8,"
    "diloco_h32,streaming_h8,stale1,ef_sign,topk,ps,sharded_ps,halving_doubling,tree "
    "--links=rate=50mbit,rate=200mbit --network_steps=40 --network_hosts=4 "
    "--network_devices=1": _NETEM
    + "; 57 training runs take ~57 min on 2 quiet cores; tests/test_netem.py checks the "
    "planner on its committed rows",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_repeat.json "
    "--methods=xla,ring,bf16,int8,powersgd,diloco_h8 --links=rate=50mbit --network_steps=40 "
    "--network_hosts=4 --network_devices=1": _NETEM
    + "; 12 training runs take 12 min on 2 quiet cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4x2_hierarchical.json "
    "--methods=xla,ring,hierarchical --links=rate=50mbit --network_steps=20 --network_hosts=4 "
    "--network_devices=2": _NETEM + "; 6 training runs take 5 min on 2 quiet cores",
    "python scripts/bench.py --study=network --out=docs/data/network_ddp_jaxinit_2h.json "
    "--methods=xla,ddp,ddp_jaxinit,bf16,ddp_fp16,ddp_fp16_jaxinit --links=rate=50mbit "
    "--network_steps=20 --network_devices=1": _NETEM
    + "; 12 training runs take 5 min on 2 quiet cores; tests/test_ddp_network.py checks the init",
    "python scripts/bench.py --study=network --out=docs/data/network_overlap_2h.json "
    "--methods=xla,xla_overlap,xla_next,bf16,bf16_overlap,bf16_next,ddp,ddp_fp16 "
    "--links=rate=50mbit --network_steps=20 --network_devices=1": _NETEM
    + "; 16 training runs take 6 min on 2 quiet cores; tests/test_overlap.py checks both modes",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_delay_loss.json "
    "--methods=xla,bf16,powersgd,diloco_h8,ddp,ddp_fp16 "
    "--links=rate=50mbit,rate=50mbit,delay=5ms,rate=50mbit,delay=1us,loss=2% "
    "--network_steps=20 --network_devices=1 --network_hosts=4": _NETEM
    + "; 24 training runs take 23 min on 2 cores; tests/test_netem.py checks the wire and loss",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_delay_loss_ring.json "
    "--methods=ring --links=rate=50mbit,delay=5ms,rate=50mbit,delay=1us,loss=2% "
    "--network_steps=20 --network_devices=1 --network_hosts=4": _NETEM
    + "; 3 training runs take 3 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_xla_flat.json "
    "--methods=xla_flat --links=rate=1gbit,rate=50mbit,rate=50mbit,delay=5ms --network_steps=20 "
    "--network_devices=1 --network_hosts=4": _NETEM + "; 4 training runs take 3 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_1gbit.json "
    "--methods=xla,ring,bf16,powersgd,diloco_h8,ddp,ddp_fp16 --links=rate=1gbit "
    "--network_steps=20 --network_devices=1 --network_hosts=4": _NETEM
    + "; 14 training runs take 9 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_all_methods.json "
    "--methods=int8,onebit_adam,ef_sign,topk,diloco_h32,streaming_h8,stale1,ps,sharded_ps,"
    "halving_doubling,tree,ddp_powersgd --links=rate=50mbit,delay=5ms,rate=1gbit "
    "--network_steps=20 --network_devices=1 --network_hosts=4": _NETEM
    + "; 36 training runs take 26 min on 2 quiet cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4x2_delay.json "
    "--methods=xla_flat,ring,hierarchical --links=rate=50mbit,delay=5ms --network_steps=20 "
    "--network_hosts=4 --network_devices=2": _NETEM + "; 6 training runs take 5 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_jitter.json "
    "--methods=xla_flat,ring,bf16,ddp,ddp_fp16 --links=rate=50mbit,delay=5ms,jitter=1ms "
    "--network_steps=20 --network_devices=1 --network_hosts=4": _NETEM
    + "; 10 training runs take 5 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_powersgd_5ms.json "
    "--methods=powersgd,ddp_powersgd --links=rate=50mbit,delay=5ms --network_steps=20 "
    "--network_devices=1 --network_hosts=4 --target_loss=3.06": _NETEM
    + "; 4 training runs take 6 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_one_buffer.json "
    "--methods=bf16,int8,ef_sign,onebit_adam,topk,ddp_fp16 --links=rate=50mbit,delay=5ms "
    "--network_steps=20 --network_devices=1 --network_hosts=4 --target_loss=3.06": _NETEM
    + "; 12 training runs take 9 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_one_buffer_onebit.json "
    "--methods=onebit_adam --links=rate=50mbit,delay=5ms --network_steps=20 "
    "--network_devices=1 --network_hosts=4 --target_loss=3.06": _NETEM
    + "; 2 training runs take 2 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_4hosts_one_buffer_topk.json "
    "--methods=topk --links=rate=50mbit,delay=5ms --network_steps=20 "
    "--network_devices=1 --network_hosts=4 --target_loss=3.06": _NETEM
    + "; 2 training runs take 2 min on 2 cores",
    "python scripts/launch.py --network=rate=50mbit --num_processes=2 --devices_per_process=1 "
    "--platform=cpu -- python tests/netem_job.py collectives 1000000 "
    "docs/data/network_collectives_2hosts.json": _NETEM,
    "python scripts/launch.py --network=rate=50mbit --num_processes=4 --devices_per_process=1 "
    "--platform=cpu -- python tests/netem_job.py collectives 1000000 "
    "docs/data/network_collectives_4hosts.json": _NETEM,
    "python scripts/bench.py --study=network --out=docs/data/network_overlap_2h_one_buffer.json "
    "--methods=bf16,bf16_overlap,ddp_fp16 --links=rate=50mbit --network_steps=20 "
    "--network_devices=1": _NETEM + "; 6 training runs take 4 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_fp16_2h.json "
    "--methods=fp16,fp16_overlap,bf16,ddp_fp16 --links=rate=50mbit --network_steps=20 "
    "--network_devices=1": _NETEM + "; 8 training runs take 4 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_fp16_4h.json "
    "--methods=fp16,bf16,ddp_fp16 --links=rate=50mbit --network_steps=20 --network_devices=1 "
    "--network_hosts=4": _NETEM + "; 6 training runs on 4 hosts take 5 min on 2 cores",
    "python scripts/bench.py --study=network --out=docs/data/network_fp16_4h_200.json "
    "--methods=fp16,fp16_overlap,ddp_fp16 --links=rate=200mbit --network_steps=20 "
    "--network_devices=1 --network_hosts=4": _NETEM + "; 6 training runs on 4 hosts take 5 min",
    "python scripts/bench.py --study=network --out=docs/data/network_rate50_methods.json "
    "--methods=xla,int8,halving_doubling,ef_sign,topk,onebit_adam,diloco_h8 "
    "--links=rate=50mbit --network_steps=10": _NETEM,
    "python scripts/launch.py --network=rate=50mbit --link=2:rate=5mbit --num_processes=4 "
    "--devices_per_process=1 --platform=cpu -- python scripts/train.py --workdir=runs/straggler "
    "--config.model.num_layers=2 --config.model.d_model=128 --config.model.num_heads=4 "
    "--config.model.seq_len=64 --config.model.vocab_size=256 --config.train.batch_size=16 "
    "--config.train.steps=4 --config.train.log_every=1 --config.checkpoint.every=0 "
    "--config.data.max_bytes=2000000 --config.mesh.data=4 --config.mesh.fsdp=1 "
    "--config.mesh.tensor=1 --config.mesh.dcn_data=4": _NETEM
    + "; tests/test_netem.py tests the straggler rule on a switch table",
    "python scripts/network_fault.py --hosts=4 --out=docs/data/network_fault4.json": _NETEM
    + "; tests/test_network_fault.py runs it with 3 hosts",
    "python scripts/network_fault.py --hosts=4 --fault_host=0 "
    "--out=docs/data/network_fault4_host0.json": _NETEM
    + "; tests/test_network_fault.py runs it with 3 hosts",
}


@dataclass
class Command:
    text: str  # as documented, continuations joined, `[...]` kept
    where: str  # file:line
    expected: list[str] | None = None  # output lines shown after a `$ ` prompt
    runs: list[str] = field(default_factory=list)  # what to run: without, then with, optionals


def _logical_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line index, text) with `\\` continuations joined and heredocs kept with their command."""
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        start, text = i, lines[i].rstrip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", text)
        if heredoc:
            end = heredoc.group(1)
            while i + 1 < len(lines):
                i += 1
                text += "\n" + lines[i].rstrip()
                if lines[i].strip() == end:
                    break
        out.append((start, text))
        i += 1
    return out


def _from_block(tag: str, body: list[str], first: int, name: str) -> list[Command]:
    found: list[Command] = []
    for offset, text in _logical_lines(body):
        stripped = text.strip()
        if "\n" not in stripped:  # a trailing `# comment` is not part of the command
            stripped = re.sub(r"\s+#\s.*$", "", stripped)
        if tag in SHELL_TAGS:
            if stripped and not stripped.startswith("#"):
                found.append(Command(stripped, f"{name}:{first + offset}"))
        elif stripped.startswith("$ "):
            found.append(Command(stripped[2:], f"{name}:{first + offset}", expected=[]))
        elif found and found[-1].expected is not None:
            if stripped:
                found[-1].expected.append(stripped)
        elif UNTAGGED_COMMAND.match(stripped):
            found.append(Command(stripped, f"{name}:{first + offset}"))
    return found


def extract(path: Path) -> list[Command]:
    """The commands `path` shows, by the rule in this module's docstring."""
    lines = path.read_text().splitlines()
    name = str(path.relative_to(ROOT))
    found: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)", lines[i])
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            if fence.group(1) != "python":
                found += _from_block(fence.group(1), lines[i + 1 : end], i + 2, name)
            i = end + 1
            continue
        for span in re.findall(r"`([^`]+)`", lines[i]):
            if INLINE_COMMAND.match(span):
                found.append(Command(span.strip(), f"{name}:{i + 1}"))
        i += 1
    commands = []
    for c in found:  # `a && b`: each its own command, at the same place
        parts = [p.strip() for p in c.text.split(" && ")] if "\n" not in c.text else [c.text]
        commands += [Command(p, c.where, c.expected) for p in parts]
    return commands


def _runs(text: str) -> list[str]:
    """The command without its `[...]` optionals, then (if any) with all of them, filled in."""
    optional = re.findall(r"\[([^\[\]]*)\]", text)
    bare = re.sub(r"\s*\[[^\[\]]*\]", "", text)
    if not optional:
        return [bare]
    full = re.sub(r"\[([^\[\]]*)\]", r"\1", text)
    for word in set(re.findall(r"\b[A-Z]\w*\b", " ".join(optional))):
        assert word in PLACEHOLDERS, f"placeholder {word} in {text!r}: add a value to PLACEHOLDERS"
        full = re.sub(rf"\b{word}\b", PLACEHOLDERS[word], full)
    return [bare, full]


def all_commands() -> list[Command]:
    commands = [c for path in DOCS for c in extract(path)]
    for c in commands:
        c.runs = [] if c.text in NOT_RUN else _runs(c.text)
    return commands


COMMANDS = all_commands()


def _runnable() -> dict[str, tuple[Command, str]]:
    """Each distinct run once, named by where it first appears (a command shown in two docs, or
    twice in one, runs once; a prompt with expected output is kept as its own run)."""
    out, seen = {}, set()
    for c in COMMANDS:
        for run in c.runs:
            if (run, bool(c.expected)) not in seen:
                seen.add((run, bool(c.expected)))
                out[f"{c.where} {run}"] = (c, run)
    return out


RUNNABLE = _runnable()


def test_extraction_finds_the_documented_commands():
    texts = [c.text for c in COMMANDS]
    # One of each kind the rule covers: fenced bash (split at &&), an untagged block, a prompt
    # with its output, a continued line, an inline span, a heredoc.
    assert "python scripts/train.py" in texts
    assert "python scripts/ckpt.py verify  runs/default/checkpoints [--step S]" in texts
    (prompt,) = [c for c in COMMANDS if c.expected]
    assert prompt.text == "python scripts/train.py --config.mesh.data=3"
    assert prompt.expected[0].startswith("error: mesh: data×fsdp×tensor×pipeline = 3×2×2×1")
    assert any(
        t.endswith("--config.pipeline.microbatches=4 --workdir=runs/pipeline") for t in texts
    )
    assert "python scripts/plot.py runs/default" in texts
    assert any(t.startswith("docker build") and t.endswith("\nEOF") for t in texts)
    assert any(t.startswith("JAXDIST_COORDINATOR=host0:8476 ") for t in texts)
    assert len(RUNNABLE) >= 15, sorted(RUNNABLE)


def test_every_listed_command_is_documented():
    texts = {c.text for c in COMMANDS}
    assert not set(SHORTENED) - texts, "SHORTENED names commands no doc shows"
    assert not set(NOT_RUN) - texts, "NOT_RUN names commands no doc shows"
    templates = [c.text for c in COMMANDS if "..." in c.text.split() and c.text not in NOT_RUN]
    assert not templates, f"templates (`...`) need a runnable form or a NOT_RUN reason: {templates}"


# ------------------------------------------------------------------------------------------------
# Running them.


def _copy_source(dest: Path) -> None:
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", ".pytest_cache", "*.egg-info", ".ruff_cache"
        ),  # __pycache__ comes along: the session's bytecode (tests/conftest.py), still valid
    )


def _env(bin_dir: Path) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(command: str, cwd: Path, env: dict[str, str], timeout: int = 300):
    """Runs `command`; prints its wall and CPU seconds (its own rusage, not the other thread's;
    with the session's forked interpreter, not the forked children's either: run with
    JAXDIST_TEST_NO_PREFORK=1 to count them) to stderr, so `pytest -s` shows what each
    documented command costs."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=err)
        killed: list[bool] = []
        timer = threading.Timer(timeout, lambda: killed.append(True) or proc.kill())
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if killed:
            raise subprocess.TimeoutExpired(command, timeout)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())
    cpu = usage.ru_utime + usage.ru_stime
    wall = time.monotonic() - start
    print(f"[docs] {cpu:6.1f} s cpu {wall:6.1f} s wall  {command}", file=sys.stderr)
    return done


def _with_flags(run: str, text: str = "") -> str:
    """`run` with its SHORTENED flags: listed under the run itself or, for a command with
    `[...]` optionals, under the command as documented (then both of its runs get them)."""
    extra = SHORTENED.get(run, SHORTENED.get(text, ("", "")))[0]
    return f"{run} {extra}".strip()


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """Runs the selected commands, two at a time, after the fixture run: run key -> process."""
    selected = {
        item.callspec.params["key"]
        for item in request.session.items
        if item.originalname == "test_documented_command_runs"
    }
    base = tmp_path_factory.mktemp("docs")
    bin_dir = base / "bin"  # `python` and `python3` are this interpreter, forked (helpers.python)
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(python())} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = _env(bin_dir)
    source = base / "source"
    _copy_source(source)
    fixture = source / "runs" / "default"

    def run_in_copy(keys: list[str]) -> dict:
        """The runs of `keys`, in order, in one fresh copy that holds the fixture."""
        root = base / f"root-{list(RUNNABLE).index(keys[0])}"
        _copy_source(root)
        shutil.copytree(fixture, root / "runs" / "default")
        return {
            key: _run(_with_flags(RUNNABLE[key][1], RUNNABLE[key][0].text), root, env)
            for key in keys
        }

    out = {}
    # The quickstart's train command makes runs/default (shortened); every other command runs
    # where a user who did the quickstart stands.
    first = [k for k, (c, run) in RUNNABLE.items() if run == "python scripts/train.py"]
    assert len(first) == 1, first
    out[first[0]] = _run(_with_flags("python scripts/train.py"), source, env)
    assert out[first[0]].returncode == 0, out[first[0]].stderr[-3000:]
    # A walkthrough's commands run in order in one copy; every other command in a copy of its
    # own, one after another with the other runs of its study (`_family`), so they reuse the
    # programs the first of them put in the session's compilation cache instead of compiling
    # them at the same time on the other thread. The longest chains start first.
    chains: dict[str, list[list[str]]] = {}
    for key, (c, run) in RUNNABLE.items():
        if key in out or key not in selected:
            continue
        doc = c.where.split(":")[0]
        if doc in WALKTHROUGHS:
            chains.setdefault(doc, [[]])[0].append(key)
        else:
            chains.setdefault(_family(run), []).append([key])
    ordered = sorted(chains.values(), key=lambda chain: -sum(map(len, chain)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in pool.map(lambda chain: [run_in_copy(keys) for keys in chain], ordered):
            for part in done:
                out.update(part)
    return out


def _family(run: str) -> str:
    """A study's runs (same script, `--study` and `--parts`, launched alike) compile many of the
    same programs: they share a family. Any other run is a family of its own."""
    words = run.split()
    picked = [w for w in words if w.startswith(("--study=", "--parts="))]
    if not picked:
        return run
    return " ".join([w for w in words if w.startswith("scripts/")] + picked)


@pytest.mark.parametrize("key", list(RUNNABLE), ids=list(RUNNABLE))
def test_documented_command_runs(key, results):
    command, run = RUNNABLE[key]
    proc = results[key]
    shown = f"{key} (+ {_with_flags(run, command.text)[len(run) :]!r})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    if command.expected:
        printed = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        assert printed == command.expected, shown
    else:
        assert proc.returncode == 0, shown


def test_the_fixture_run_is_a_finished_default_job(results):
    """What the ckpt and plot commands read: the default job's model, checkpoints at 2 and 4."""
    (key,) = [k for k, (c, run) in RUNNABLE.items() if run == "python scripts/train.py"]
    assert "done: step 4," in results[key].stdout, results[key].stdout[-2000:]


@pytest.mark.parametrize("text", list(NOT_RUN), ids=[t.split("\n")[0] for t in NOT_RUN])
def test_command_not_run_parses_and_names_real_files(text):
    proc = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for path in re.findall(r"\b(?:scripts|configs|docs)/[\w./-]+", text):
        assert (ROOT / path).exists(), f"{text!r} names {path}, which does not exist"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in re.findall(r"\.\[(\w+)\]", text):
        assert extra in extras, f"{text!r} installs the extra {extra!r}, which pyproject lacks"


_RUN_BY = re.compile(r"^run by (tests/\w+\.py)::(\w+)")


@pytest.mark.parametrize(
    "text", [t for t, why in NOT_RUN.items() if _RUN_BY.match(why)], ids=lambda t: t[:60]
)
def test_run_by_names_a_test_that_runs_the_command(text):
    """A command NOT_RUN says another test runs: that test exists, and its string arguments hold
    the command's words after the script, one after another as documented (flags may follow, as
    in SHORTENED), with the script named in its file."""
    import ast

    path, name = _RUN_BY.match(NOT_RUN[text]).groups()
    source = (ROOT / path).read_text()
    (fn,) = [n for n in ast.walk(ast.parse(source)) if getattr(n, "name", None) == name]
    constants = [n for n in ast.walk(fn) if isinstance(n, ast.Constant)]
    strings = [
        n.value
        for n in sorted(constants, key=lambda n: (n.lineno, n.col_offset))
        if isinstance(n.value, str)
    ]
    script, *words = text.split()[1:]
    assert f'"{script}"' in source, f"{path} never names {script}"
    at = [i for i in range(len(strings)) if strings[i : i + len(words)] == words]
    assert at, f"{path}::{name} does not pass {words} one after another, as {text!r} has them"


def test_install_hints_name_real_extras():
    """`pip install -e '.[X]'` anywhere in the docs or in an error message names a real extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    files = [*DOCS, *(ROOT / "jaxdist").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    named = {m for f in files for m in re.findall(r"pip install -e '\.\[(\w+)\]'", f.read_text())}
    assert named and named <= set(extras), named - set(extras)


def _masked(line: str, workdir: str) -> str:
    """`line` with what differs between runs masked: the run folder, numbers, durations, rates,
    the list of saved steps."""
    line = line.replace(workdir, "DIR").replace("/path/to/runs/default", "DIR")
    line = re.sub(r"\(steps [\d, ]+\)", "(steps #)", line)
    return re.sub(r"\d+(?:\.\d+)?(?:[kMG]\b|h\d+m|m\d+s|s\b|%)?", "#", line)


def test_readme_example_output_is_what_the_default_job_prints(results):
    """The README's closing lines of the default job, line for line, against what the fixture run
    (the default job, shortened) printed, numbers, times and folders masked: every line it shows
    exists with the same words and figures in the same places."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("The last lines say where everything went", 1)[1].split("```")[1]
    shown = [ln for ln in block.splitlines()[1:] if ln.strip()]
    assert shown[0].startswith("done: step 300, train loss "), shown
    (key,) = [k for k, (c, run) in RUNNABLE.items() if run == "python scripts/train.py"]
    printed = results[key].stdout.splitlines()
    workdir = next(ln.split("│ ", 1)[1] for ln in printed if ln.startswith("outputs │ "))
    masked = [_masked(ln, workdir) for ln in printed]
    for line in shown:
        want = re.escape(_masked(line, workdir)).replace(r"\.\.\.", ".*")
        assert any(re.fullmatch(want, got) for got in masked), (line, printed[-12:])
