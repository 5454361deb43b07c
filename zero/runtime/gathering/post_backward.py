"""Knowing when a module's backward is over: a hook on the gradients of its forward inputs.

Note: a module's parameters are read by backward until autograd has computed the gradient of
every input of its forward that needs one (frozen weights included: they carry the gradient back
to earlier modules, e.g. LoRA adapters on a frozen base). The last parameter gradient to arrive
does not say that, the gradient of the inputs does. :func:`hook_input_gradients` registers one
gradient hook over the floating-point inputs that require grad
(``torch.autograd.graph.register_multi_grad_hook``, mode ``"all"``): it runs once autograd has
computed the gradient of every one of them that this backward needs, that is when the module's
backward is over. A forward whose inputs need no gradient gets no hook.

Note: the inputs themselves are left untouched, so the forward may modify them in place
(``F.relu(x, inplace=True)``, ``x += y``, as torchvision's blocks do). An identity autograd
function whose outputs replaced the inputs (FSDP2's ``RegisterPostBackwardFunction``, this module's
first version) makes them views of a custom function, which autograd forbids modifying in place. A
hook registered before an in-place change still fires with the gradient of the value it was
registered on (the value the forward received), which is the last gradient the module computes.

A hook on a leaf (an input that is itself a leaf requiring grad, a parameter passed as an argument)
lives as long as the leaf: the caller removes the handle once the backward pass is over.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle


def hook_input_gradients(args: tuple, kwargs: dict, callback: Callable[[], None]) -> RemovableHandle | None:
    """Register ``callback()`` to run in backward once the gradients of every tensor in ``(args, kwargs)``
    that requires grad are computed; the hook's handle, or ``None`` (nothing to hook) when no input
    requires grad or grad mode is off."""
    if not torch.is_grad_enabled():
        return None
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs:
        return None
    return torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: callback(), mode="all")
