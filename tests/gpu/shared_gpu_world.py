"""What each of two ranks sharing one GPU runs over gloo (``test_cuda_two_ranks.py``): NCCL refuses two ranks on one
device, but gloo moves CUDA tensors too, so a one-GPU machine still exercises a multi-rank run's CUDA paths (the
side streams, events and pinned copies of offload, the reductions of uneven shards). Each run: stages 0-3, fp32 and
bf16 (reduced in bf16, as DDP reduces the bf16 copy's gradients), with and without optimizer offload, against DDP on
the same ranks (also over gloo) with the same global batch. (On the CPU, with the same code, every case equals DDP
bit for bit.)"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from tests.gpu.common import CFG
from tests.readouts import master_weights
from tests.recipes import MasterRecipe
from zero import ZeroOptimizer
from zero.models import GPT, local_slice, synthetic_batch

STEPS = 3
GLOBAL_BATCH = 4
CASES = [(stage, precision, offload) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")
         for offload in (False, True) if stage > 0 or not offload]


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
    return local_slice(x, rank, world_size).cuda(), local_slice(y, rank, world_size).cuda()


def ddp_run(rank: int, world_size: int, precision: str) -> torch.Tensor:
    """DDP over gloo on the GPU (bf16: the hand-built recipe, its bf16 copy wrapped in DDP); the masters."""
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    if precision == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        ddp = DistributedDataParallel(model)
        for step in range(STEPS):
            _loss(ddp, *_batch(step, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    recipe = MasterRecipe(model, torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))
    ddp = DistributedDataParallel(recipe.low)
    for step in range(STEPS):
        _loss(ddp, *_batch(step, rank, world_size)).backward()
        recipe.grads_to_master()
        recipe.step()
    return recipe.flat().cpu()


def _loss(forward: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``GPT.loss``, through ``forward`` (DDP calls the module's forward, not its ``loss``)."""
    return torch.nn.functional.cross_entropy(forward(x).flatten(0, 1), y.flatten())


def zero_run(rank: int, world_size: int, stage: int, precision: str, offload: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), model, stage=stage,
                        bucket_size_mb=0.05, step_kernel="torch",
                        precision={"param_dtype": "bf16", "reduce_dtype": "bf16"} if precision == "bf16" else {},
                        offload={"optimizer": "cpu"} if offload else {})
    for step in range(STEPS):
        x, y = _batch(step, rank, world_size)
        opt.backward(_loss(model, x, y))
        opt.step()
        opt.zero_grad()
    return master_weights(opt).cpu()


def shared_gpu_checks(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(0)
    out = {("ddp", precision): ddp_run(rank, world_size, precision) for precision in ("fp32", "bf16")}
    for case in CASES:
        out[case] = zero_run(rank, world_size, *case)
    return out
