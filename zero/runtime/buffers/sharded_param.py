"""Stage 3's parameters: whole while their unit is gathered, a guarded placeholder otherwise.

Note: a managed parameter keeps its identity (the object the model, tied modules and
autograd's saved tensors refer to); only its ``.data`` changes. While gathered, ``.data``
is a view of its bucket's ``param_buffer``; while sharded it is a placeholder of the same
shape backed by a single NaN (``expand`` of a scalar), so that no code path can read
released memory. Autograd saves the parameter object, not its data, so the values a
backward pass sees are whatever is gathered when it runs.

The parameter's class becomes :class:`ZeroParameter`, whose ``__torch_function__`` turns
any use of a *sharded* parameter (an op, ``.data``, printing, ``state_dict``) into an error
that names it and says how to gather it; shape, dtype, device and hook queries stay allowed.
A tensor-parallel parameter (a ``DTensor``) becomes a :class:`ZeroDTensorParameter` with the same guard, and what
moves is its local tensor's ``.data`` (``zero.runtime.buffers.local_tensor``); its placements stay as they were.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zero.runtime.guards.ddp import refuse_if_ddp_is_building

# Attribute getters and methods that only read metadata (or hooks): allowed while sharded.
METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "is_meta", "is_cuda",
        "is_sparse", "is_quantized", "is_nested", "grad_fn", "_grad_fn", "_base", "names", "size", "dim",
        "numel", "nelement", "element_size", "is_floating_point", "is_complex", "__hash__", "requires_grad_",
        "register_hook", "register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks", "_backward_hooks",
        "__len__", "get_device", "_is_view", "nbytes", "itemsize", "type", "is_pinned",
        "_has_compatible_shallow_copy_type", "backward",  # backward(inputs=[params]): hooks gather as needed
    }
)


# What Module._apply (model.to(), .float(), .cpu(), ...) calls on each parameter and gradient.
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type"})


def name_of(func) -> str:
    """The name a ``__torch_function__`` call is known by (``"data"`` for the ``.data`` getter and setter)."""
    owner = getattr(func, "__self__", None)  # getset descriptors' __get__/__set__ wrappers
    if owner is not None and not isinstance(owner, torch.Tensor) and hasattr(owner, "__name__"):
        return owner.__name__
    return getattr(func, "__name__", "")


def is_conversion(func) -> bool:
    """A dtype/device conversion, or a ``.data =`` assignment (how ``Module._apply`` installs its result)."""
    return name_of(func) in _CONVERSIONS or (name_of(func) == "data" and func.__name__ == "__set__")


def convert_or_refuse(func, args, kwargs, message: str):
    """Let a conversion that changes nothing through (``model.to(the device it is on)``); refuse the rest."""
    target = args[0]
    if func.__name__ == "__set__":  # `t.data = value`: only `t.data = t` changes nothing
        if args[1] is target:
            return None
        raise RuntimeError(message)
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    if result is target or not isinstance(result, torch.Tensor):  # a no-op returns the tensor; .type() a str
        return result
    raise RuntimeError(message)


def flat_arguments(args: tuple, kwargs: dict) -> Iterator[object]:
    """A ``__torch_function__`` call's arguments, positional then keyword, with lists and tuples opened one level
    (``torch.cat([a, b])``, ``_foreach_zero_(grads)``)."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def _guarded(cls, func, types, args=(), kwargs=None):
    """The ``__torch_function__`` of a managed stage-3 parameter (see the module docstring)."""
    kwargs = kwargs or {}
    if func in (torch.Tensor.__repr__, torch.Tensor.__format__) and args[0]._zero_sharded:
        p = args[0]  # say what it is (never the placeholder's values, never an error in a debugger)
        return f"{type(p).__name__}({p._zero_name!r}, shape={tuple(p.shape)}, dtype={p.dtype}, sharded)"
    if args and is_sharded(args[0]) and is_conversion(func):
        return convert_or_refuse(func, args, kwargs, cast_after_wrapping(args[0]._zero_name))
    if name_of(func) == "view_as" and len(args) == 2 and args[0] is args[1]:  # `p.view_as(p).grad_fn`: how torch's
        with torch._C.DisableTorchFunctionSubclass():  # pipelining reaches a parameter's gradient accumulator
            return func(*args, **kwargs)
    for item in flat_arguments(args, kwargs):
        if is_sharded(item):
            _refuse(item, func)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _no_deepcopy(self, memo):
    raise RuntimeError(
        f"zero: cannot deep-copy parameter {self._zero_name!r}: it is managed by a stage-3 ZeroOptimizer "
        "(a copy would share its hooks and hold no values of its own). For a copy of the model (e.g. an "
        "EMA), build a new one and load `model.state_dict()` taken inside `opt.gathered_parameters()`."
    )


