#!/usr/bin/env python
"""The network study's GPT trained with PyTorch DDP over gloo: the side that jaxdist is set against.

    python scripts/launch.py --network=rate=50mbit --num_processes=2 --devices_per_process=1 -- \\
        python scripts/ddp_gpt.py --workdir=DIR [--ddp_hook=fp16|powersgd] [--config.a.b=V ...]

A benchmark, not library code: it needs torch (the `hf` extra). The model is jaxdist's GPT
(models/gpt.py) written in PyTorch: token embedding, pre-norm layers (RMSNorm without bias, fused
QKV, rotary positions, causal attention, tanh GELU MLP 4·D wide, no linear biases), final RMSNorm,
untied head; the parameter count is asserted equal to jaxdist's (`gpt_param_count`). The data are
jaxdist's (`jaxdist.data.Batches`: the same global batch per step, each rank its contiguous rows),
the optimizer jaxdist's AdamW (b1, b2, eps 1e-8, weight decay on matrices only, global-norm
clipping, linear warm-up from 0 then cosine to `min_lr_ratio`). `--config.*` flags are read as
scripts/train.py reads them (configs/default.py underneath); mesh and checkpoint fields are ignored.

Each process is one DDP rank (`torch.nn.parallel.DistributedDataParallel`, its default bucketed
all-reduce overlapped with the backward); `--ddp_hook=fp16` adds `fp16_compress_hook`,
`--ddp_hook=powersgd` `powerSGD_hook` (rank `--powersgd_rank`, error feedback and warm start as
jaxdist's powersgd; PyTorch needs its first step dense). Rank, world size and the rendezvous come
from scripts/launch.py's environment (`JAXDIST_COORDINATOR`, `JAXDIST_NUM_PROCESSES`,
`JAXDIST_PROCESS_ID`) as MASTER_ADDR, MASTER_PORT = the coordinator's port + PORT_OFFSET, RANK,
WORLD_SIZE. Rank 0 writes `workdir/metrics.jsonl` with the records scripts/network_study.py reads
from jaxdist's runs: a `layout` record (`params_total`, `cross_process_bytes_per_step`: what gloo's
ring all-reduce of the float32 gradient sends per host, 2(N-1)/N·4·params·processes per host), per
step `{step, loss, step_time_s}`, evaluations `{step, eval_loss}`, and on an emulated cluster each
host's link bytes (`kind: "net"`, jaxdist.network.counters).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PORT_OFFSET = 1000  # MASTER_PORT = the JAX coordinator's port + this: two services, two ports
HOOKS = ("none", "fp16", "powersgd")


def gpt_param_count(cfg) -> int:
    """jaxdist's GPT parameter count for `cfg.model` (models/gpt.py, RMSNorm: no norm biases)."""
    m = cfg.model
    D, V, L = m.d_model, m.vocab_size, m.num_layers
    F = m.mlp_dim or 4 * D
    bias = 2 * D if m.norm == "layernorm" else 0
    layer = D + 3 * D * D + D * D + D + D * F + F * D + bias
    return V * D + L * layer + D + (D if m.norm == "layernorm" else 0) + D * V


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="ddp_gpt.py", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--ddp_hook", choices=HOOKS, default="none")
    parser.add_argument("--powersgd_rank", type=int, default=4)
    parser.add_argument(
        "--init",
        choices=("torch", "jaxdist"),
        default="torch",
        help="initial parameters: torch's generator (seeded with train.seed), or the ones a "
        "jaxdist run of this config starts from (its family's init with train.seed)",
    )
    parser.add_argument(
        "--torch_threads",
        type=int,
        default=0,
        help="torch.set_num_threads; 0 = the CPUs this process may run on, as XLA:CPU sizes its "
        "thread pool",
    )
    args, rest = parser.parse_known_args(argv)
    from jaxdist.config import load_config_file

    cfg = load_config_file(os.path.join(ROOT, "configs", "default.py"))
    for a in rest:
        if not a.startswith("--config.") or "=" not in a:
            parser.error(f"unexpected argument {a!r}; fields are set with --config.section.key=V")
        path, value = a[len("--config.") :].split("=", 1)
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        if leaf not in node:
            parser.error(f"--config.{path}: no such field")
        old = node[leaf]
        if isinstance(old, bool):
            new = value.lower() in ("1", "true", "yes")
        elif isinstance(old, (int, float, str)):
            new = type(old)(value)
        else:
            continue  # tuples (mesh axes, ...) do not concern this script
        node[leaf] = new
    if cfg.model.norm != "rmsnorm":
        parser.error(f"--config.model.norm={cfg.model.norm!r}: this script builds RMSNorm only")
    if args.powersgd_rank < 1:
        parser.error(f"--powersgd_rank={args.powersgd_rank}: must be at least 1")
    return args, cfg


