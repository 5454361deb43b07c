"""What the tests read out of a model and its optimizer to compare runs: the whole parameters, the fp32 master
weights, and bytes (live tensors, what a forward saves for backward, ``zero.profile`` of a few steps). The
comparisons themselves, and their tolerances, stay in the tests."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

import zero
from zero import ZeroOptimizer
from zero.memory import live_tensor_bytes


def flat_params(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Every parameter, whole, in one flat tensor (gathered first when ``opt`` is a ZeroOptimizer)."""
    with opt.gathered_parameters() if isinstance(opt, ZeroOptimizer) else nullcontext():
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def master_weights(opt: ZeroOptimizer) -> torch.Tensor:
    """Every rank's fp32 master pieces assembled into the whole model (in model order), on every rank; without a
    process group (or in a world of one) this rank's pieces, which are all of them."""
    mine = [(p.slot.order, p.piece.param_start, p.tensor.detach().clone()) for b in opt.buckets for p in b.pieces]
    everyone = [mine]
    if dist.is_initialized() and opt.comm.world_size > 1:
        everyone = [None] * opt.comm.world_size
        dist.all_gather_object(everyone, mine)
    pieces = sorted({(o, s): t for rank in everyone for o, s, t in rank}.items())
    return torch.cat([t for _, t in pieces])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise |a - b|."""
    return float((a - b).abs().max())


def steady_live_bytes() -> int:
    """Live CPU tensor bytes once two readings a moment apart agree: a baseline taken while gloo's worker thread still
    held an earlier collective's tensor (seen once at 3 ranks: 8 KiB) would put every later figure below the truth."""
    now = live_tensor_bytes()
    for _ in range(5):
        time.sleep(0.05)
        now, before = live_tensor_bytes(), now
        if now == before:
            break
    return now


def settled_live_bytes(baseline: int, held: int) -> int:
    """Live CPU tensor bytes above ``baseline``, re-measured for a moment until they equal ``held``: gloo's
    worker thread may hold a finished collective's tensor briefly."""
    for _ in range(5):
        measured = live_tensor_bytes() - baseline
        if measured == held:
            break
        time.sleep(0.05)
    return measured


def forward_saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward in a real forward of ``model.loss(x, y)`` (parameters excluded, each
    storage counted once), counted with ``saved_tensors_hooks``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(x, y)
    return sum(saved.values())


def profiled_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int = 2,
                   **options):
    """``zero.profile(model, opt, **options)`` of ``steps`` steps on the batch ``x, y`` (``model.loss(x, y)``,
    backward, ``opt.step()``, ``opt.zero_grad()``); the profile."""
    with zero.profile(model, opt, **options) as prof:
        for _ in range(steps):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    return prof


def halfway_offload(workload, **kw) -> tuple[float, float]:
    """A budget halfway between ``workload``'s estimated peak without offload and with full CPU offload (``kw``:
    ``estimate``'s arguments, stage 1-3), and the least ``offload.ratio`` that fits it, as the planner and
    ``offload.ratio="auto"`` choose it."""
    from zero.estimator import estimate
    from zero.estimator.partial_offload import least_offload, offload_boundaries

    none, full = estimate(workload, **kw), estimate(workload, offload="cpu", **kw)
    budget = (none.peak + full.peak) / 2
    layout = workload.layout(kw["stage"], kw["world_size"], bucket_size_mb=kw.get("bucket_size_mb", 25))
    ratio = least_offload(lambda r: estimate(workload, offload="cpu", offload_ratio=r, **kw),
                          offload_boundaries(layout), full, budget).offload_ratio
    return budget, ratio
