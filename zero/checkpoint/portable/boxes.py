"""Boxes of a tensor's global shape: how a portable checkpoint of a tensor-parallel model (``zero.checkpoint/4``)
places each rank's local tensor, as ``torch.distributed.checkpoint`` does with its chunks.

A *box* is an offset and a size per dimension of the global tensor. A ``DTensor``'s local tensor is one box (its
offset and size follow from its placements: :func:`local_box`); a plain tensor, or a replicated one, is the box of
the whole tensor. A box's elements are numbered in its own row-major order, and a checkpoint stores them as today's
1D pieces of that order. Reading elements ``[start, start + numel)`` of one box from boxes saved in another layout
(:func:`moves`) cuts the range into blocks that are contiguous in the target (:func:`runs`), meets each with the
saved boxes, and copies each intersection from the smallest range of the saved box that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

from zero.checkpoint.portable.tensorfile import numel_of


@dataclass(frozen=True)
class Box:
    """``size`` elements per dimension from ``offset`` in a tensor's global shape."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> "Box":
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return numel_of(self.size)

    @property
    def label(self) -> str:
        """The offset as it appears in the box's entry keys (``v/NAME/16,0/START``)."""
        return label(self.offset)

    def meet(self, other: "Box") -> "Box | None":
        """The intersection of two boxes, or None when they share no element."""
        low = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        high = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.size, other.offset, other.size))
        return None if any(h <= lo for lo, h in zip(low, high)) else Box(low, tuple(h - lo for lo, h in zip(low, high)))


def label(offset: Sequence[int]) -> str:
    return ",".join(str(o) for o in offset)


def strides(size: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a box of ``size``."""
    out, step = [], 1
    for n in reversed(size):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def check_tiling(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """Format 4's rule for ``name``'s boxes: each has the tensor's dimensions, holds elements and lies inside its
    ``shape``; together they tile it (their elements add up to the tensor's, and no two meet). A ValueError if not."""
    for box in boxes:
        if (len(box.offset) != len(shape) or len(box.size) != len(shape) or not box.numel
                or any(o + n > m for o, n, m in zip(box.offset, box.size, shape))):
            raise ValueError(f"a box of {name!r} at offset {box.offset} of size {box.size} is empty or does not lie "
                             f"inside its shape {shape}")
    for i, a in enumerate(boxes):
        for b in boxes[:i]:
            if a.meet(b) is not None:
                raise ValueError(f"the boxes of {name!r} at offsets {b.offset} and {a.offset} overlap")
    if sum(box.numel for box in boxes) != numel_of(shape):
        raise ValueError(f"the boxes of {name!r} do not cover its {numel_of(shape)} elements (shape {shape}): a gap")


def local_box(tensor: torch.Tensor) -> Box | None:
    """The box of ``tensor``'s global shape that this rank holds: a DTensor's local tensor (from its placements, as
    DCP computes it), else None (the whole tensor)."""
    if not isinstance(tensor, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return Box(tuple(offset), tuple(size))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local tensor, else the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def replicated(tensor: torch.Tensor) -> bool:
    """Whether every tp rank holds all of ``tensor`` (a plain tensor, or a DTensor replicated on its mesh)."""
    box = local_box(tensor)
    return box is None or box.size == tuple(tensor.shape)


def runs(size: Sequence[int], start: int, numel: int) -> list[tuple[Box, int]]:
    """Elements ``[start, start + numel)`` of a box of ``size`` (in its row-major order) as blocks, each contiguous
    in that order, with where each begins in the range: ``[(block, at), ...]`` (at most ``2 * ndim - 1`` of them)."""
    if numel == 0:
        return []
    stride = strides(size)
    out, position, end = [], start, start + numel
    while position < end:
        coords = [position // s % n for s, n in zip(stride, size)]
        for k in range(len(size)):  # the outermost dimension whose whole slabs start here and fit
            if position % stride[k] == 0 and end - position >= stride[k]:
                count = min((end - position) // stride[k], size[k] - coords[k])
                out.append((Box(tuple(coords), (1,) * k + (count,) + tuple(size[k + 1:])), position - start))
                position += count * stride[k]
                break
        else:  # a 0-dim box: its one element
            out.append((Box((), ()), 0))
            position += 1
    return out


@dataclass(frozen=True)
class Move:
    """One copy of a read: elements ``[start, start + numel)`` of saved box number ``saved`` (its row-major order)
    hold ``block`` (global coordinates), which lies in the target's run ``run`` (contiguous in the target's order),
    beginning at ``at`` of the range read. ``direct``: those elements are the block, in the target's order too."""

    saved: int
    start: int
    numel: int
    at: int
    run: Box
    block: Box
    direct: bool

    def target(self, out: torch.Tensor) -> torch.Tensor:
        """Where the block lands in ``out`` (the range read, 1D): a 1D range when ``direct``, else a strided view."""
        if self.direct:
            return out.narrow(0, self.at + _flat(self.block.offset, self.run), self.numel)
        whole = out.narrow(0, self.at, self.run.numel).view(self.run.size)
        return whole[tuple(slice(b - r, b - r + n)
                           for b, r, n in zip(self.block.offset, self.run.offset, self.block.size))]

    def source(self, span: torch.Tensor, saved: Box) -> torch.Tensor:
        """The block in ``span``, the saved range read (a new 1D tensor: contiguous)."""
        return span if self.direct else span.as_strided(self.block.size, strides(saved.size))


def _flat(coords: Sequence[int], box: Box) -> int:
    """The position of global ``coords`` in ``box``'s row-major order."""
    return sum((c - o) * s for c, o, s in zip(coords, box.offset, strides(box.size)))


def contiguous_in(block: Box, box: Box) -> bool:
    """Whether ``block`` (inside ``box``) is one range of ``box``'s row-major order."""
    partial = [i for i, (n, m) in enumerate(zip(block.size, box.size)) if n != m]
    return not partial or all(n == 1 for n in block.size[: partial[-1]])  # whole after the last partial dimension


def moves(saved: Sequence[Box], target: Box, start: int, numel: int) -> list[Move]:
    """How to read elements ``[start, start + numel)`` of box ``target`` (its row-major order) from ``saved`` boxes
    that tile the tensor: one move when a saved box is the target itself (the same layout: the same range of it),
    else one per block of the range and saved box it meets, in the range's order."""
    for i, box in enumerate(saved):
        if box == target:
            return [Move(i, start, numel, 0, target, target, True)] if numel else []
    found = []
    for run, at in runs(target.size, start, numel):
        run = Box(tuple(o + r for o, r in zip(target.offset, run.offset)), run.size)
        for i, box in enumerate(saved):
            block = run.meet(box)
            if block is None:
                continue
            first = _flat(block.offset, box)
            last = _flat(tuple(b + n - 1 for b, n in zip(block.offset, block.size)), box)
            direct = contiguous_in(block, box) and contiguous_in(block, run)
            found.append(Move(i, first, last - first + 1, at, run, block, direct))
    return found
