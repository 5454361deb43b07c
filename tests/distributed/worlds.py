"""What each rank runs in the multi-process tests; also the single-process reference.

One world per world size runs every check (spawning is the expensive part) and
returns plain data; the tests compare it with the reference.
"""

from __future__ import annotations

import copy
import gc
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero import ZeroOptimizer
from zero.memory import live_tensor_bytes, storage_bytes
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
STEPS = 10
BUCKET_MB = 0.01  # ~2.6k fp32 elements: many buckets, parameters of every size relative to one
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
}
SCENARIOS = [
    ("adamw", "plain"),
    ("adam", "plain"),
    ("sgd", "plain"),
    ("adamw", "accum"),
    ("adamw", "clip"),
    ("sgd", "clip"),  # SGD keeps runs within rounding of each other, so every step's norm is comparable
]
NUM_BATCHES = 3  # batches are revisited, so the loss visibly falls
STAGES = (0, 1, 2)


class ParityNet(nn.Module):
    """A tied-embedding GPT plus the awkward cases: a 1-element parameter (fewer elements than
    ranks), a module used only on odd steps (no gradient anywhere on even steps), a frozen
    parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CFG)
        self.scale = nn.Parameter(torch.ones(1))
        self.aux = nn.Linear(CFG.vocab_size, CFG.vocab_size)
        self.frozen_bias = nn.Parameter(torch.randn(CFG.vocab_size) * 0.01, requires_grad=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_aux: bool) -> torch.Tensor:
        logits = self.gpt(idx) * self.scale + self.frozen_bias
        if use_aux:
            logits = logits + 0.1 * self.aux(logits)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(seed: int = 0) -> ParityNet:
    torch.manual_seed(seed)
    return ParityNet()


def param_groups(model: nn.Module, lr: float) -> list[dict]:
    """Two groups with different hyperparameters (the frozen parameter included, as users do)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": vectors, "lr": lr * 0.5, "weight_decay": 0.0}]


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[kind]
    return cls(param_groups(model, kwargs["lr"]), **kwargs)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def train(kind: str, scenario: str, rank: int, world_size: int, mode: str, steps: int = STEPS) -> dict:
    """Train ``steps`` steps; ``mode`` is "reference" (one process, whole batch), "ddp" or "stage{0,1,2}"."""
    model = build_model()
    optimizer = make_optimizer(kind, model)
    micro = 2 if scenario == "accum" else 1
    if mode == "reference":
        rank, world_size, micro_splits = 0, 1, 1
        forward, opt, no_sync = model, optimizer, nullcontext
    elif mode == "ddp":
        forward = DistributedDataParallel(model, find_unused_parameters=True)
        opt, no_sync, micro_splits = optimizer, forward.no_sync, micro
    else:
        opt = ZeroOptimizer(optimizer, model, stage=int(mode[-1]), bucket_size_mb=BUCKET_MB)
        forward, no_sync, micro_splits = model, opt.no_sync, micro
    losses, norms = [], []
    for step in range(steps):
        x, y = synthetic_batch(step % NUM_BATCHES, GLOBAL_BATCH * micro, CFG)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        use_aux = step % 2 == 1
        total = torch.zeros(())
        for xm, ym, last in _micro_batches(x, y, micro_splits):
            with nullcontext() if last else no_sync():
                loss = forward(xm, ym, use_aux) / micro_splits
                loss.backward()
            total += loss.detach()
        if scenario == "clip":
            clip = opt.clip_grad_norm_ if isinstance(opt, ZeroOptimizer) else _torch_clip(model)
            norms.append(float(clip(0.5)))
        opt.step()
        opt.zero_grad()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world_size)
    out = {"losses": losses, "norms": norms, "params": flat_params(model)}
    if isinstance(opt, ZeroOptimizer):
        out["comm_stats"] = opt.comm_stats
        out["numel"], out["padded_numel"] = opt.partition.numel, opt.partition.padded_numel
        out["num_buckets"], out["num_params"] = len(opt.buckets), len(opt.partition.slots)
    return out


