"""In-place operations in their world (issue 33): a torchvision-style ResNet (``ReLU(inplace=True)``, the
residual ``out += identity``; at stage 3 each ``BasicBlock`` a unit) and blocks whose forward starts by modifying
its input in place (stage 3's default units), at every stage, against DDP and single-process PyTorch."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from tests.inplace import InplaceNet, TinyResNet, resnet_batch, resnet_loss
from tests.readouts import flat_params
from tests.toy import batch
from zero import ZeroOptimizer
from zero.models import local_slice

MODES = ("reference", "ddp", "stage0", "stage1", "stage2", "stage3")
STEPS = 3


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyResNet() if name == "resnet" else InplaceNet()


def _loss(name: str, model: torch.nn.Module, step: int, rank: int, world_size: int) -> torch.Tensor:
    if name == "resnet":
        x, y = resnet_batch(step)
        return resnet_loss(model, local_slice(x, rank, world_size), local_slice(y, rank, world_size))
    return model(local_slice(batch(step), rank, world_size))


def run(name: str, mode: str, rank: int, world_size: int) -> dict:
    """SGD with momentum (runs stay within rounding of each other), ``STEPS`` steps; this rank's losses and the
    whole parameters afterwards."""
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    forward = model
    if mode == "reference":
        rank, world_size = 0, 1
    elif mode == "ddp":
        forward = DistributedDataParallel(model)
    else:
        stage = int(mode[-1])
        units = {"unit_classes": ("BasicBlock",)} if name == "resnet" and stage == 3 else {}
        opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=1e-3, **units)
    losses = []
    for step in range(STEPS):
        loss = _loss(name, forward, step, rank, world_size)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": flat_params(model, opt)}


def inplace_checks(rank: int, world_size: int) -> dict:
    """Per (model, mode): :func:`run`'s losses and parameters (the reference on rank 0 only)."""
    return {(name, mode): run(name, mode, rank, world_size) for name in ("resnet", "inplace") for mode in MODES
            if mode != "reference" or rank == 0}