class ZeroParameter(nn.Parameter):
    """A parameter managed by a stage-3 :class:`~zero.ZeroOptimizer` (see the module docstring)."""

    _zero_name: str = "?"
    _zero_sharded: bool = False
    __deepcopy__ = _no_deepcopy
    __torch_function__ = classmethod(_guarded)


class ZeroDTensorParameter(DTensor):
    """A tensor-parallel (DTensor) parameter managed by a stage-3 :class:`~zero.ZeroOptimizer`: the DTensor, guarded
    like :class:`ZeroParameter` (DTensor's own dispatch runs every allowed use)."""

    _zero_name: str = "?"
    _zero_sharded: bool = False
    __deepcopy__ = _no_deepcopy
    __torch_function__ = classmethod(_guarded)


_MANAGED = {nn.Parameter: ZeroParameter, DTensor: ZeroDTensorParameter}  # a parameter's class -> its managed class


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a managed stage-3 parameter that is sharded now."""
    return type(t) in (ZeroParameter, ZeroDTensorParameter) and t._zero_sharded


def _refuse(param: ZeroParameter, func) -> None:
    name = name_of(func)
    if name in METADATA:
        return
    refuse_if_ddp_is_building()
    if "_zero_dropped_by" in param.__dict__:
        raise RuntimeError(
            f"zero: parameter {param._zero_name!r} is still sharded across ranks (stage 3): the ZeroOptimizer that "
            "sharded it was dropped without close(), and gathering needs every rank at once. Build a new "
            "ZeroOptimizer over the model (it gathers it first), or call opt.close() on every rank before dropping "
            "an optimizer to get the model back whole."
        )
    raise RuntimeError(
        f"zero: parameter {param._zero_name!r} is sharded across ranks (stage 3) and was used outside its "
        f"unit's forward/backward (in {name or func}). Its values exist only as 1/N shards between uses. To "
        f"read or edit it, wrap the code in `with opt.gathered_parameters(...)`; to use it in forward, "
        f"call it from the module that owns it (or put its users in one unit with ZeroConfig.unit_classes)."
    )


def cast_after_wrapping(name: str) -> str:
    """The error for changing a managed parameter's dtype or device after wrapping (any stage)."""
    return (
        f"zero: parameter {name!r} changed dtype or device after ZeroOptimizer wrapped the model (model.to(), "
        ".half(), .double(), .bfloat16(), ...). Its values live in the optimizer's flat buffers, which keep "
        "their dtype and device, so training would go on with the old ones. Cast or move the model before "
        "building ZeroOptimizer."
    )


def make_sharded(param: nn.Parameter, name: str) -> ZeroParameter:
    """Turn ``param`` (the same object) into a :class:`ZeroParameter` (a DTensor: a :class:`ZeroDTensorParameter`);
    it starts gathered."""
    assert type(param) not in _MANAGED.values(), f"{name} is sharded already"  # (claim_parameters refuses that)
    if type(param) not in _MANAGED:
        raise ValueError(
            f"parameter {name!r} is a {type(param).__name__}; stage 3 manages plain torch.nn.Parameter objects "
            "and the DTensor parameters of torch's tensor parallelism"
        )
    param.__class__ = _MANAGED[type(param)]
    param._zero_name = name
    param._zero_sharded = False
    return param  # type: ignore[return-value]


def set_data(param: ZeroParameter, data: torch.Tensor, *, sharded: bool) -> None:
    """Point the parameter (a DTensor: its local tensor) at ``data`` (a gathered view or the placeholder)."""
    with torch._C.DisableTorchFunctionSubclass():
        (param._local_tensor if isinstance(param, DTensor) else param).data = data
    param._zero_sharded = sharded


def unmanaged_class(param: torch.Tensor) -> type:
    """The class a managed stage-3 parameter had before :func:`make_sharded`."""
    return next(plain for plain, managed in _MANAGED.items() if type(param) is managed)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the given shape that owns one element (a NaN)."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)
