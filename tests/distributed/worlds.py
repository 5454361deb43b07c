"""The parity world (``test_parity_world.py``): what each rank runs, and the single-process reference.

Its model (``ParityNet``), optimizers and training loop (``train``) are also what the other worlds build on.
One world per world size runs every check and returns plain data; the tests compare it with the reference.
"""

from __future__ import annotations

import copy
import gc
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.harness import global_mean
from tests.readouts import flat_params, max_diff, settled_live_bytes, steady_live_bytes
from zero import ZeroOptimizer
from zero.memory import storage_bytes
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
STEPS = 7  # the last step has the first one's batch and branch (NUM_BATCHES, use_aux): their losses compare
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
    # SGD keeps runs within rounding of each other, so every step's norm is comparable (the first step's gradient,
    # the only norm Adam's noise leaves comparable, is the same under AdamW)
    ("sgd", "clip"),
    ("sgd", "edit"),  # rank 0 edits a parameter in gathered_parameters(modifier_rank=0) mid-run
    ("sgd", "passes3"),  # 3 backward passes per step, no no_sync(): accumulation the way DDP users write it
    ("sgd", "zero_grad_paths"),  # model.zero_grad(), zero_grad(set_to_none=False), none at all, in turn
    ("sgd", "finetune"),  # most of the GPT frozen, not in the optimizer; stage 3 shards it too
]
NUM_BATCHES = 3  # batches are revisited, so the loss visibly falls
STAGES = (0, 1, 2, 3)
MATRIX = {scenario: STAGES for scenario in SCENARIOS}  # the stages each scenario trains at
QUICK_MATRIX = {  # --quick: plain AdamW at every stage, each other path once, at the stage where it differs most
    ("adamw", "plain"): STAGES,
    ("adamw", "accum"): (2,),  # no_sync() over reduce-scatter hooks
    ("sgd", "clip"): (3,),  # the norm of sharded gradients
    ("sgd", "edit"): (3,),  # a parameter gathered, edited and sharded again
    ("sgd", "passes3"): (1,),
    ("sgd", "zero_grad_paths"): (2,),
    ("sgd", "finetune"): (3,),  # frozen parameters sharded
}
EDIT_STEP = 4


