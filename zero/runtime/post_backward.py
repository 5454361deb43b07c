"""Knowing when a module's backward is over: a hook on the gradients of its forward inputs.

Note: a module's parameters are read by backward until autograd has computed the gradient of
every input of its forward that needs one (frozen weights included: they carry the gradient back
to earlier modules, e.g. LoRA adapters on a frozen base). The last parameter gradient to arrive
does not say that, the gradient of the inputs does. :func:`hook_input_gradients` passes the
floating-point inputs that require grad through an identity autograd function whose backward
runs once autograd has summed the gradient of all of them, that is when the module's backward is
over (FSDP2 does the same). A forward whose inputs need no gradient gets no hook.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _InputGradients(torch.autograd.Function):
    """Identity on the inputs; ``callback()`` runs in backward when their gradients are complete."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def hook_input_gradients(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with every tensor that requires grad passed through one autograd function
    whose backward calls ``callback()``; ``None`` (nothing to hook) when no input requires grad or
    grad mode is off."""
    if not torch.is_grad_enabled():
        return None
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not at:
        return None
    hooked = _InputGradients.apply(callback, *(leaves[i] for i in at))
    for i, tensor in zip(at, hooked):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)
