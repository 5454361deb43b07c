"""Activation checkpointing by policy: ``zero.checkpoint_activations(model, policy)``.

The chosen blocks keep only their inputs from forward; backward recomputes each block's forward when it
needs the block's saved tensors. It is torch's non-reentrant checkpointing applied through module
hooks (:class:`CheckpointHooks`, as ``torch.distributed._composable.checkpoint``, the API FSDP2 composes with,
applies it), so parameter names and ``state_dict`` keys are unchanged, and a recomputation calls the module
again: stage 3 gathers the unit's parameters for it through its usual hooks and backward releases them. The RNG
state is restored for the recomputation, so dropout draws the same mask and checkpointing changes no number.
Every backward pass through a block recomputes it (a second backward through a retained graph, a gradient
penalty's double backward).

Policies (:class:`ActivationCheckpointing`): the blocks are the modules of the named classes (``classes``),
or those named (``modules``), or by default every module held in an ``nn.ModuleList`` (stage 3's default
units: the transformer blocks); ``every=k`` keeps every k-th of them; ``selective=True`` also saves
matrix-multiplication outputs inside each block and recomputes only the cheap operations between them
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``); ``offload_inputs=True`` keeps each
checkpointed block's input in host memory (pinned with a GPU) until the recomputation brings it back.
:func:`blocks_within_budget` picks the blocks for an activation budget from the estimator's trace.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator
from torch import nn
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_cudnn_attention")  # fmt: skip


class ActivationCheckpointing(BaseModel):
    """Which blocks to checkpoint and how (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: Optional[tuple[StrictStr, ...]] = Field(None, description="class names of the blocks, e.g. ['Block']")
    modules: Optional[tuple[StrictStr, ...]] = Field(None, description="qualified names of the blocks")
    every: int = Field(1, strict=True, ge=1, description="checkpoint every k-th block (1: all)")
    selective: bool = Field(False, strict=True, description="also save matmul outputs; recompute only the rest")
    offload_inputs: bool = Field(False, strict=True, description="keep the blocks' inputs in host memory")
    use_reentrant: bool = Field(False, strict=True, description="must stay False: reentrant is not supported")

    @model_validator(mode="after")
    def _check(self) -> "ActivationCheckpointing":
        if self.use_reentrant:
            raise ValueError(
                "reentrant activation checkpointing (use_reentrant=True) runs a backward inside backward, which "
                "cannot hand gradients to ZeRO's hooks in order; use the default non-reentrant checkpointing"
            )
        if self.classes is not None and self.modules is not None:
            raise ValueError("give either classes or modules (the blocks to checkpoint), not both")
        return self


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


def saved_activation_bytes(trace: Any, blocks: list[str] | tuple[str, ...], selective: bool = False) -> float:
    """Peak activation bytes of one step with ``blocks`` checkpointed (``trace``: from
    :func:`zero.estimator.estimator.trace`), the larger of two moments:

    * the end of forward: the traced total, less each checkpointed block's own activations, plus its input
      (``selective``: and its matmul outputs);
    * the recomputation of a checkpointed block ``j`` in backward: the activations outside the blocks, what
      the blocks before ``j`` kept (their inputs, or their activations when not checkpointed), and ``j``'s
      own activations, alive again (the blocks after ``j`` have been through backward and freed theirs).
    """
    own, inputs = trace.unit_activation_bytes, trace.unit_input_bytes
    order = [u for u in own if u]  # forward order; "" is the root, never a block
    chosen = set(blocks)
    matmuls = trace.unit_matmul_bytes if selective else {}
    kept = {u: inputs.get(u, 0) + matmuls.get(u, 0) if u in chosen else own[u] for u in order}
    outside = trace.activation_bytes - sum(own[u] for u in order)
    peak = outside + sum(kept.values())
    before = outside
    for u in order:
        if u in chosen:
            peak = max(peak, before + own[u])
        before += kept[u]
    return float(peak)


def blocks_within_budget(trace: Any, budget_bytes: float) -> tuple[str, ...]:
    """The fewest blocks (stage 3's default units, from :func:`zero.estimator.estimator.trace`) to checkpoint so
    that :func:`saved_activation_bytes` fits ``budget_bytes``, checkpointing first the blocks that save the
    most (the least recomputation for the memory); a ``ValueError`` naming the minimum if none fits."""
    own = {u: b for u, b in trace.unit_activation_bytes.items() if u}  # "" is the root, never a block
    order = sorted(own, key=lambda u: own[u] - trace.unit_input_bytes.get(u, 0), reverse=True)
    plans = [order[:k] for k in range(len(order) + 1)]
    for chosen in plans:
        if saved_activation_bytes(trace, chosen) <= budget_bytes:
            return tuple(sorted(chosen, key=list(own).index))
    minimum = min(saved_activation_bytes(trace, chosen) for chosen in plans)
    raise ValueError(
        f"an activation budget of {budget_bytes / 2**20:.2f} MiB is below the minimum this model needs with its "
        f"blocks checkpointed, about {minimum / 2**20:.2f} MiB per micro-batch; use a smaller micro-batch or a "
        "larger budget"
    )


def _selective_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        name = op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else str(op)
        return CheckpointPolicy.MUST_SAVE if name in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _map_tensors(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    convert = lambda v: fn(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


class InputOffload:
    """The hooks that keep checkpointed blocks' inputs in host memory, and the bytes they moved there."""

    def __init__(self) -> None:
        self.bytes_offloaded = 0
        self._devices: dict[int, torch.device] = {}  # id(module) -> where its inputs came from

    def to_host(self, module: nn.Module, hooks: CheckpointHooks, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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