def _micro_batches(x: torch.Tensor, y: torch.Tensor, splits: int):
    for i, (xm, ym) in enumerate(zip(x.chunk(splits), y.chunk(splits))):
        yield xm, ym, i == splits - 1


def _torch_clip(model: nn.Module):
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def memory_after_step(rank: int, world_size: int, stage: int) -> dict:
    """Live CPU tensor bytes after one AdamW step, against what the optimizer says it holds."""
    gc.collect()
    baseline = live_tensor_bytes()
    model = build_model()
    opt = ZeroOptimizer(make_optimizer("adamw", model), model, stage=stage, bucket_size_mb=BUCKET_MB)
    x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
    model(local_slice(x, rank, world_size), local_slice(y, rank, world_size), True).backward()
    opt.step()
    del x, y
    measured = live_tensor_bytes() - baseline
    buffers = storage_bytes(model.buffers())
    state = opt.model_state_bytes()
    return {
        "measured": measured,
        "buffers": buffers,
        "parameters": state.parameters,
        "gradients": state.gradients,
        "optimizer_state": state.optimizer_state,
        "numel": opt.partition.numel,
        "padded_numel": opt.partition.padded_numel,
        "frozen_numel": model.frozen_bias.numel(),
    }


def resume_matches(rank: int, world_size: int, stage: int) -> float:
    """Max |difference| between 6 straight steps and 3 steps + save + load into a fresh run + 3 steps."""

    def run(model, opt, steps):
        for step in steps:
            x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
            model(local_slice(x, rank, world_size), local_slice(y, rank, world_size), step % 2 == 1).backward()
            opt.step()
            opt.zero_grad()

    def fresh():
        model = build_model()
        return model, ZeroOptimizer(make_optimizer("adamw", model), model, stage=stage, bucket_size_mb=BUCKET_MB)

    model, opt = fresh()
    run(model, opt, range(3))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    run(model, opt, range(3, 6))
    model2, opt2 = fresh()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    run(model2, opt2, range(3, 6))
    return float((flat_params(model) - flat_params(model2)).abs().max())


def gpt2_parity(rank: int, world_size: int, stage: int) -> dict | None:
    """Hugging Face GPT-2 (random weights, built from a config): ||params - single process||_2 for
    ZeroOptimizer and for DDP (the noise floor), after a few AdamW steps."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)

    def run(mode: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()  # eval: dropout off, so ranks and reference agree
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = model
        if mode == "ddp":
            forward = DistributedDataParallel(model)
        elif mode == "zero":
            opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=BUCKET_MB)
        for step in range(4):
            x, _ = synthetic_batch(step, GLOBAL_BATCH, CFG)
            if mode != "reference":
                x = local_slice(x, rank, world_size)
            forward(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model)

    ref = run("reference")
    return {mode: float((run(mode) - ref).norm()) for mode in ("zero", "ddp")}


def world_checks(rank: int, world_size: int) -> dict:
    """Everything one world runs: parity runs (DDP and each stage), memory, resume, GPT-2."""
    runs = {}
    for kind, scenario in SCENARIOS:
        if rank == 0:  # in the same process as the runs it is compared with (same threads, same kernels)
            runs[(kind, scenario, "reference")] = train(kind, scenario, 0, 1, "reference")
        for mode in ("ddp",) + tuple(f"stage{s}" for s in STAGES):
            runs[(kind, scenario, mode)] = train(kind, scenario, rank, world_size, mode)
    return {
        "runs": runs,
        "memory": {stage: memory_after_step(rank, world_size, stage) for stage in STAGES},
        "resume": {stage: resume_matches(rank, world_size, stage) for stage in STAGES},
        "gpt2": gpt2_parity(rank, world_size, 2),
    }
