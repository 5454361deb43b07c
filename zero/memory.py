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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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
    """Per-rank model-state bytes by kind: measured (``ZeroOptimizer.model_state_bytes()``, whole bytes) or
    predicted by :func:`zero_model_states` (fractional where a kind is split over the ranks)."""

    parameters: float
    gradients: float
    optimizer_state: float  # master weights included

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind ``t``'s bytes: a wrapper subclass's is its inner tensor's (a DTensor's local tensor under
    tensor parallelism, the bytes this rank holds; a functional collective's result); the wrapper itself has none."""
    while is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t.untyped_storage()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = storage_of(t)
    return (str(t.device), storage.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (released storages count 0)."""
    seen: dict[tuple[str, int], int] = {}
    with torch._C.DisableTorchFunctionSubclass():  # accounting reads sharded parameters' storage too
        for t in tensors:
            nbytes = storage_of(t).nbytes()
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


STAGES = (0, 1, 2, 3)


def zero_model_states(
    numel: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
    reduced_bytes: int | None = None,
) -> ModelStateBytes:
    """The ZeRO paper's per-rank model-state bytes, by kind, for ``numel`` parameters (Ψ) on ``world_size``
    ranks (N): the one implementation of the formula (:func:`zero_model_state_bytes` gives its total,
    :func:`zero.estimator.model_states` takes a precision's name).

    Bytes per parameter: ``param_bytes``, ``grad_bytes`` (autograd's gradients), ``optimizer_bytes``
    (Adam's m and v, and mixed precision's fp32 master copy) and ``reduced_bytes``, the reduced gradient
    (default: ``grad_bytes``). Defaults are plain fp32 Adam: stage 0 ``16Ψ``, stage 1 ``8Ψ + 8Ψ/N``,
    stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``. When the reduced gradient is wider than the gradients
    (bf16 gradients reduced in fp32), stages 0-1 keep it beside their gradient buffer (stage 1: its
    shard) and stages 2-3 shard it at its own width.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    reduced = grad_bytes if reduced_bytes is None else reduced_bytes
    p, g, k, r = param_bytes * numel, grad_bytes * numel, optimizer_bytes * numel, reduced * numel
    kept = g + (0 if reduced == grad_bytes else r / (1 if stage == 0 else n))  # stages 0-1's gradient buffer
    sharded = {0: (p, kept, k), 1: (p, kept, k / n), 2: (p, r / n, k / n), 3: (p / n, r / n, k / n)}
    return ModelStateBytes(*map(float, sharded[stage]))


def zero_model_state_bytes(
    numel: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> float:
    """The total of :func:`zero_model_states`: the ZeRO paper's per-rank model-state bytes for ``numel``
    parameters (Ψ) on ``world_size`` ranks.

    Defaults are plain fp32 Adam (4-byte params and grads, 8 bytes of m and v): stage 0
    ``16Ψ``, stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``.
    For mixed-precision Adam pass ``param_bytes=2, grad_bytes=2, optimizer_bytes=12``.
    """
    return zero_model_states(numel, world_size, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                             optimizer_bytes=optimizer_bytes).total
