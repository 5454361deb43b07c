"""``offload.ratio="auto"``: the planner's partial offload, chosen when :class:`zero.ZeroOptimizer` is built.

The estimator prices one step of this rank (``zero.estimator``: the model's forward and backward traced on fake
tensors, replayed with the optimizer's own buckets, and the wrapped optimizers' steps, one or several, each on the
path it steps on: a whole-parameter optimizer's state and step on the rank that owns the parameter) at each ratio
where one more bucket goes to the host, and the smallest ratio whose peak fits the budget is taken
(``zero.estimator.partial_offload.least_offload``): as much of the optimizer side as fits stays on the device and
steps there, in parallel with the host's part. Tracing needs the loss and one micro-batch, which the constructor does
not otherwise have: :class:`StepExample` carries them.

The budget is ``offload.gpu_memory`` if given, else what the device can give this process when the optimizer is
built (``torch.cuda.mem_get_info()``'s free bytes plus what torch's caching allocator already holds, the model's
parameters included, since the estimate counts them), times a headroom of 0.9 (as ``zero.estimator.plan``: the rest
is the allocator's fragmentation and what the estimate does not see, such as library workspaces). Each rank prices
its own budget and every rank takes the largest ratio any of them needs: the buckets' placements, and so the order in
which they step and share their parameters, must be the same on every rank.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from zero.comm.communicator import Communicator
from zero.config import ZeroConfig
from zero.estimator import Workload, estimate
from zero.estimator.configuration import Units
from zero.estimator.estimator import HEADROOM
from zero.estimator.partial_offload import least_offload, offload_boundaries
from zero.runtime.build import model_device
from zero.runtime.step.inner import as_list, same_kind
from zero.sizes import format_bytes


@dataclass(frozen=True)
class StepExample:
    """One training step of this rank, for ``offload.ratio="auto"``: ``loss(model, *batch)`` returns the scalar loss
    exactly as the training loop computes it (e.g. ``lambda model, x, y: F.cross_entropy(model(x), y)``), and
    ``batch`` is one micro-batch of this rank (real tensors, or anything with their shapes and dtypes)."""

    loss: Callable[..., torch.Tensor]
    batch: tuple


def resolve_config(config: ZeroConfig | None, overrides: dict[str, Any], optimizer: Any,
                   model: nn.Module, example: StepExample | None, process_group: Any,
                   device: torch.device | str | None) -> ZeroConfig:
    """``config`` with ``overrides`` applied, and ``offload.ratio="auto"`` replaced by the ratio chosen for
    ``example`` (see the module docstring)."""
    if config is None:
        config = ZeroConfig(**overrides)
    elif not isinstance(config, ZeroConfig):
        raise ValueError(f"config must be a zero.ZeroConfig, got {type(config).__name__}")
    else:
        config = ZeroConfig(**{**config.model_dump(), **overrides})  # re-validated
    if config.offload.ratio != "auto":
        if example is not None:
            raise ValueError("example= is used only by offload.ratio='auto'; remove it, or set the ratio to 'auto'")
        return config
    comm = Communicator(process_group, config.timeout_s, device=model_device(model, device))
    say = comm.rank == 0
    # every rank prices its own budget; the most offload any rank needs is taken everywhere (the buckets' placements,
    # hence their step order, must agree), and an error on one rank is raised on all
    ratios = comm.everywhere(lambda: auto_ratio(config, optimizer, model, example, comm.world_size, comm.device, say,
                                                rank=comm.rank),
                             "choosing offload.ratio='auto'", share=True)
    if say and len(set(ratios)) > 1:
        _say(f"offload.ratio='auto': the ranks' budgets differ (ratios {sorted(set(ratios))}); every rank takes "
             f"{max(ratios):.4g}")
    return config.model_copy(update={"offload": config.offload.model_copy(update={"ratio": max(ratios)})})


def auto_ratio(config: ZeroConfig, optimizer: Any, model: nn.Module, example: StepExample | None,
               world_size: int, device: torch.device, say: bool = True, rank: int | None = None) -> float:
    """The smallest ``offload.ratio`` whose estimated peak fits this rank's budget (see the module docstring); with
    ``say``, says which and why on stderr. ``optimizer``: what ``ZeroOptimizer`` wraps, one optimizer or a list, each
    priced on the path it steps on (``zero.estimator.optimizers``); ``rank``: the rank priced (default: the worst, as
    ``zero.estimate`` chooses it; ranks differ with optimizers stepped on whole parameters)."""
    if example is None:
        raise ValueError(
            "offload.ratio='auto' prices the step with the estimator, which needs the loss and one micro-batch: pass "
            "example=zero.StepExample(loss=lambda model, x, y: ..., batch=(x, y)) to ZeroOptimizer, or choose the "
            "ratio with `zero estimate --gpu-memory` (or zero.estimator.plan) and set offload.ratio to it")
    budget = HEADROOM * _device_memory(config, device)
    workload = Workload(build=lambda: _fake_copy(model, device), loss=example.loss, batch=lambda micro: example.batch,
                        optimizers=partial(_same_optimizers, optimizer, model))
    if say:
        _say(f"offload.ratio='auto': pricing one step at each ratio (budget {format_bytes(budget)})")

    def priced(ratio: float) -> Any:  # (the configuration that will run, at this ratio)
        return estimate(workload, config, world_size=world_size, micro_batch=1, rank=rank,
                        offload={**config.offload.model_dump(exclude_unset=True), "ratio": ratio, "gpu_memory": None})

    full = priced(1.0)
    if full.peak > budget:
        raise ValueError(
            f"offload.ratio='auto': even the whole optimizer side on the host needs {format_bytes(full.peak)} of "
            f"device memory at {full.event} ({full.phase}), over the budget of {format_bytes(budget)}. Offload "
            "parameters too (offload.params='cpu', stage 3), checkpoint activations, use a smaller micro-batch or "
            "more ranks (see `zero estimate --gpu-memory`)")
    layout = workload.layout(config.stage, full.group_size, config.precision, config.bucket_size_mb,
                             units=Units.of(config))
    chosen = least_offload(priced, offload_boundaries(layout), full, budget)
    if say:
        _say(f"offload.ratio='auto' -> {chosen.offload_ratio:.4g}: estimated peak {format_bytes(chosen.peak)} of the "
         f"budget {format_bytes(budget)} (less offload would not fit; full offload: {format_bytes(full.peak)})")
    return chosen.offload_ratio


def _same_optimizers(optimizers: Any, model: nn.Module, fake: nn.Module) -> list[torch.optim.Optimizer]:
    """``optimizers`` (one or a list, over ``model``'s parameters) rebuilt over the same parameters of ``fake`` (its
    copy), with the same classes, defaults and groups."""
    fakes = dict(fake.named_parameters())
    names = {p: name for name, p in model.named_parameters()}
    rebuilt = []
    for optimizer in as_list(optimizers):
        groups = []
        for group in getattr(optimizer, "param_groups", []):  # (ZeroOptimizer's own checks name what is not one)
            if any(p not in names for p in group["params"]):
                raise ValueError("the optimizer holds a parameter that is not in the model passed to ZeroOptimizer. "
                                 "Build the optimizer from model.parameters() of the same model you pass in.")
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [fakes[names[p]] for p in group["params"]]})
        rebuilt.append(same_kind(optimizer, groups) if groups else optimizer)
    return rebuilt


def _device_memory(config: ZeroConfig, device: torch.device) -> float:
    if config.offload.gpu_memory is not None:
        return config.offload.gpu_memory
    if device.type != "cuda":
        raise ValueError(f"offload.ratio='auto' on a {device.type} device: set offload.gpu_memory (the bytes the "
                         "device may hold); it is measured only on CUDA")
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _fake_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are new tensors of the same shapes on ``device``, made under
    the estimator's fake-tensor mode (no storage is copied or allocated; shared parameters stay shared)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def _say(text: str) -> None:
    print(f"zero: {text}", file=sys.stderr, flush=True)
