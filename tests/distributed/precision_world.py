"""Mixed precision in their world (``test_precision_world.py``): what each rank runs, and the single-process references.

* bf16 parity: every stage (reduce in fp32 and in bf16) against the hand-built single-process
  recipe (a bf16 copy of the model, fp32 gradients on an fp32 master stepped by AdamW, cast
  back), next to DDP running the same recipe, whose deviation is the noise floor;
* fp16 overflows injected on one rank only: the skipped steps and the scale sequence of every
  rank against ``torch.amp.GradScaler`` in one process;
* memory after a step against the ZeRO paper's mixed-precision formulas, and traffic by dtype.

``MATRIX`` says which stages and dtypes each part runs at (``QUICK_MATRIX`` under ``--quick``).
"""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.readouts import master_weights, settled_live_bytes, steady_live_bytes
from tests.recipes import MasterRecipe, grad_scaler_run
from tests.toy import FreshTensors, Net, batch
from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 6
STAGES = (0, 1, 2, 3)
BF16_STEPS = 6
FP16_STEPS = 8
OVERFLOW_STEPS = (1, 4, 5)  # the loss times 1e30 on these steps, on one rank only
FP16_POLICY = {"param_dtype": "fp16", "loss_scale": {"init_scale": 2.0**10, "growth_interval": 2}}
MATRIX = {  # what the world runs: bf16 parity (stage: reduce dtypes), fp16 overflows (stages), memory (stage: dtypes)
    "bf16": {stage: (None, "bf16") for stage in STAGES},
    "fp16": STAGES,
    "memory": {stage: ("bf16", "fp32") for stage in STAGES},
}
QUICK_MATRIX = {  # --quick: bf16 at every stage (the default fp32 reduction), each other path once, where it differs
    # bf16 reduction at stage 1: reduce-scattered in place in the whole bf16 gradient buffer (no staging buffer,
    # no separate fp32 shard beside it), the path furthest from the default's
    "bf16": {0: (None,), 1: (None, "bf16"), 2: (None,), 3: (None,)},
    "fp16": (3,),  # a skipped step at stage 3: local gradients checked before they are freed, shards left as they were
    # memory at stage 1: whole gradients beside a reduced shard, the only stage that keeps both (the fp32 reduction's
    # shard beside the bf16 buffer; its staging buffer freed). Every stage's fp32 formula: test_parity_world.py
    "memory": {1: ("bf16", "fp32")},
}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def transients_freed(opt: ZeroOptimizer) -> bool:
    """Whether the separate staging buffers and fp32 gradient copies are released (after a step)."""
    staging = [b.buffers["staging"] for b in opt.buckets if "staging" in b.buffers]  # (else: the gradient buffer)
    copies = [b.buffers["master_grad"] for b in opt.buckets if "master_grad" in b.buffers]
    return bool(staging + copies) and not any(buffer.is_allocated for buffer in staging + copies)


def recipe(rank: int, world_size: int, ddp: bool) -> torch.Tensor:
    """The hand-built bf16 recipe, in one process on the whole batch or under DDP on this rank's share."""
    r = MasterRecipe(_gpt(), torch.bfloat16, _adamw)
    forward = DistributedDataParallel(r.low) if ddp else r.low
    for step in range(BF16_STEPS):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        if ddp:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        nn.functional.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
        r.grads_to_master()
        r.step()
    return r.flat()


def bf16_run(rank: int, world_size: int, stage: int, reduce_dtype: str | None) -> dict:
    model = _gpt()
    precision = {"param_dtype": "bf16", "reduce_dtype": reduce_dtype}
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=precision, bucket_size_mb=0.01)
    for step in range(BF16_STEPS):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        opt.backward(model.loss(local_slice(x, rank, world_size), local_slice(y, rank, world_size)))
        opt.step()
        opt.zero_grad()
    return {
        "masters": master_weights(opt),
        "comm_stats": opt.comm_stats,
        "padded_numel": opt.partition.padded_numel,
        "transients_freed": transients_freed(opt),
    }


def bf16_parity(rank: int, world_size: int, runs: dict) -> dict:
    """The recipe under DDP, in one process (rank 0), and ZeroOptimizer under bf16 at each stage of ``runs`` with
    each of its reduce dtypes."""
    out = {"ddp": recipe(rank, world_size, ddp=True)}
    if rank == 0:
        out["reference"] = recipe(0, 1, ddp=False)
    for stage, reduce_dtypes in runs.items():
        for reduce_dtype in reduce_dtypes:
            out[(stage, reduce_dtype)] = bf16_run(rank, world_size, stage, reduce_dtype)
    return out


