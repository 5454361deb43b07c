"""The runtime's side of the offload targets (``zero.offload.TARGETS``, or one of your own named by import path): each
target's placement built for this rank (the ``Placement`` subclass its entry names, by :meth:`Placement.make`), the
sides of the buckets put in them (:meth:`~zero.runtime.buffers.placement.Placements.of`), and how passes over the
optimizer's side walk the buckets: in memory, or through a window of host memory when a side's target pages
(:mod:`zero.runtime.offload.paging`).

Nothing here names a target: a new one is its entry in the table and its placement class.

May import: ``torch``, the policies, :mod:`zero.runtime.buffers`."""

from __future__ import annotations

import torch

from zero.offload import Offload, OffloadTarget, imported
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.placement import Placement, Placements
from zero.runtime.offload.paging import PagedState, Resident, WindowPaging


def placement_class(target: OffloadTarget) -> type[Placement]:
    """The ``Placement`` subclass ``target.placement`` names, imported (a ``ValueError`` naming the target if not)."""
    found = imported(target.placement, f"offload target {target.name!r}: placement")
    if not (isinstance(found, type) and issubclass(found, Placement)):
        raise ValueError(f"offload target {target.name!r} names {found!r} as its placement, not a subclass of "
                         "zero.runtime.buffers.placement.Placement (docs/offload.md, 'Offload targets')")
    return found


def placements_of(offload: Offload, device: torch.device, rank: int, world_size: int) -> Placements:
    """This rank's placements as ``offload`` says: each side of the buckets in its target's placement, built here."""
    return Placements.of(offload, device,
                         lambda target: placement_class(target).make(offload, device, rank, world_size))


def paging_of(optimizer: torch.optim.Optimizer, buckets: list[Bucket], placements: Placements,
              state: dict[str, torch.dtype], buffer_count: int) -> Resident:
    """How passes over the optimizer side walk ``buckets`` (the trainable ones): in memory, or a window of
    ``buffer_count`` buckets through host memory when a side's target pages (``state``: the wrapped ``optimizer``'s
    per-element state, which the paged placement holds too)."""
    paged = placements.paged
    if paged is None:
        return Resident()
    return WindowPaging(PagedState(optimizer, state, buckets, paged), paged, buffer_count)
