"""Backward never reads a released parameter: autograd's saved references to stage-3 parameters are checked.

Note: autograd saves the parameters an operator needs for its backward (the parameter object
itself, or a view of it such as ``weight.t()``), not a copy. Once a unit is released, the
parameter's ``.data`` is a NaN placeholder and the views point at a storage of zero bytes, so a
backward that ran after the release would compute with NaN, fail with a storage error deep in
torch, or worse. While a unit's forward runs, :class:`SavedParamCheck` installs saved-tensor
hooks that recognise a tensor whose storage is a gathered parameter buffer and record its unit;
when autograd unpacks it, the unit must be gathered, or the backward fails with an error naming
the unit. Other tensors pass through untouched, and hooks installed around the forward (the
profiler's, ``save_on_cpu``) still see every tensor: these hooks call them. Hooks installed inside
a unit's forward (activation checkpointing) take precedence, as torch nests them; a recomputation
gathers the unit anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class Checked(Protocol):
    """What the check needs of a unit."""

    name: str

    def is_gathered(self) -> bool: ...


class _SavedParam:
    """A saved parameter (or view of one) and the unit whose buffer holds it."""

    __slots__ = ("unit", "packed")

    def __init__(self, unit: Checked, packed: Any):
        self.unit, self.packed = unit, packed


class SavedParamCheck:
    """Saved-tensor hooks for the duration of the outermost unit forward (see the module docstring)."""

    def __init__(self, units_of_storage: Callable[[], dict[int, Checked]]):
        self._units_of_storage = units_of_storage  # storage id -> unit, of the buffers gathered now
        self._calls: list[bool] = []  # per unit forward running: whether it counts (records with autograd)
        self._depth = 0  # of those that count

    def enter(self, records: bool) -> None:
        """A unit's forward starts (``records``: autograd records it: grad mode, not a recomputation in
        backward); the outermost one that records installs the hooks. Call first in the pre-hook, so that
        :meth:`exit` (an ``always_call`` forward hook) always has its match."""
        self._calls.append(records)
        if records:
            self._depth += 1
            if self._depth == 1:
                outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
                torch._C._autograd._push_saved_tensors_default_hooks(*_hooks(self._units_of_storage(), outer))

    def exit(self) -> None:
        """The matching forward ended (also by an error)."""
        if self._calls and self._calls.pop():
            self._depth -= 1
            if self._depth == 0:
                torch._C._autograd._pop_saved_tensors_default_hooks()


def _hooks(storages: dict[int, Checked], outer: tuple[Callable, Callable] | None) -> tuple[Callable, Callable]:
    """The pack and unpack hooks of one forward pass, over ``outer`` (hooks installed around it)."""

    def pack(tensor: torch.Tensor) -> Any:
        packed = tensor if outer is None else outer[0](tensor)
        unit = storages.get(_storage_id(tensor))
        return packed if unit is None else _SavedParam(unit, packed)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedParam):
            if not packed.unit.is_gathered():
                raise RuntimeError(
                    f"zero: backward needs the parameters of {packed.unit!r}, which were released (stage 3): "
                    "their values exist only as 1/N shards now. This happens with a backward pass through a "
                    "graph after step(): run every backward before step()."
                )
            packed = packed.packed
        return packed if outer is None else outer[1](packed)

    return pack, unpack


def _storage_id(tensor: torch.Tensor) -> int | None:
    """The identity of the tensor's storage (``None`` for tensors without one: sparse, fake, ...)."""
    if tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