def _fp16_loss(model: nn.Module, x: torch.Tensor, step: int, overflow: bool) -> torch.Tensor:
    loss = model(x, step % 2 == 1)
    return loss * 1e30 if overflow and step in OVERFLOW_STEPS else loss  # inf in fp16


def grad_scaler_reference() -> dict:
    """One process, the whole batch, GradScaler over the hand-built fp16 recipe."""
    loss_of = lambda low, step: _fp16_loss(low, batch(step).half(), step, overflow=True)  # noqa: E731
    return grad_scaler_run(Net(), _adamw, loss_of, FP16_STEPS, init_scale=2.0**10, growth_interval=2)


def fp16_overflows(rank: int, world_size: int, stage: int) -> dict:
    """Overflows injected on the last rank only; every rank must skip the same steps."""
    model = Net()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=FP16_POLICY, bucket_size_mb=1e-4)
    scales, skipped = [], []
    for step in range(FP16_STEPS):
        x = local_slice(batch(step), rank, world_size)
        opt.backward(_fp16_loss(model, x, step, overflow=rank == world_size - 1))
        before = master_weights(opt)
        opt.step()
        skipped.append(torch.equal(before, master_weights(opt)))
        scales.append(opt.loss_scaler.scale)
        opt.zero_grad()
    return {"scales": scales, "skipped": skipped, "masters": master_weights(opt)}


def mixed_memory(rank: int, world_size: int, stage: int, reduce_dtype: str) -> dict:
    """Live CPU bytes after one AdamW step under bf16, against what the optimizer says it holds."""
    gc.collect()
    baseline = steady_live_bytes()
    model = _gpt()
    precision = {"param_dtype": "bf16", "reduce_dtype": reduce_dtype}
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=precision, bucket_size_mb=0.01)
    x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
    opt.backward(model.loss(local_slice(x, rank, world_size), local_slice(y, rank, world_size)))
    opt.step()
    del x, y
    state = opt.model_state_bytes()
    held = state.total + sum(b.numel() * b.element_size() for b in model.buffers())
    measured = settled_live_bytes(baseline, held)
    return {
        "measured": measured,
        "held": held,
        "parameters": state.parameters,
        "gradients": state.gradients,
        "optimizer_state": state.optimizer_state,
        "numel": opt.partition.numel,
        "padded_numel": opt.partition.padded_numel,
        "transients_freed": transients_freed(opt),
    }


def fresh_tensors(rank: int, world_size: int, mode: str) -> torch.Tensor:
    """``FreshTensors`` under bf16 (issue 37): ``mode`` "reference" (its recipe in one process, whole batch),
    "ddp" (the recipe under DDP) or "stage{0..3}" (ZeroOptimizer, which casts where the recipe casts by hand); this
    rank's view of the masters after 4 AdamW steps."""
    torch.manual_seed(0)
    if mode in ("reference", "ddp"):
        r = MasterRecipe(FreshTensors(recipe=True), torch.bfloat16, _adamw)
        forward = DistributedDataParallel(r.low) if mode == "ddp" else r.low
        for step in range(4):
            x = batch(step) if mode == "reference" else local_slice(batch(step), rank, world_size)
            forward(x.bfloat16()).backward()
            r.grads_to_master()
            r.step()
        return r.flat()
    model = FreshTensors()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=int(mode[-1]), precision={"param_dtype": "bf16"},
                        bucket_size_mb=1e-4)
    for step in range(4):
        opt.backward(model(local_slice(batch(step), rank, world_size)))
        opt.step()
        opt.zero_grad()
    return master_weights(opt)


def precision_checks(rank: int, world_size: int, matrix: dict = MATRIX) -> dict:
    """Everything this world runs (the module docstring): ``matrix``'s part of it (``QUICK_MATRIX`` under
    ``--quick``), returned with the results."""
    out = {"matrix": matrix, "bf16": bf16_parity(rank, world_size, matrix["bf16"])}
    modes = ("ddp", *(f"stage{stage}" for stage in STAGES)) + (("reference",) if rank == 0 else ())
    out["fresh"] = {mode: fresh_tensors(rank, world_size, mode) for mode in modes}
    if rank == 0:
        out["grad_scaler"] = grad_scaler_reference()
    out["fp16"] = {stage: fp16_overflows(rank, world_size, stage) for stage in matrix["fp16"]}
    out["memory"] = {
        (stage, reduce_dtype): mixed_memory(rank, world_size, stage, reduce_dtype)
        for stage, reduce_dtypes in matrix["memory"].items()
        for reduce_dtype in reduce_dtypes
    }
    return out
