"""Activation checkpointing of the blocks a policy chooses (:func:`checkpoint_activations`): torch's non-reentrant
checkpointing applied through module hooks (:class:`CheckpointHooks`, as ``torch.distributed._composable.checkpoint``
applies it), so parameter names and ``state_dict`` keys are unchanged and a recomputation calls the module again (see
:mod:`zero.activations` for the policy and what it does to a step)."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

from zero.activations import MATMULS, ActivationCheckpointing
from zero.runtime.activations.input_offload import InputOffload


@dataclass
class Checkpointed:
    """What :func:`checkpoint_activations` did: the blocks' names and, with ``offload_inputs``, its hooks."""

    blocks: list[str]
    offload: InputOffload | None = None


def checkpoint_activations(model: nn.Module, policy: ActivationCheckpointing | dict | None = None) -> Checkpointed:
    """Checkpoint the blocks of ``model`` that ``policy`` chooses. Call it once, before the first forward
    (``ZeroConfig.activation_checkpointing`` does it when the optimizer is built)."""
    if not isinstance(policy, ActivationCheckpointing):
        policy = ActivationCheckpointing(**(policy or {}))
    names = chosen_blocks(model, policy)
    modules = dict(model.named_modules())
    offload = InputOffload() if policy.offload_inputs else None
    for name in names:
        module = modules[name]
        if CheckpointHooks.of(module) is not None:
            raise ValueError(f"module {name!r} is checkpointed already; call checkpoint_activations once")
        CheckpointHooks(module, _selective_contexts if policy.selective else None, offload)
        if offload is not None:
            module.register_forward_pre_hook(offload.to_device, with_kwargs=True)
    return Checkpointed(names, offload)


class CheckpointHooks:
    """Non-reentrant activation checkpointing of one module through its forward hooks, as torch's composable
    ``checkpoint`` applies it, with a recomputation that can run again: torch's composable API enters a one-use
    context on each recomputation, so a second backward pass through the block (``retain_graph=True``, a gradient
    penalty) fails inside torch. ``offload``: its inputs kept in host memory."""

    def __init__(self, module: nn.Module, context_fn: Callable | None, offload: "InputOffload | None") -> None:
        self.context_fn = context_fn
        self.enabled = True  # False while backward recomputes the forward (the hooks stand aside)
        self._forward = None  # the running forward's checkpointing (a generator: entered, then finished)
        if offload is not None:
            module.register_forward_pre_hook(lambda m, args, kwargs: offload.to_host(m, self, args, kwargs),
                                             prepend=True, with_kwargs=True)
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=True, always_call=True)

    @staticmethod
    def of(module: nn.Module) -> "CheckpointHooks | None":
        """The module's checkpointing, if it has one."""
        owners = (getattr(hook, "__self__", None) for hook in module._forward_pre_hooks.values())
        return next((owner for owner in owners if isinstance(owner, CheckpointHooks)), None)

    def _contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = self.context_fn() if self.context_fn is not None else (nullcontext(), nullcontext())
        return forward, _Recomputing(self, recompute)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.enabled:
            self._forward = _checkpoint_without_reentrant_generator(module, *_checkpoint_options(self._contexts),
                                                                    *args, **kwargs)
            next(self._forward)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        forward, self._forward = self._forward, None
        if self.enabled and forward is not None:
            next(forward, None)  # (the generator ends: checkpointing of this forward is set up)


class _Recomputing:
    """While backward recomputes a block's forward: its checkpoint hooks stand aside, inside ``inner`` (selective
    checkpointing's context). Entered once per backward pass through the block."""

    def __init__(self, hooks: CheckpointHooks, inner: AbstractContextManager) -> None:
        self.hooks, self.inner = hooks, inner

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.hooks.enabled = False

    def __exit__(self, *exc: Any) -> None:
        self.hooks.enabled = True
        self.inner.__exit__(*exc)


def _checkpoint_options(contexts: Callable) -> tuple:
    """The positional options of torch's ``_checkpoint_without_reentrant_generator`` before the module's arguments:
    RNG state preserved, the contexts, the default determinism check, no debug, and (torch >= 2.5) early stop."""
    return (True, contexts, _DEFAULT_DETERMINISM_MODE, False) + ((True,) if _HAS_EARLY_STOP else ())


_HAS_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters


def chosen_blocks(model: nn.Module, policy: ActivationCheckpointing) -> list[str]:
    """The qualified names of the blocks ``policy`` checkpoints, in model order (a clear error if none)."""
    named = list(model.named_modules())
    if policy.modules is not None:
        known = {name for name, _ in named}
        missing = [m for m in policy.modules if m not in known]
        if missing:
            raise ValueError(f"activation checkpointing names modules that are not in the model: {missing}")
        blocks = [name for name, _ in named if name in policy.modules]
    elif policy.classes is not None:
        present = {type(m).__name__ for _, m in named}
        missing = [c for c in policy.classes if c not in present]
        if missing:
            raise ValueError(
                f"activation checkpointing names classes that no module of the model has: {missing} (the model's "
                f"classes: {sorted(present)})"
            )
        blocks = [name for name, m in named if type(m).__name__ in policy.classes]
        blocks = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks if o != b)]  # outermost only
    else:
        blocks = [f"{name}.{child}" if name else child for name, m in named if isinstance(m, nn.ModuleList)
                  for child, _ in m.named_children()]  # fmt: skip
        if not blocks:
            raise ValueError("the model has no nn.ModuleList of blocks; "
                             "name the blocks with classes=[...] or modules=[...]")
    return blocks[policy.every - 1 :: policy.every]


def _selective_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        name = op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else str(op)
        return CheckpointPolicy.MUST_SAVE if name in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
