"""The model's parameters belong to one ZeroOptimizer, which checks that the model still uses them.

Construction marks each managed parameter with its optimizer's :class:`OwnershipMarker` (one optimizer per parameter);
as each backward pass starts and before each step, the model must still hold those very
parameters, with their dtype, device and (stages 0-2) storage: ``model.to()``, ``.half()``
or ``load_state_dict(assign=True)`` after wrapping would otherwise train on silently.
"""

from __future__ import annotations

import weakref
from typing import Callable, Protocol, Sequence

import torch


class _Slot(Protocol):
    @property
    def param(self) -> torch.nn.Parameter: ...

    @property
    def name(self) -> str: ...


class Managed(Protocol):
    """What this guard reads of a bucket (:class:`zero.runtime.buffers.bucket.Bucket`, not imported: the buffers import
    the guards): its parameters' slots, and its check that they still view its buffers."""

    @property
    def slots(self) -> Sequence[_Slot]: ...

    def check_attached(self, whole: bool) -> None: ...


class OwnershipMarker:
    """One ZeroOptimizer's identity on the parameters it manages (held by its runtime, so it lives exactly as long)."""

    def __init__(self) -> None:
        self.optimizer: Callable[[], object | None] = lambda: None  # a weak reference to the ZeroOptimizer, once built


class OwnerRef:
    """A parameter's weak reference to the marker of the ZeroOptimizer managing it; pickles as no owner
    (``torch.save(model)``)."""

    def __init__(self, marker: OwnershipMarker | None = None):
        self._ref = weakref.ref(marker) if marker is not None else None

    @property
    def alive(self) -> bool:
        return self._ref is not None and self._ref() is not None

    def __reduce__(self):
        return (OwnerRef, ())


def optimizer_of(param: torch.nn.Parameter) -> object | None:
    """The live ZeroOptimizer managing ``param``, if any."""
    ref = getattr(param, "_zero_owner", None)
    marker = ref._ref() if ref is not None and ref.alive else None
    return marker.optimizer() if marker is not None else None


def managed_elsewhere(param: torch.nn.Parameter) -> bool:
    """Whether a live ZeroOptimizer manages ``param`` already."""
    owner = getattr(param, "_zero_owner", None)
    return owner is not None and owner.alive


def claim_parameters(marker: OwnershipMarker, buckets: Sequence[Managed]) -> None:
    """Mark every parameter in ``buckets`` with ``marker``; refuse one that another live ZeroOptimizer manages
    (its ``.data`` would be moved into two sets of flat buffers, and the first would train stale views)."""
    slots = [slot for bucket in buckets for slot in bucket.slots]
    for slot in slots:
        if managed_elsewhere(slot.param):
            raise ValueError(
                f"parameter {slot.name!r} is already managed by another ZeroOptimizer; a parameter can belong "
                "to one ZeroOptimizer only. Give each optimizer a disjoint set of parameters (or drop the "
                "first optimizer before building a new one)."
            )
    for slot in slots:
        slot.param._zero_owner = OwnerRef(marker)


def check_model(model: torch.nn.Module, buckets: Sequence[Managed], *, whole: bool) -> None:
    """Raise if the model no longer uses the managed parameters as they were (``whole``: stages 0-2, whose
    parameters view the buckets' storage)."""
    for bucket in buckets:
        bucket.check_attached(whole=whole)
    current = dict(model.named_parameters())
    for bucket in buckets:
        for slot in bucket.slots:
            if current.get(slot.name) is not slot.param:
                raise ValueError(
                    f"the model's parameter {slot.name!r} is no longer the one ZeroOptimizer manages: it was "
                    "replaced after wrapping (load_state_dict(assign=True), an assignment, or a conversion "
                    "that swaps parameters). Load weights with load_state_dict() (it copies), or build the "
                    "ZeroOptimizer after replacing them."
                )
