"""``offload_inputs=True``: the inputs of checkpointed blocks kept in host memory (pinned with a GPU) from forward
until the recomputation brings them back to the compute device."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class _Hooks(Protocol):
    """What :meth:`InputOffload.to_host` reads of a block's checkpoint hooks
    (:class:`zero.runtime.activations.checkpointing.CheckpointHooks`, not imported: that module imports this one)."""

    enabled: bool


def _map_tensors(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    convert = lambda v: fn(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


class InputOffload:
    """The hooks that keep checkpointed blocks' inputs in host memory, and the bytes they moved there."""

    def __init__(self) -> None:
        self.bytes_offloaded = 0
        self._devices: dict[int, torch.device] = {}  # id(module) -> where its inputs came from

    def to_host(self, module: nn.Module, hooks: _Hooks, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Before checkpointing takes the inputs: copies in host memory (what it keeps for the recomputation);
        nothing when recomputing (the inputs are those copies)."""
        if not torch.is_grad_enabled() or not hooks.enabled:
            return args, kwargs
        self._devices[id(module)] = next((a.device for a in args if isinstance(a, torch.Tensor)), None)

        def down(t: torch.Tensor) -> torch.Tensor:
            self.bytes_offloaded += t.numel() * t.element_size()
            return _ToHost.apply(t) if t.requires_grad else _host_copy(t)

        return _map_tensors(down, args, kwargs)

    def to_device(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Inside the checkpointed region (also when recomputing): the inputs back on the compute device."""
        device = self._devices.get(id(module))
        if device is None or not torch.is_grad_enabled():
            return args, kwargs
        return _map_tensors(lambda t: t.to(device, non_blocking=True, copy=True), args, kwargs)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned, and copied asynchronously, when ``t`` is on a GPU)."""
    pin = t.device.type == "cuda"
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    host.copy_(t.detach(), non_blocking=pin)
    return host


class _ToHost(torch.autograd.Function):
    """:func:`_host_copy` as an autograd op: the gradient goes back to ``t``'s device."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.device = t.device
        return _host_copy(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.device)
