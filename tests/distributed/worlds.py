"""What each rank runs in the multi-process tests; also the single-process reference.

One world per world size runs every check (spawning is the expensive part) and
returns plain data; the tests compare it with the reference.
"""

from __future__ import annotations

import copy
import gc
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.activations_world import activation_checks
from tests.distributed.autograd_world import autograd_checks
from tests.distributed.harness import global_mean
from tests.distributed.inplace_world import inplace_checks
from tests.distributed.offload_world import offload_checks
from tests.distributed.precision_world import precision_checks
from tests.distributed.profile_world import profile_checks
from tests.readouts import flat_params, max_diff, settled_live_bytes
from tests.toy import CheckpointedNet, batch, tiny_hf
from zero import ZeroOptimizer, init_sharded
from zero.memory import live_tensor_bytes, storage_bytes
from zero.models import GPT, GPTConfig, init_gpt_weights, local_slice, synthetic_batch

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
    ("sgd", "edit"),  # rank 0 edits a parameter in gathered_parameters(modifier_rank=0) mid-run
    ("sgd", "passes3"),  # 3 backward passes per step, no no_sync(): accumulation the way DDP users write it
    ("adamw", "passes3"),
    ("sgd", "zero_grad_paths"),  # model.zero_grad(), zero_grad(set_to_none=False), none at all, in turn
    ("sgd", "finetune"),  # most of the GPT frozen, not in the optimizer; stage 3 shards it too
]
NUM_BATCHES = 3  # batches are revisited, so the loss visibly falls
STAGES = (0, 1, 2, 3)
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


def stage3_traffic(rank: int, world_size: int, reshard_after_forward: bool) -> dict:
    """One stage-3 step's comm counters, with or without regathering for backward."""
    model = build_model()
    opt = ZeroOptimizer(
        make_optimizer("adamw", model), model, stage=3, reshard_after_forward=reshard_after_forward
    )
    for step in range(2):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        model(local_slice(x, rank, world_size), local_slice(y, rank, world_size), True).backward()
        opt.step()
        opt.zero_grad()
    unit_numel, unit_buckets = {}, {}  # each unit's buckets: its trainable one, and a frozen one (the root)
    for b in opt.buckets:
        unit_numel[b.unit.name] = unit_numel.get(b.unit.name, 0) + b.layout.padded_numel
        unit_buckets[b.unit.name] = unit_buckets.get(b.unit.name, 0) + 1
    return {
        "comm_stats": opt.comm_stats,
        "padded_numel": opt.partition.padded_numel,
        "gathered_numel": sum(b.layout.padded_numel for b in opt.buckets),
        "unit_numel": unit_numel,
        "unit_buckets": unit_buckets,
    }


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


def hf_parity(rank: int, world_size: int, stage: int, family: str) -> dict | None:
    """Hugging Face GPT-2 or Llama (random weights, built from a config): ||params - single process||_2
    for ZeroOptimizer and for DDP (the noise floor), after a few AdamW steps."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None

    def run(mode: str) -> torch.Tensor:
        model = tiny_hf(family, seed=0).eval()  # eval: dropout off, so ranks and reference agree
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
        return flat_params(model, opt)

    ref = run("reference")
    return {mode: float((run(mode) - ref).norm()) for mode in ("zero", "ddp")}


def meta_init_matches(rank: int, world_size: int) -> float:
    """Max |difference| between a GPT built normally and one built on meta + init_sharded (same seed)."""
    torch.manual_seed(1234)
    normal = flat_params(GPT(CFG))
    torch.manual_seed(1234)
    model, opt = init_sharded(
        lambda: GPT(CFG), lambda m: torch.optim.AdamW(m.parameters()), init_fn=init_gpt_weights
    )
    return max_diff(flat_params(model, opt), normal)


def inference_matches(rank: int, world_size: int) -> dict:
    """Stage-3 eval forward under no_grad vs the same model unsharded; and nothing stays gathered."""
    model = build_model().eval()
    x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
    with torch.no_grad():
        expected = model(x, y, True)
    opt = ZeroOptimizer(make_optimizer("adamw", model), model, stage=3)
    with torch.no_grad():
        got = model(x, y, True)
    gathered = sum(b.param_buffer.is_allocated for b in opt.buckets)
    return {"max_diff": max_diff(got, expected), "gathered_after": gathered}


def compiled_stage3_matches(rank: int, world_size: int) -> float:
    """Max |difference| between stage 3 under ``torch.compile(model)`` and stage 3 eager (3 SGD steps)."""

    def run(compiled: bool) -> torch.Tensor:
        torch._dynamo.reset()
        model = build_model()
        opt = ZeroOptimizer(make_optimizer("sgd", model), model, stage=3)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):
            x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
            forward(local_slice(x, rank, world_size), local_slice(y, rank, world_size), step % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    return max_diff(run(True), run(False))


def toy_paths(rank: int, world_size: int) -> dict:
    """Max |difference| from single-process PyTorch, per (case, stage), on the small ``CheckpointedNet``:
    "reentrant" (blocks under reentrant activation checkpointing) and "interrupted" (an error in the
    middle of a backward pass on step 1, then ``zero_grad()`` and the step again)."""

    def run(case: str, stage: int | None) -> torch.Tensor:
        model = CheckpointedNet(reentrant=case == "reentrant")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        if stage is not None:
            opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=1e-4)  # a bucket per parameter
        for step in range(4):
            x = batch(step) if stage is None else local_slice(batch(step), rank, world_size)
            if case == "interrupted" and step == 1:
                try:
                    model(x, boom=True).backward()
                except RuntimeError:
                    opt.zero_grad()
            model(x, step % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    out = {}
    for case in ("reentrant", "interrupted"):
        ref = run(case, None)
        for stage in STAGES:
            out[(case, stage)] = max_diff(run(case, stage), ref)
    return out


def world_checks(rank: int, world_size: int) -> dict:
    """Everything one world runs: parity runs (DDP and each stage), memory, resume, Hugging Face models,
    stage 3's traffic, meta initialization and inference, and the memory tracker's runs."""
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
        "gpt2": hf_parity(rank, world_size, 3, "gpt2"),
        "llama": hf_parity(rank, world_size, 3, "llama"),
        "traffic3": {keep: stage3_traffic(rank, world_size, keep) for keep in (True, False)},
        "meta_init": meta_init_matches(rank, world_size),
        "inference": inference_matches(rank, world_size),
        "compiled3": compiled_stage3_matches(rank, world_size),
        "toy_paths": toy_paths(rank, world_size),
        "profile": profile_checks(rank, world_size),
        "precision": precision_checks(rank, world_size),
        "offload": offload_checks(rank, world_size),
        "activations": activation_checks(rank, world_size),
        "inplace": inplace_checks(rank, world_size),
        "autograd": autograd_checks(rank, world_size),
    }
