"""Placements: where a buffer's bytes live, and how they are allocated, released and copied.

A :class:`~zero.runtime.buffers.flat_buffer.FlatBuffer` asks its placement for storage and for releasing and
restoring it; nothing else in the runtime allocates bucket memory. Two memory placements are here:

* :class:`DevicePlacement`: the model's device (a GPU, or the CPU when training on it). Releasing
  resizes the storage to zero bytes, restoring resizes it back (see the Note in ``flat_buffer``).
* :class:`HostPlacement`: host memory for CPU offload (``zero.offload``), pinned when the model is on a
  GPU so that copies can run asynchronously. Pinned bytes are kept when released: page-locking is slow
  to set up and limited, so a released pinned buffer is only marked unused.

:class:`Placements` is one run's choice of placement per side of a bucket (the device, the optimizer's
side, stage 3's parameter shard), derived from the offload policy; the plan (``zero.runtime.buffers.plan``)
records which side each buffer is on. :class:`~zero.runtime.offload.disk.DiskPlacement` (ZeRO-Infinity) keeps buffers in
a memory-mapped file per rank; a placement's :meth:`~Placement.prefetch` and :meth:`~Placement.evict` page them
in and out (nothing to do for memory).

Each offload target (``zero.offload.TARGETS``, or one of your own) names its ``Placement`` subclass; the runtime builds
it with :meth:`Placement.make` (``zero.runtime.offload.targets``), and :meth:`Placements.of` puts each side of the
buckets in its target's placement. ``Where`` (where a buffer's bytes live) is the policy's (``zero.offload``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zero.offload import Offload, OffloadTarget, Where

HOST = torch.device("cpu")


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (a table, flags) on ``device`` without the host waiting for the device: through pinned
    memory, asynchronously (the host allocator keeps the pinned block until the copy has read it). A plain copy
    from pageable memory would make the host wait for everything queued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Placement:
    """Allocation, release and restore of a buffer's storage in one kind of memory."""

    where: Where
    device: torch.device

    @classmethod
    def make(cls, offload: Offload, device: torch.device, rank: int, world_size: int) -> "Placement":
        """This placement for one rank's run of an offload target that names it (``device``: the model's)."""
        raise NotImplementedError

    def check_room(self, plan: Any, state: dict[str, torch.dtype]) -> None:
        """Raise before anything is allocated if what the stage plan (``zero.runtime.buffers.plan.StagePlan``) puts
        here, and with paging the optimizer's per-element ``state``, cannot fit (memory: checked apart, by
        ``zero.runtime.offload.host``)."""

    def check(self) -> None:
        """Raise unless the bytes held here are still this run's (disk: its file); once per paging pass."""

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        """A 1D tensor of ``numel`` elements, zeroed if ``allocate``, else released."""
        raise NotImplementedError

    def release(self, tensor: torch.Tensor) -> None:
        """Give up the tensor's bytes; views of it stay attached to its storage."""
        raise NotImplementedError

    def restore(self, tensor: torch.Tensor) -> None:
        """Give a released tensor its bytes back (their values are undefined)."""
        raise NotImplementedError

    def prefetch(self, tensor: torch.Tensor) -> None:
        """Start bringing the tensor's values into memory before they are used (memory: nothing to do)."""

    def evict(self, tensor: torch.Tensor) -> None:
        """The values are not needed in memory for a while: write them back and drop them from memory, keeping
        them (memory: nothing to do)."""

    def close(self) -> None:
        """Give back what the placement holds outside the process (disk: its file)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where.value}, {self.device})"


class DevicePlacement(Placement):
    """Memory of ``device``; released storage is resized to zero bytes."""

    def __init__(self, device: torch.device, where: Where = Where.DEVICE):
        self.device = device
        self.where = where

    @classmethod
    def make(cls, offload: Offload, device: torch.device, rank: int, world_size: int) -> "Placement":
        return cls(device)

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype, device=self.device)  # 1D
        if allocate:
            tensor.zero_()
        else:  # large host allocations are mapped lazily, so the empty() above touched no memory
            self.release(tensor)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def restore(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class HostPlacement(DevicePlacement):
    """Host memory for offloaded buffers; with ``pin`` page-locked and kept when released."""

    def __init__(self, pin: bool):
        super().__init__(HOST, Where.PINNED_HOST if pin else Where.HOST)
        self.pin = pin

    @classmethod
    def make(cls, offload: Offload, device: torch.device, rank: int, world_size: int) -> "Placement":
        return cls(pin=device.type == "cuda")

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        if not self.pin:
            return super().new(numel, dtype, allocate=allocate)
        return host_buffer(numel, dtype, pin=True)

    def release(self, tensor: torch.Tensor) -> None:
        if not self.pin:
            super().release(tensor)

    def restore(self, tensor: torch.Tensor) -> None:
        if not self.pin:
            super().restore(tensor)


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed 1D host tensor, pinned if ``pin`` (a clear error if pinned memory cannot be had)."""
    try:
        return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=pin)
    except RuntimeError as err:
        raise ValueError(
            f"CPU offload could not allocate {numel * dtype.itemsize / 2**20:.1f} MiB of pinned host memory "
            f"({err}). Pinned (page-locked) memory is limited by the system (ulimit -l, container limits); "
            "raise the limit, use more ranks, or set offload.optimizer='none'."
        ) from err


