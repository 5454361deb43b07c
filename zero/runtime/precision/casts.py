"""The forward inputs under a :class:`zero.MixedPrecision` policy: a module that computes in ``param_dtype`` gets its
floating-point inputs in it (cast, or refused by name with ``cast_forward_inputs=False``)."""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable

import torch


def cast_inputs(dtype: torch.dtype, value: Any) -> Any:
    """``value`` with every floating-point tensor in it (nested in lists, tuples, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_inputs(dtype, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_inputs(dtype, v) for v in value)
    if isinstance(value, dict):
        return {k: cast_inputs(dtype, v) for k, v in value.items()}
    return value


class ModuleInputCast:
    """A forward pre-hook on a module that computes in ``dtype``: its floating-point inputs of another dtype are cast
    to ``dtype`` (``cast``, the ``cast_forward_inputs`` setting), or refused with an error naming the module, the
    tensor's dtype and the setting. Inputs already in ``dtype`` (the common case) are only looked at; outputs are
    not cast back."""

    def __init__(self, dtype: torch.dtype, name: str, cast: bool):
        self.dtype, self.name, self.cast = dtype, name, cast

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        other = _other_dtype(self.dtype, args) or (_other_dtype(self.dtype, kwargs) if kwargs else None)
        if other is None:
            return None
        if not self.cast:
            raise ValueError(
                f"module {self.name or '<root>'!r} ({type(module).__name__}) computes in {self.dtype} "
                f"(precision.param_dtype) but received a {other} tensor, and precision.cast_forward_inputs=False "
                "leaves inputs as they are. Cast the tensor to the model's dtype where it is made, or set "
                "cast_forward_inputs=True (the default: floating inputs are cast at the entry of each such module)."
            )
        return cast_inputs(self.dtype, args), cast_inputs(self.dtype, kwargs)


def _other_dtype(dtype: torch.dtype, value: Any) -> torch.dtype | None:
    """The dtype of the first floating-point tensor in ``value`` (nested as :func:`cast_inputs` walks) that is not
    ``dtype``, if any."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() and value.dtype != dtype else None
    if isinstance(value, (list, tuple)):
        return next((d for d in map(partial(_other_dtype, dtype), value) if d is not None), None)
    if isinstance(value, dict):
        return next((d for d in map(partial(_other_dtype, dtype), value.values()) if d is not None), None)
    return None


def input_casts(model: torch.nn.Module, dtype: torch.dtype, cast: bool, units: Iterable[str] = ()) -> list[Any]:
    """Register :class:`ModuleInputCast` on every module that owns a parameter in ``dtype`` (after the policy cast
    the model) and on the modules named in ``units`` (stage 3's units, as FSDP2 casts the inputs of each module it
    wraps); the hooks' handles. A floating tensor made inside forward in another dtype (``torch.ones(...)``,
    ``x.float()``, a sum with an fp32 mask) is cast where it enters such a module: modules that keep full precision
    (:func:`zero.runtime.precision.parameters.full_precision_parameters`) and integer inputs are left alone."""
    wanted = set(units) if cast else set()
    for name, module in model.named_modules():
        if any(p.is_floating_point() and p.dtype == dtype for p in module.parameters(recurse=False)):
            wanted.add(name)
    return [module.register_forward_pre_hook(ModuleInputCast(dtype, name, cast), with_kwargs=True)
            for name, module in model.named_modules() if name in wanted]
