"""Paging the optimizer's side of each bucket through host memory when its offload target pages (``"disk"``).

Every pass over the buckets' optimizer side (making the optimizer's gradients, clipping, the step) goes through
:meth:`walk`, which yields the buckets in order (``grads_only``: the pass reads only the gradient shards). Under
:class:`Resident` (memory placements) that is all. Under :class:`WindowPaging` at most ``buffer_count`` buckets are
mapped at a time: each one is read ahead (its master, gradient shard, stage-3 parameter shard and optimizer state)
``buffer_count - 1`` buckets before it is used, and written back and dropped from memory as soon as it has been
(``zero.runtime.offload.disk``). So reads of the next buckets, the current bucket's work and the write-back of the
previous ones overlap, and host memory holds a window of buckets, not the model.

The wrapped optimizer's per-element state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``)
lives in the file too: :class:`PagedState` preallocates a region per bucket and key, learned by stepping a
two-element copy of the optimizer at construction, and moves the tensors ``torch.optim`` creates (at a bucket's
first step, or on ``load_state_dict``) into them, one bucket at a time. The values are the same tensors' values,
so disk offload changes no number.
"""

from __future__ import annotations

import ctypes
from typing import Iterator

import torch

from zero.runtime.buffers.bucket import Bucket, LocalPiece
from zero.runtime.buffers.flat_buffer import FlatBuffer
from zero.runtime.buffers.placement import Placement


class Resident:
    """Everything stays in memory: a walk is the buckets in order."""

    def walk(self, buckets: list[Bucket], grads_only: bool = False) -> Iterator[Bucket]:
        yield from buckets

    def adopt_state(self, buckets: list[Bucket]) -> None:
        pass

    def state_target(self, piece: LocalPiece, key: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a loaded state tensor of ``piece`` should be read to (``None``: anywhere in memory)."""
        return None


class WindowPaging(Resident):
    """A window of ``buffer_count`` buckets of ``placement`` mapped at a time (see the module docstring)."""

    def __init__(self, state: "PagedState", placement: Placement, buffer_count: int):
        self.state = state
        self.placement = placement
        self.buffer_count = buffer_count

    def walk(self, buckets: list[Bucket], grads_only: bool = False) -> Iterator[Bucket]:
        self.placement.check()  # still this run's file, once per pass
        ahead = self.buffer_count - 1
        for bucket in buckets[:ahead]:
            self.prefetch(bucket, grads_only)
        for i, bucket in enumerate(buckets):
            if i + ahead < len(buckets):
                self.prefetch(buckets[i + ahead], grads_only)
            if ahead == 0:
                self.prefetch(bucket, grads_only)
            yield bucket
            self.state.adopt(bucket)
            self.evict(bucket)
        trim_heap()  # what the pass freed (the step's temporaries, the state adopt() moved) back to the system

    def adopt_state(self, buckets: list[Bucket]) -> None:
        """Move the optimizer state ``torch.optim`` made in memory (``load_state_dict``) into the file."""
        for _ in self.walk(buckets):
            pass

    def state_target(self, piece: LocalPiece, key: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The piece's view of its region for ``key`` in the file (so that a load writes it there, not in memory)."""
        region = self.state.regions.get(piece.slot.bucket.index, {}).get(key)
        if region is None or region.dtype != dtype:
            return None
        return region.data.narrow(0, piece.piece.chunk_start, piece.piece.numel)

    def prefetch(self, bucket: Bucket, grads_only: bool = False) -> None:
        for buffer in self._buffers(bucket, grads_only):
            buffer.prefetch()

    def evict(self, bucket: Bucket) -> None:
        for buffer in self._buffers(bucket):
            buffer.evict()

    def _buffers(self, bucket: Bucket, grads_only: bool = False) -> list[FlatBuffer]:
        state = [] if grads_only else list(self.state.regions.get(bucket.index, {}).values())
        return bucket.offloaded_buffers(grads_only) + state


class PagedState:
    """The wrapped optimizer's per-element state in regions of the paged placement (the offload file), one per bucket
    and key."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: dict[str, torch.dtype], buckets: list[Bucket],
                 placement: Placement):
        self.optimizer = optimizer
        self.layout = layout  # the per-element state's keys and dtypes (per_element_state)
        self.regions: dict[int, dict[str, FlatBuffer]] = {
            b.index: {
                key: FlatBuffer(b.layout.chunk_numel, dtype, placement, name=f"{key} of {b}")
                for key, dtype in self.layout.items()
            }
            for b in buckets
        }

    @torch.no_grad()
    def adopt(self, bucket: Bucket) -> None:
        """Move each per-element state tensor of the bucket's pieces that is not in the file yet into it."""
        regions = self.regions.get(bucket.index, {})
        for piece in bucket.pieces:
            state = self.optimizer.state.get(piece.tensor, {})
            for key, value in state.items():
                if not (isinstance(value, torch.Tensor) and value.shape == piece.tensor.shape and value.dim()):
                    continue  # a scalar (Adam's step) stays in memory
                if key not in regions or value.dtype != regions[key].dtype:
                    raise ValueError(
                        f"offload to disk: {type(self.optimizer).__name__} made per-element state {key!r} "
                        f"({value.dtype}) that a step of it at construction did not (it made "
                        f"{sorted(self.layout) or 'none'}); such an optimizer cannot be offloaded to disk. Use "
                        "offload.optimizer='cpu'."
                    )
                target = regions[key].data.narrow(0, piece.piece.chunk_start, piece.piece.numel)
                if value.data_ptr() != target.data_ptr():
                    target.copy_(value)
                    state[key] = target


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; elsewhere nothing). glibc keeps freed
    chunks in its heap (and its mmap threshold rises as large blocks are freed, so more of them land there): without
    this, the state tensors ``torch.optim`` made in memory at the first step, which :meth:`PagedState.adopt` moved to
    the file, and the step's temporaries would stay resident after the step."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def per_element_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.dtype]:
    """The keys and dtypes of the state tensors ``optimizer`` keeps per element, learned by one step of a copy
    of it, with each param group's settings, over a two-element parameter on the host."""
    keys: dict[str, torch.dtype] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        param = torch.zeros(2, requires_grad=True)
        try:
            probe = type(optimizer)([{"params": [param], **settings}])
            param.grad = torch.ones(2)
            type(probe).step(probe)
        except Exception as err:  # noqa: BLE001 (any failure: the optimizer cannot be probed)
            raise ValueError(
                f"offload to disk steps a two-element copy of {type(optimizer).__name__} to learn what state it "
                f"keeps per element, and that failed ({type(err).__name__}: {err}). Use offload.optimizer='cpu'."
            ) from err
        for key, value in probe.state[param].items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                keys[key] = value.dtype
    return keys