class HostCopies:
    """Copies of reduced gradient chunks from the device down to host memory. On CUDA each one runs on
    a side stream once the work queued so far (the collective that produced the chunk) is done, so
    backward goes on while it lands; :meth:`wait` before the host reads. Elsewhere a plain copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_down(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None or src.device.type != "cuda":
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=dst.is_pinned())
        src.record_stream(self.stream)  # its memory is not reused before the copy has read it

    def wait(self) -> None:
        """Every copy to or from pinned host memory queued so far has landed."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self.stream is not None:
                self.stream.synchronize()


@dataclass(frozen=True)
class Placements:
    """One run's placement of each side of a bucket: the device (full parameters, local gradients, staging),
    the optimizer's side (master, gradient shard and the optimizer's gradients: host memory when offloaded)
    and stage 3's parameter shard (host memory with ``offload.params``)."""

    device: Placement
    optimizer: Placement
    shard: Placement
    copies: HostCopies | None = field(default=None, compare=False)  # how gradient chunks go down to the host
    ratio: float = 1.0  # the share of the buckets' elements these hold; the rest are the device's (for_buckets)
    paged: Placement | None = None  # the side's placement whose target pages through host memory (zero.offload)

    @classmethod
    def of(cls, offload: Offload, device: torch.device, place: Callable[[OffloadTarget], Placement]) -> "Placements":
        """As ``offload`` says: each side in its target's placement, ``place(target)`` (one per target, shared by the
        sides that name it; the device's own for the device)."""
        on_device = DevicePlacement(device)
        if offload.ratio == 0 or not offload.optimizer_on_host:  # nothing offloaded: exactly no offload
            return cls.on(on_device)
        made: dict[OffloadTarget, Placement] = {}

        def placed(target: OffloadTarget) -> Placement:
            if target.on_device:
                return on_device
            if target not in made:
                made[target] = place(target)
            return made[target]

        sides = [(target, placed(target)) for target in (offload.optimizer_target, offload.params_target)]
        return cls(
            device=on_device,
            optimizer=sides[0][1],
            shard=sides[1][1],
            copies=HostCopies(device),
            ratio=offload.ratio,
            paged=next((placement for target, placement in sides if target.pages), None),
        )

    def for_buckets(self, numels: list[int]) -> list["Placements"]:
        """Each bucket's placements, ``numels`` its elements in bucket order: these for all of them, or with
        ``ratio`` below 1 (partial offload) these for the first buckets, as long as they hold at most ``ratio`` of
        the elements, and the device alone for the rest. The first buckets are the first that backward reduces:
        their gradients go down to the host while backward goes on, and at the step the device's part steps while
        the host steps its own."""
        if self.ratio >= 1:
            return [self] * len(numels)
        resident, budget, held = Placements.on(self.device), self.ratio * sum(numels), 0
        out = []
        for numel in numels:
            held += numel  # (grows: once past the budget, every later bucket stays on the device)
            out.append(self if held <= budget else resident)
        return out

    @classmethod
    def on(cls, placement: Placement) -> "Placements":
        """Everything in one placement (no offload)."""
        return cls(device=placement, optimizer=placement, shard=placement)

    @property
    def optimizer_offloaded(self) -> bool:
        """The optimizer's side (master, its gradients, the step) lives in host memory, in buffers of its own
        even when the model is on the CPU too."""
        return self.optimizer is not self.device

    @property
    def params_offloaded(self) -> bool:
        """Stage 3's parameter shards live off the device (``offload.params``): whole parameters given back or
        gathered outside training go there too, never all on the device at once."""
        return self.shard is not self.device

    @property
    def disk(self) -> Placement | None:
        """The disk placement, if a side is on disk."""
        return next((p for p in (self.optimizer, self.shard) if p.where is Where.DISK), None)

    def check_room(self, plan: Any, state: dict[str, torch.dtype]) -> None:
        """Before anything is allocated: each placement's room for what ``plan`` puts there
        (:meth:`Placement.check_room`; ``state``: the optimizer's per-element state, paged with the buckets)."""
        for placement in {id(p): p for p in (self.device, self.optimizer, self.shard)}.values():
            placement.check_room(plan, state)

    def close(self) -> None:
        """Give back what the placements hold outside the process (the offload file)."""
        for placement in {id(p): p for p in (self.device, self.optimizer, self.shard)}.values():
            placement.close()

    @property
    def pin(self) -> bool:
        return self.optimizer.where is Where.PINNED_HOST or self.shard.where is Where.PINNED_HOST

    def copy_down(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, overlapped with later device work where it can be (:class:`HostCopies`)."""
        if self.copies is None:
            dst.copy_(src)
        else:
            self.copies.copy_down(dst, src)

    def wait(self) -> None:
        """The host may read what was copied down (and the device what was copied up)."""
        if self.copies is not None:
            self.copies.wait()