def jaxdist_initial_params(cfg) -> dict:
    """The parameters a jaxdist run of `cfg` starts from, as numpy: its family's module built
    with `nnx.Rngs(jax.random.key(train.seed))` in a jitted function, as `jaxdist.state`'s init
    does (on this process's CPU: the random bits do not depend on the devices)."""
    import jax
    import numpy as np
    from flax import nnx

    import models
    from jaxdist import data

    ds = data.load(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    make_model = models.get(cfg.model.name).make(cfg.model, ds)

    def init(key):  # compiled, as jaxdist's init is: XLA's fused scaling rounds as it does
        return nnx.to_pure_dict(nnx.state(make_model(nnx.Rngs(key)), nnx.Param))

    with jax.default_device(jax.devices("cpu")[0]):
        params = jax.jit(init)(jax.random.key(cfg.train.seed))
    return jax.tree.map(np.asarray, params)


def load_jaxdist_params(model, params: dict) -> None:
    """Copies jaxdist GPT parameters (a pure dict, `blocks` stacked [L, ...]) into `_model`'s."""
    import numpy as np
    import torch

    t = lambda x: torch.from_numpy(np.asarray(x, np.float32).copy())  # noqa: E731
    with torch.no_grad():
        model.embed.copy_(t(params["embed"]))
        model.final_norm.copy_(t(params["final_norm"]))
        model.head.copy_(t(params["head"]))
        for i, b in enumerate(model.blocks):
            for name in ("attn_norm", "wqkv", "wo", "mlp_norm", "w_up", "w_down"):
                getattr(b, name).copy_(t(params["blocks"][name][i]).reshape(getattr(b, name).shape))


def _rendezvous() -> tuple[int, int]:
    """(rank, world size), MASTER_ADDR/MASTER_PORT set from scripts/launch.py's environment."""
    world = int(os.environ.get("JAXDIST_NUM_PROCESSES", "1"))
    rank = int(os.environ.get("JAXDIST_PROCESS_ID", "0"))
    coordinator = os.environ.get("JAXDIST_COORDINATOR")
    if coordinator:
        host, port = coordinator.rsplit(":", 1)
        port = int(port) + PORT_OFFSET
    else:  # alone: any free port on loopback
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            host, port = "127.0.0.1", s.getsockname()[1]
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(world)
    return rank, world


def _model(cfg):
    import torch
    import torch.nn.functional as F
    from torch import nn

    m = cfg.model
    D, N, V, L = m.d_model, m.num_heads, m.vocab_size, m.num_layers
    H, FF = D // N, m.mlp_dim or 4 * D
    out_std = 0.02 / math.sqrt(2 * L)

    def rms(x, scale, eps=1e-6):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale

    def rope(x, base=10000.0):  # x [B, N, T, H], halves rotated as models/gpt.py's _rope
        T = x.shape[2]
        freqs = base ** (-torch.arange(0, H // 2, dtype=torch.float32) * 2 / H)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * freqs[None, :]
        sin, cos = ang.sin(), ang.cos()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def normal(*shape, std=0.02):
        return nn.Parameter(torch.randn(*shape) * std)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.Parameter(torch.ones(D))
            self.wqkv = normal(D, 3 * N * H)  # jaxdist's [D, 3, N, H]
            self.wo = normal(N * H, D, std=out_std)  # [N, H, D]
            self.mlp_norm = nn.Parameter(torch.ones(D))
            self.w_up = normal(D, FF)
            self.w_down = normal(FF, D, std=out_std)

        def forward(self, x):
            B, T, _ = x.shape
            qkv = (rms(x, self.attn_norm) @ self.wqkv).view(B, T, 3, N, H).permute(2, 0, 3, 1, 4)
            q, k, v = rope(qkv[0]), rope(qkv[1]), qkv[2]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + o.transpose(1, 2).reshape(B, T, N * H) @ self.wo
            u = F.gelu(rms(x, self.mlp_norm) @ self.w_up, approximate="tanh")
            return x + u @ self.w_down

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = normal(V, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.final_norm = nn.Parameter(torch.ones(D))
            self.head = normal(D, V)

        def forward(self, tokens, targets):
            x = self.embed[tokens]
            for b in self.blocks:
                x = b(x)
            logits = rms(x, self.final_norm) @ self.head
            return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    return GPT()


def _lr_lambda(t):
    """jaxdist's schedule (jaxdist/optim.py) as a multiple of the peak: linear warm-up from 0, then
    cosine decay to min_lr_ratio (optax's cosine_decay_schedule)."""
    warmup = min(t.warmup_steps, t.steps)
    decay = max(t.steps - warmup, 1)

    def f(step: int) -> float:
        if step < warmup:
            return step / warmup
        s = min(step - warmup, decay)
        return (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * s / decay)) + t.min_lr_ratio

    if t.schedule != "cosine":
        raise SystemExit(f"ddp_gpt.py: train.schedule={t.schedule!r}: only 'cosine' is built")
    return f


def _ddp(model, args: argparse.Namespace):
    """`model` in DDP, with --ddp_hook's communication hook (fp16 or PowerSGD) if any."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    # PowerSGD in one bucket (an explicit cap: DDP's default makes the first bucket 1 MiB). With
    # two, this job hung at step 4 on loopback: our reading is that bucket 0's Q all-reduce (issued
    # from gloo's completion callback of its P all-reduce) and bucket 1's P all-reduce (issued by
    # the backward) were issued in different orders on the two ranks.
    one_bucket = {"bucket_cap_mb": 25} if args.ddp_hook == "powersgd" else {}
    ddp = DistributedDataParallel(model, **one_bucket)
    if args.ddp_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.ddp_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=2,  # PyTorch's minimum with error feedback / warm start
            min_compression_rate=1.0,  # jaxdist's min_compression default
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _adamw(model, t):
    """jaxdist's AdamW in torch (weight decay on matrices only) and its warm-up + cosine schedule."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=t.learning_rate,
        betas=(t.b1, t.b2),
        eps=1e-8,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(t))
    return opt, sched


def _layout(args, world: int, per_host: int, params_total: int, threads: int, ring: float) -> dict:
    """The `layout` record scripts/network_study.py reads of a jaxdist run, for this DDP job."""
    import torch

    hosts = max(world // per_host, 1)
    return {
        "kind": "layout",
        "framework": "ddp",
        "ddp_hook": args.ddp_hook,
        "params_total": params_total,
        "processes": world,
        "torch_threads": threads,
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "torch_version": torch.__version__,
        # what gloo's ring all-reduce of the float32 gradient sends per host per step
        "cross_process_bytes_per_step": [ring] * hosts,
        "collective_bytes_per_step": {"all-reduce": 4.0 * params_total},
    }


def _rank_batches(cfg, rank: int, world: int):
    """`local(step, split="train")`: this rank's contiguous rows of jaxdist's global batch of
    `step`, as torch (inputs, targets)."""
    import numpy as np
    import torch

    from jaxdist import data

    t, m = cfg.train, cfg.model
    ds = data.load(cfg.data, seq_len=m.seq_len, vocab_size=m.vocab_size)
    batches = data.Batches(
        ds, batch_size=t.batch_size, seq_len=m.seq_len, seed=t.seed, shardings={}
    )
    if t.batch_size % world:
        raise SystemExit(f"ddp_gpt.py: train.batch_size={t.batch_size} is not divisible by {world}")
    rows = slice(rank * t.batch_size // world, (rank + 1) * t.batch_size // world)

    def local(step: int, split: str = "train"):
        b = batches.get_host(step, split)
        return (
            torch.from_numpy(np.ascontiguousarray(b[k][rows])).long() for k in ("inputs", "targets")
        )

    return local


def _metrics(args, rank: int, world: int, params_total: int, threads: int):
    """(metrics.jsonl opened with its `layout` record, the link counters' window) on rank 0;
    (None, None) on the other ranks."""
    from jaxdist.network import counters

    per_host = int(os.environ.get(counters.ENV_PROCESSES_PER_HOST, "1"))
    ring = 2 * (world - 1) / world * 4 * params_total * per_host if world > 1 else 0.0
    if rank != 0:
        return None, None
    os.makedirs(args.workdir, exist_ok=True)
    writer = open(os.path.join(args.workdir, "metrics.jsonl"), "w", encoding="utf-8")
    layout = _layout(args, world, per_host, params_total, threads, ring)
    writer.write(json.dumps(layout) + "\n")
    return writer, counters.Window.from_env()


def main(argv: list[str]) -> int:
    args, cfg = _parse(argv)
    # OpenMP's idle threads sleep rather than spin, as XLA:CPU's pool does: with spinning, two
    # 2-thread processes on this 2-core machine (shared with other jobs) took 3 s a step, not 0.3.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP
    import torch
    import torch.distributed as dist

    threads = args.torch_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rank, world = _rendezvous()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(cfg.train.seed)  # the same initial parameters on every rank
    model = _model(cfg)
    if args.init == "jaxdist":
        load_jaxdist_params(model, jaxdist_initial_params(cfg))
    params_total = sum(p.numel() for p in model.parameters())
    expected = gpt_param_count(cfg)
    assert params_total == expected, f"{params_total} parameters, jaxdist's GPT has {expected}"
    ddp = _ddp(model, args)
    t = cfg.train
    opt, sched = _adamw(model, t)

    local = _rank_batches(cfg, rank, world)

    def evaluate() -> float:
        with torch.no_grad():
            losses = [float(model(*local(i, "val"))) for i in range(t.eval_batches)]
        total = torch.tensor([sum(losses) / len(losses)])
        dist.all_reduce(total)
        return float(total) / world

    writer, net = _metrics(args, rank, world, params_total, threads)
    eval_every = t.eval_every or t.steps

    def write(record: dict) -> None:
        if writer is not None:
            writer.write(json.dumps(record) + "\n")
            writer.flush()

    dist.barrier()
    if net is not None:
        # DDP's constructor broadcast rank 0's parameters (4 bytes each); its call returns while
        # the link still drains them, and past this barrier the other ranks hold them all: the
        # first step's window starts here, without them.
        net.take(0)
    t_last = time.perf_counter()
    for step in range(t.steps):
        inputs, targets = local(step)
        loss = ddp(inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        opt.step()
        sched.step()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)  # the global mean loss, as jaxdist logs it
        now = time.perf_counter()
        n, dt = step + 1, now - t_last
        write({"step": n, "loss": float(mean) / world, "step_time_s": dt})
        if net is not None:
            record = net.take(1)
            if record is not None:
                write({"step": n, **record})
        if n % eval_every == 0 or n == t.steps:
            write({"step": n, "eval_loss": evaluate(), "kind": "eval"})
            if net is not None:
                net.take(1)  # the evaluation's bytes stay out of the next step's window
        t_last = time.perf_counter()
        if rank == 0:
            print(f"step {n}: loss {float(mean) / world:.4f}, {dt:.3f} s", flush=True)
    if writer is not None:
        writer.close()
    # Teardown while the interpreter is whole: every rank past its last collective (process 0
    # serves the rendezvous store), then DDP's reducer, which holds the process group and gloo's
    # work objects, released before the group is destroyed. Left to interpreter finalization, a
    # gloo thread's last tensor reference can abort the process ("terminate called without an
    # active exception": process 0 once in CI).
    dist.barrier()
    del ddp, opt, sched
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
