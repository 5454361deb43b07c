"""The older forward-only census of a model (:func:`trace`): saved bytes per block, matmul outputs, what activation
checkpointing keeps per unit. Activation-checkpointing policies use it (:func:`zero.blocks_within_budget`); the
memory estimate is :mod:`zero.estimator.estimator`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero.activations import MATMULS
from zero.estimator.failure import describe_failure
from zero.runtime.buffers.units import plan_units


@dataclass(frozen=True)
class Trace:
    """What one fake forward found (for one micro-batch)."""

    numel: int
    activation_bytes: int  # saved for backward, parameters excluded
    unit_activation_bytes: dict[str, int]  # saved while each unit's forward ran (outermost first)
    unit_input_bytes: dict[str, int]  # what activation checkpointing keeps per unit
    unit_matmul_bytes: dict[str, int] = field(default_factory=dict)  # matmul outputs per unit (selective checkpointing)


def trace(build_fn: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor], batch: tuple) -> Trace:
    """Build the model and run ``loss_fn(model, *batch)`` on fake tensors (no memory is used).

    ``batch`` holds real tensors or shapes' worth of example inputs; they are faked too.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = build_fn()
            fake_batch = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
            return _trace_fake(model, loss_fn, fake_batch)
    except Exception as err:  # a model or loss that cannot run without data
        raise ValueError(describe_failure("tracing the model", err)) from err


def _trace_fake(model: nn.Module, loss_fn, batch: tuple) -> Trace:
    params = list(model.parameters())
    param_storages = {p.untyped_storage()._cdata for p in params}
    units = plan_units(model, [p for p in params if p.requires_grad], unit_classes=None, unit_size_bytes=None)
    saved: dict[int, int] = {}
    per_unit: dict[str, int] = {u.name: 0 for u in units}
    inputs: dict[str, int] = {u.name: 0 for u in units}
    stack = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            per_unit[stack[-1]] += saved[key]
        return t

    matmuls: dict[str, int] = {u.name: 0 for u in units}
    hooks = []
    for unit in units:
        if unit.name:
            hooks.append(unit.module.register_forward_pre_hook(_enter(stack, inputs, unit.name)))
            hooks.append(unit.module.register_forward_hook(_leave(stack)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _MatmulOutputs(stack, matmuls):
            loss = loss_fn(model, *batch)
    finally:
        for hook in hooks:
            hook.remove()
    if loss.grad_fn is None:
        raise ValueError("loss_fn returned a tensor with no gradient: nothing to train")
    return Trace(
        numel=sum(p.numel() for p in params if p.requires_grad),
        activation_bytes=sum(saved.values()),
        unit_activation_bytes=per_unit,
        unit_input_bytes=inputs,
        unit_matmul_bytes=matmuls,
    )


class _MatmulOutputs(TorchDispatchMode):
    """Adds the bytes of each matmul's output to the unit running it (what selective checkpointing saves)."""

    def __init__(self, stack: list[str], totals: dict[str, int]):
        super().__init__()
        self.stack, self.totals = stack, totals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS and self.stack[-1] in self.totals:
            tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            self.totals[self.stack[-1]] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _enter(stack: list[str], inputs: dict[str, int], name: str):
    def enter(module: nn.Module, args: Any) -> None:
        stack.append(name)
        inputs[name] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    return enter


def _leave(stack: list[str]):
    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    return leave
