"""Knowing when a module's backward is over: a hook on the gradients of its forward inputs.

Note: a module's parameters are read by backward until autograd has computed the gradient of
every input of its forward that needs one (frozen weights included: they carry the gradient back
to earlier modules, e.g. LoRA adapters on a frozen base). The last parameter gradient to arrive
does not say that, the gradient of the inputs does. :func:`hook_input_gradients` registers one
gradient hook over the floating-point inputs that require grad
(``torch.autograd.graph.register_multi_grad_hook``, mode ``"all"``): it runs once autograd has
computed the gradient of every one of them that this backward needs, that is when the module's
backward is over. A forward whose inputs need no gradient gets no hook.

Note: torch's ``register_multi_grad_hook`` (mode ``"all"``) cannot be used here: to count the
gradients a pass will compute it asks ``torch._C._will_engine_execute_node`` about each input's
node, which raises for a leaf that ``torch.autograd.grad`` captures (the model's input in
``torch.autograd.grad(loss, x)``: input saliency, gradient penalties). :class:`_AllGradients`
counts the same way, but a captured leaf counts as computed: the engine runs a tensor's hooks on
the gradient it captures.

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

import threading
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
    return _AllGradients(inputs, callback)


class _AllGradients(RemovableHandle):
    """A gradient hook on each of ``tensors``; ``callback()`` runs once per backward pass, when the gradients of
    all of them that the pass computes are in. Removing it removes every hook."""

    def __init__(self, tensors: list[torch.Tensor], callback: Callable[[], None]):
        self._nodes = [_node(t) for t in tensors]
        self._pending: dict[int, int] = {}  # graph task id -> gradients still to come in that pass
        self._lock = threading.Lock()  # (a pass's hooks may run on several device threads)
        self._callback = callback
        self._handles = [t.register_hook(self._on_gradient) for t in tensors]

    def _on_gradient(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task not in self._pending:  # the first of this pass: how many will come
                self._pending[task] = sum(map(_computes_gradient, self._nodes))
            self._pending[task] -= 1
            done = self._pending[task] == 0
            if done:
                del self._pending[task]
        if done:
            self._callback()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _node(tensor: torch.Tensor) -> torch.autograd.graph.Node:
    """The node that receives the tensor's gradient: its ``grad_fn``, or a leaf's gradient accumulator."""
    return torch.autograd.graph.get_gradient_edge(tensor).node


def _computes_gradient(node: torch.autograd.graph.Node) -> bool:
    """Whether the running backward pass computes the gradient that ``node`` receives."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf that torch.autograd.grad captures (the only case it refuses): its hooks run
        return True
