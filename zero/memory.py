"""Counting bytes by storage: the ground truth for model-state memory.

Views share storage, so bytes are counted once per unique storage. On CPU the total
bytes of live tensor storages (found through the garbage collector) is the allocator
figure that categories are checked against.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

# what the memory profiler sorts every live byte into (zero.profile)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication", "temporaries", "other")


@dataclass(frozen=True)
class MemoryItem:
    """A tensor named for the memory profiler: its category, a label within it and the module it serves.

    Categories: ``parameters``, ``gradients``, ``optimizer_state``, ``communication`` (buffers of
    collectives in flight), and ``other``. ``module`` is a module name, or ``""`` for the whole model.
    """

    category: str
    label: str
    tensor: torch.Tensor
    module: str = ""


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (released storages count 0)."""
    seen: dict[tuple[str, int], int] = {}
    with torch._C.DisableTorchFunctionSubclass():  # accounting reads sharded parameters' storage too
        for t in tensors:
            nbytes = t.untyped_storage().nbytes()
            if nbytes:
                seen[_storage_key(t)] = nbytes
    return sum(seen.values())


def live_tensors(device: str | torch.device = "cpu") -> Iterator[torch.Tensor]:
    """Every live tensor on ``device``'s type that Python can reach (after a garbage collection).
    Gradients that Python never touched have no Python object and are not among them."""
    device = torch.device(device)
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() touches deprecated module attributes
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == device.type and not obj.is_meta:
                    with torch._C.DisableTorchFunctionSubclass():  # (guarded parameters and gradients too)
                        obj.untyped_storage().data_ptr()  # fake tensors left by torch.compile have no memory
                    yield obj
            except (ReferenceError, RuntimeError):  # weak proxies; tensors without real storage
                continue


def live_tensor_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes of every distinct live tensor storage on ``device`` that Python can reach."""
    return storage_bytes(list(live_tensors(device)))


def zero_model_state_bytes(
    numel: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> float:
    """The ZeRO paper's per-rank model-state bytes for ``numel`` parameters (Ψ) on ``world_size`` ranks.

    Defaults are plain fp32 Adam (4-byte params and grads, 8 bytes of m and v): stage 0
    ``16Ψ``, stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``.
    For mixed-precision Adam pass ``param_bytes=2, grad_bytes=2, optimizer_bytes=12``.
    """
    n = world_size
    p, g, k = param_bytes * numel, grad_bytes * numel, optimizer_bytes * numel
    sharded = {0: (p, g, k), 1: (p, g, k / n), 2: (p, g / n, k / n), 3: (p / n, g / n, k / n)}
    if stage not in sharded:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    return float(sum(sharded[stage]))
