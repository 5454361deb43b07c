"""What ``p.grad`` holds at stages 1-3 (and at stage 0 under mixed precision, where the reduced
gradient belongs to the fp32 master) after a reduction: a guard, never a wrong number.

At stages 1-3 no rank holds a parameter's whole reduced gradient (each holds its 1/N
chunk), so ``p.grad`` cannot show it. Leaving ``p.grad`` as ``None`` (or as this rank's
local, unreduced gradient) would let code that reads gradients go silently wrong:
``torch.nn.utils.clip_grad_norm_`` would clip nothing or by a local norm, and
``model.zero_grad()`` would have nothing to clear. So after each reduction ZeroOptimizer sets
``p.grad`` of every parameter that has a gradient to a :class:`ShardedGrad`: a tensor of the
right shape, dtype and device (one shared element, expanded) whose ``__torch_function__``

* lets metadata queries through (shape, dtype, ``requires_grad_`` ...);
* records ``zero_()`` (``model.zero_grad(set_to_none=False)``) so that the optimizer
  clears the shards, exactly as PyTorch would have zeroed the gradient;
* records ``mul_(number)`` and ``div_(number)`` (torch's pipeline schedules divide every ``p.grad`` by their
  micro-batches, ``scale_grads``) so that the optimizer applies them to the shards, the same operation in order;
* lets a no-op conversion through (``model.to(its own device)``) and refuses a real one;
* refuses every other use with an error that names the parameter and the fix.

Setting ``p.grad = None`` (``model.zero_grad()``, Hugging Face Trainer) is seen by the
optimizer at the next backward pass, step or clip (``GradReducer.apply_user_grad_edits``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zero.runtime.buffers.sharded_param import (
    METADATA,
    cast_after_wrapping,
    convert_or_refuse,
    flat_arguments,
    is_conversion,
    name_of,
)

_ZEROING = frozenset({"zero_", "_foreach_zero_"})
_HARMLESS = frozenset({"detach_", "requires_grad_"})  # what zero_grad(set_to_none=False) calls first
_SCALING = frozenset({"mul_", "div_"})  # by a number: applied to the shards


def _guarded(cls, func, types, args=(), kwargs=None):
    """The ``__torch_function__`` of a gradient guard, :class:`ShardedGrad` or the DTensor around one."""
    kwargs = kwargs or {}
    name = name_of(func)
    guards = [guard_of(a) for a in flat_arguments(args, kwargs) if type(a) in _GUARDS]
    if guards and name not in METADATA:
        if name in _ZEROING:
            for guard in guards:
                guard._zero_cleared = True
            if name == "zero_":
                return args[0]
            others = [t for t in args[0] if type(t) not in _GUARDS]  # _foreach_zero_(list)
            if others:
                torch._foreach_zero_(others)
            return None
        if name in _HARMLESS:
            return args[0]
        if name in _SCALING and len(args) == 2 and not kwargs and type(args[0]) in _GUARDS and _number(args[1]):
            guard_of(args[0])._zero_scalings.append((name, args[1]))
            return args[0]
        if is_conversion(func):
            return convert_or_refuse(func, args, kwargs, cast_after_wrapping(guards[0]._zero_name))
        raise RuntimeError(
            f"zero: the reduced gradient of {guards[0]._zero_name!r} {guards[0]._zero_reason}, so p.grad "
            f"holds no values (used in {name or func}). Clip with opt.clip_grad_norm_(max_norm) instead of "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), ...), which cannot see it; clear gradients "
            "with opt.zero_grad() or model.zero_grad(). Stage 0 without mixed precision keeps whole "
            "gradients in p.grad."
        )
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class ShardedGrad(torch.Tensor):
    """``p.grad`` of a parameter whose reduced gradient is sharded (see the module docstring)."""

    _zero_name: str = "?"
    _zero_reason: str = "is sharded across ranks"
    _zero_cleared: bool = False
    __torch_function__ = classmethod(_guarded)

    def take_zeroed(self) -> bool:
        """Whether ``zero_()`` was called on this guard since the last call (``model.zero_grad(set_to_none=False)``),
        forgetting it."""
        zeroed, self._zero_cleared = self._zero_cleared, False
        return zeroed

    def take_scalings(self) -> list[tuple[str, float]]:
        """The in-place scalings by a number (``("div_", 4)``) since the last call, in order, forgetting them."""
        scalings, self._zero_scalings = self._zero_scalings, []
        return scalings

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"ShardedGrad({self._zero_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class ShardedDTensorGrad(DTensor):
    """``p.grad`` of a tensor-parallel (DTensor) parameter whose reduced gradient is sharded: the DTensor around its
    :class:`ShardedGrad`, guarded the same way (DTensor's dispatch would reach the local guard below
    ``__torch_function__``, so the guard is on the DTensor)."""

    __torch_function__ = classmethod(_guarded)


_GUARDS = (ShardedGrad, ShardedDTensorGrad)


def guard_of(t: torch.Tensor) -> ShardedGrad:
    """The :class:`ShardedGrad` a guard is or holds."""
    return t._local_tensor if type(t) is ShardedDTensorGrad else t


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def sharded_grad(shape: torch.Size, name: str, reason: str, base: torch.Tensor) -> ShardedGrad:
    """A guard for a parameter's gradient of ``shape`` (its local tensor's): ``base`` (a one-element tensor of its
    dtype and device) expanded to it; ``reason`` completes "the reduced gradient of <name> ..." in its errors."""
    guard = torch.Tensor._make_subclass(ShardedGrad, base.expand(shape), False)
    guard._zero_name = name
    guard._zero_reason = reason
    guard._zero_scalings = []
    return guard
