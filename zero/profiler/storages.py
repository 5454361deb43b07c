"""The tracker's storage registries: who created a storage, what autograd saved, what was alive at the start.

Storages are keyed by their ``StorageImpl`` (``untyped_storage()._cdata``) and held through weak
references to their Python objects, which PyTorch keeps alive exactly as long as the storage.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from zero.memory import live_tensors, storage_of


@dataclass
class Origin:
    """Where a storage came from: the module and phase it was created (or saved) in."""

    ref: weakref.ref
    module: str
    phase: str


def register(registry: dict[int, Origin], storage: torch.UntypedStorage, module: str, phase: str) -> None:
    """Remember ``storage`` (first origin wins) until it is freed."""
    key = storage._cdata
    if key in registry:
        return

    def forget(_ref: weakref.ref, key: int = key) -> None:
        if registry.get(key) is origin:
            del registry[key]

    origin = Origin(weakref.ref(storage, forget), module, phase)
    registry[key] = origin


@dataclass(eq=False)
class SavedStorage(Origin):
    count: int = 0  # saved tensors on this storage that autograd still holds


class SavedTensor:
    """What autograd keeps for a saved tensor while the tracker runs: the tensor, detached, and a
    count that drops when autograd releases it (after its backward, or with the graph).

    Detached: holding the tensor itself would tie a saved output to its own ``grad_fn`` in a cycle
    through C++ that the garbage collector cannot free (autograd re-attaches it on unpack)."""

    __slots__ = ("tensor", "registry", "key", "entry")

    def __init__(self, tensor: torch.Tensor, registry: dict[int, SavedStorage], module: str, phase: str):
        with torch._C.DisableTorchFunctionSubclass():
            storage = storage_of(tensor)
        self.key = storage._cdata
        self.entry = registry.get(self.key)
        if self.entry is None:
            self.entry = registry[self.key] = SavedStorage(weakref.ref(storage), module, phase)
        self.entry.count += 1
        self.tensor, self.registry = tensor.detach(), registry

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, SavedTensor) else saved

    def __del__(self) -> None:
        self.entry.count -= 1
        if self.entry.count == 0 and self.registry.get(self.key) is self.entry:
            del self.registry[self.key]


@dataclass(eq=False)  # hashed by identity
class EntryStorage:
    """A storage alive when tracking started: its allocator block is checked at every sample."""

    ref: weakref.ref
    ptr: int
    nbytes: int
    dead_at: int | None = None  # first sample that found it freed or resized


def entry_storages(device: torch.device) -> dict[int, EntryStorage]:
    """Storages alive now on ``device``'s type, with the gradients of leaf tensors."""
    found: dict[int, EntryStorage] = {}
    with torch._C.DisableTorchFunctionSubclass():
        for obj in live_tensors(device):
            for t in (obj, obj.grad if obj.is_leaf else None):
                if t is None or t.layout != torch.strided:
                    continue
                try:
                    storage = storage_of(t)
                    ptr = storage.data_ptr()
                except Exception:  # tensors without real memory (fake tensors, some subclasses)
                    continue
                if ptr and storage.nbytes() and storage._cdata not in found:
                    found[storage._cdata] = EntryStorage(weakref.ref(storage), ptr, storage.nbytes())
    return found