class ParityNet(nn.Module):
    """A tied-embedding GPT plus the awkward cases: a 1-element parameter (fewer elements than
    ranks), a module used only on odd steps (no gradient anywhere on even steps), a frozen
    parameter, a buffer, and (at stage 3) a block called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CFG)
        self.scale = nn.Parameter(torch.ones(1))
        self.aux = nn.Linear(CFG.vocab_size, CFG.vocab_size)
        self.frozen_bias = nn.Parameter(torch.randn(CFG.vocab_size) * 0.01, requires_grad=False)
        self.register_buffer("temperature", torch.tensor(1.25))
        self.twice = nn.ModuleList([nn.Linear(CFG.vocab_size, CFG.vocab_size)])  # a stage-3 unit, called twice

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_aux: bool) -> torch.Tensor:
        logits = self.gpt(idx) * self.scale / self.temperature + self.frozen_bias
        logits = logits + 0.1 * self.twice[0](torch.tanh(self.twice[0](logits)))
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


def edit(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """Scale one LayerNorm weight on rank 0; ZeroOptimizer shares the edit from rank 0."""
    zero = isinstance(opt, ZeroOptimizer)
    with opt.gathered_parameters(model.gpt.ln_f, modifier_rank=0) if zero else torch.no_grad():
        if rank == 0 or not zero:
            with torch.no_grad():
                model.gpt.ln_f.weight.mul_(1.5)


def train(kind: str, scenario: str, rank: int, world_size: int, mode: str, steps: int = STEPS, *,
          global_batch: int = GLOBAL_BATCH, settings: dict | None = None) -> dict:
    """Train ``steps`` steps; ``mode`` is "reference" (one process, whole batch), "ddp" or "stage{0,1,2,3}";
    ``settings``: more ``ZeroConfig`` fields for the ZeroOptimizer."""
    model = build_model()
    if scenario == "finetune":  # the blocks' linear layers frozen; their LayerNorms and the rest trained
        for name, p in model.gpt.blocks.named_parameters():
            p.requires_grad_(".ln" in name)
        cls, kwargs = OPTIMIZERS[kind]
        optimizer = cls([p for p in model.parameters() if p.requires_grad], **kwargs)  # the usual fine-tuning call
    else:
        optimizer = make_optimizer(kind, model)
    micro = {"accum": 2, "passes3": 3}.get(scenario, 1)
    if mode == "reference":
        rank, world_size, micro_splits = 0, 1, 1
        forward, opt, no_sync = model, optimizer, nullcontext
    elif mode == "ddp":
        forward = DistributedDataParallel(model, find_unused_parameters=True)
        opt, no_sync, micro_splits = optimizer, forward.no_sync, micro
    else:
        opt = ZeroOptimizer(optimizer, model, stage=int(mode[-1]), bucket_size_mb=BUCKET_MB, **(settings or {}))
        forward, no_sync, micro_splits = model, opt.no_sync, micro
    if scenario == "passes3":
        no_sync = nullcontext  # every pass reduces: gradients accumulate across synchronized passes
    losses, norms = [], []
    for step in range(steps):
        if scenario == "edit" and step == EDIT_STEP:
            edit(model, opt, rank)
        x, y = synthetic_batch(step % NUM_BATCHES, global_batch * micro, CFG)
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
        zero_grad(scenario, step, model, opt)
        losses.append(global_mean(total, world_size))
    out = {"losses": losses, "norms": norms, "params": flat_params(model, opt)}
    if scenario == "finetune" and isinstance(opt, ZeroOptimizer):
        with opt.gathered_parameters(model):  # the frozen GPT is not in the optimizer: still gathered
            out["params_in_block"] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        out["model_state"] = opt.model_state_bytes()
        out["frozen_numel"] = opt.partition.frozen_numel
        out["frozen_padded"] = sum(b.layout.padded_numel for b in opt.buckets if not b.trainable)
        out["num_buckets"] = len(opt.buckets)
    if isinstance(opt, ZeroOptimizer):
        out["comm_stats"] = opt.comm_stats
        out["numel"], out["padded_numel"] = opt.partition.numel, opt.partition.padded_numel
        out["num_buckets"], out["num_params"] = len(opt.buckets), len(opt.partition.slots)
    return out


def zero_grad(scenario: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """How gradients are cleared after each step: the optimizer's zero_grad(), or, in the
    "zero_grad_paths" scenario, what Hugging Face Trainer and hand-written loops do instead."""
    if scenario != "zero_grad_paths":
        opt.zero_grad()
    elif step % 3 == 0:
        model.zero_grad()  # p.grad = None, as Trainer does
    elif step % 3 == 1:
        model.zero_grad(set_to_none=False)  # zeros: parameters keep a (zero) gradient
    # step % 3 == 2: no clearing at all, the next step's gradients add to these (as PyTorch does)


def _micro_batches(x: torch.Tensor, y: torch.Tensor, splits: int):
    for i, (xm, ym) in enumerate(zip(x.chunk(splits), y.chunk(splits))):
        yield xm, ym, i == splits - 1


def _torch_clip(model: nn.Module):
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def memory_after_step(rank: int, world_size: int, stage: int) -> dict:
    """Live CPU tensor bytes after one AdamW step, against what the optimizer says it holds."""
    gc.collect()
    baseline = steady_live_bytes()
    model = build_model()
    opt = ZeroOptimizer(make_optimizer("adamw", model), model, stage=stage, bucket_size_mb=BUCKET_MB)
    x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
    model(local_slice(x, rank, world_size), local_slice(y, rank, world_size), True).backward()
    opt.step()
    del x, y
    buffers = storage_bytes(model.buffers())
    state = opt.model_state_bytes()
    measured = settled_live_bytes(baseline, state.total + buffers)
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
    with opt.gathered_parameters():  # stage 3: parameters are whole only inside
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    run(model, opt, range(3, 6))
    model2, opt2 = fresh()
    with opt2.gathered_parameters():
        model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    run(model2, opt2, range(3, 6))
    return max_diff(flat_params(model, opt), flat_params(model2, opt2))


def parity_checks(rank: int, world_size: int, matrix: dict = MATRIX) -> dict:
    """Everything the parity world runs: each scenario of ``matrix`` single-process (rank 0), under DDP and at its
    stages; the memory after a step and resuming from a state dict at each stage."""
    runs = {}
    for (kind, scenario), stages in matrix.items():
        if rank == 0:  # in the same process as the runs it is compared with (same threads, same kernels)
            runs[(kind, scenario, "reference")] = train(kind, scenario, 0, 1, "reference")
        for mode in ("ddp",) + tuple(f"stage{s}" for s in stages):
            runs[(kind, scenario, mode)] = train(kind, scenario, rank, world_size, mode)
    return {
        "matrix": matrix,
        "runs": runs,
        "memory": {stage: memory_after_step(rank, world_size, stage) for stage in STAGES},
        "resume": {stage: resume_matches(rank, world_size, stage) for stage in STAGES},
    }
