"""The hand-built recipes that ZeroOptimizer is compared with: mixed precision (the pattern of FSDP2's own
mixed-precision tests, also under ``torch.amp.GradScaler``) and ZeRO-Offload's one-step delayed update."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn


class SeveralOptimizers:
    """Several torch optimizers stepped and cleared as one (a single-process reference's ``opt``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()


class MasterRecipe:
    """A low-precision copy of ``model`` for forward and backward; after backward its gradients are cast
    to fp32 onto an fp32 master copy, which ``make_optimizer`` steps and which is then cast back."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, make_optimizer: Callable[[list], torch.optim.Optimizer],
                 master_device: torch.device | str | None = None):
        """``master_device``: where the masters live and step (default: the model's device; ``"cpu"``: the step on
        the host, as with optimizer offload)."""
        self.master = [p.detach().float().to(master_device or p.device, copy=True).requires_grad_()
                       for p in model.parameters()]
        self.low = copy.deepcopy(model).to(dtype)
        self.opt = make_optimizer(self.master)

    def grads_to_master(self) -> None:
        for m, p in zip(self.master, self.low.parameters()):
            m.grad = None if p.grad is None else p.grad.float().to(m.device)

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Step the master (through ``scaler`` if given), clear gradients, cast back; returns whether the
        step was skipped (no master value changed)."""
        before = [m.detach().clone() for m in self.master]
        if scaler is None:
            self.opt.step()
        else:
            scaler.step(self.opt)
            scaler.update()
        self.opt.zero_grad()
        self.low.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.master, self.low.parameters()):
                p.copy_(m)
        return all(torch.equal(a, m) for a, m in zip(before, self.master))

    def flat(self) -> torch.Tensor:
        return torch.cat([m.detach().flatten() for m in self.master])


def grad_scaler_run(model: nn.Module, make_optimizer: Callable[[list], torch.optim.Optimizer],
                    loss_of: Callable[[nn.Module, int], torch.Tensor], steps: int, **scaler: Any) -> dict:
    """``torch.amp.GradScaler("cpu", **scaler)`` over the hand-built fp16 recipe of ``model`` in one process,
    ``loss_of(low, step)`` the loss of each step: the scale after each step, whether it was skipped, and the
    masters at the end."""
    r = MasterRecipe(model, torch.float16, make_optimizer)
    grad_scaler = torch.amp.GradScaler("cpu", **scaler)
    scales, skipped = [], []
    for step in range(steps):
        grad_scaler.scale(loss_of(r.low, step)).backward()
        r.grads_to_master()
        skipped.append(r.step(grad_scaler))
        scales.append(grad_scaler.get_scale())
    return {"scales": scales, "skipped": skipped, "masters": r.flat()}


class DelayedRecipe:
    """ZeRO-Offload's one-step delayed update by hand, on a plain model: each step's gradients are applied
    (to an fp32 master copy, with the hyperparameters of the step that produced them) at the next step."""

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list], torch.optim.Optimizer]):
        self.model = model
        self.master = [p.detach().clone().requires_grad_() for p in model.parameters()]
        self.opt = make_optimizer(self.master)
        self.pending: tuple[list, list] | None = None  # (gradients, hyperparameters of each group)

    def step(self) -> None:
        """Apply the previous step's gradients, then hand over this step's (and clear the model's)."""
        self.flush()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        self.pending = ([None if p.grad is None else p.grad.clone() for p in self.model.parameters()], hyper)
        self.model.zero_grad()

    def flush(self) -> None:
        if self.pending is None:
            return
        grads, hyper = self.pending
        now = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        for group, h in zip(self.opt.param_groups, hyper):
            group.update(h)
        for m, g in zip(self.master, grads):
            m.grad = g
        self.opt.step()
        for group, h in zip(self.opt.param_groups, now):
            group.update(h)
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.master):
                p.copy_(m)
        self.pending = None
