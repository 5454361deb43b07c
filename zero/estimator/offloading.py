"""What the estimator prices of offload: where ``ZeroConfig.offload`` puts the optimizer's side and stage 3's
parameter shards (validated by ``zero.offload``'s and ``zero.config``'s rules, once), and the host-memory and disk
bytes of the buffers the stage plan puts off the device.

Each side's offload target (``zero.offload.TARGETS``, or one of your own) is priced by its entry alone: its buffers
are planned with a stand-in placement whose ``where`` is the target's (under fake tensors nothing is allocated), so
buffers in host memory count as host bytes, and those of a target that pages as file bytes of which a window of
``buffer_count`` buckets is in host memory. The planner tries the table's targets, fastest first (their ``tier``).

Host and disk bytes are read from the same bucket plans the device side is (``zero.runtime.buffers.plan``: each buffer's
``where``), built with the placements the runtime itself derives from the policy (``Placements.of``), so the
estimate and the runtime cannot disagree on which buffer lives where. The offload file is sized by the runtime's own
count (``zero.runtime.offload.disk.planned_disk_bytes``: each buffer on disk and each trainable bucket's region
per key of the optimizer's per-element state, page-rounded, after a header page), with the state's keys learned by
the runtime's own probe (``zero.runtime.offload.paging.per_element_state``); host memory then holds a window of
``buffer_count`` buckets of it at a time (``zero.runtime.offload.paging``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.estimator.configuration import DISK_PATH
from zero.offload import Offload, OffloadTarget, target_of
from zero.runtime.buffers.placement import DevicePlacement, Placements, Where
from zero.runtime.buffers.plan import BucketPlan, StagePlan
from zero.runtime.offload.disk import HEADER_BYTES, planned_disk_bytes

BUFFER_COUNTS = (1, 64)  # as zero.Offload.buffer_count takes it


@dataclass(frozen=True)
class OffloadChoice:
    """Where the optimizer's side and stage 3's parameter shards live, as ``Offload`` places them."""

    optimizer: str = "none"  # where the optimizer's side lives: "none" (the device), "cpu", "disk" (a target's name)
    params: str = "none"  # stage 3's parameter shards: "none", "cpu", "disk" (or a target's import path)
    buffer_count: int = 2
    ratio: float = 1.0  # partial offload: the share of the buckets' elements whose optimizer side is off the device
    delayed: bool = False  # offload.delayed_step: the host holds a copy of the gradients for the background step

    @classmethod
    def of(cls, offload: Offload) -> "OffloadChoice":
        """Where ``ZeroConfig.offload`` (already validated, with a number as its ratio) puts things: stage 3's
        parameter shards' offload takes the optimizer's side along (to disk with theirs)."""
        if offload.ratio == "auto":
            raise ValueError("offload.ratio='auto' is chosen when ZeroOptimizer is built, by pricing each ratio "
                             "(zero.auto_ratio); estimate a number, or let zero.estimator.plan choose one")
        optimizer = offload.optimizer if not target_of(offload.optimizer).on_device else offload.params
        return cls(optimizer, offload.params, offload.buffer_count, offload.ratio, offload.delayed_step)

    @property
    def target(self) -> OffloadTarget:
        """The optimizer side's target."""
        return target_of(self.optimizer)

    @property
    def offloaded(self) -> bool:
        return not self.target.on_device and self.ratio > 0

    @property
    def pages(self) -> bool:
        """The optimizer's side is paged through host memory (and stage 3's shards go with it: ``Offload``'s rule)."""
        return self.target.pages

    def policy(self) -> Offload:
        """The ``zero.Offload`` that runs this choice (with :data:`DISK_PATH` as its directory when a target needs
        one)."""
        needs_path = self.target.needs_path or target_of(self.params, "offload.params").needs_path
        return Offload(optimizer=self.optimizer, params=self.params, buffer_count=self.buffer_count,
                       path=DISK_PATH if needs_path else None, ratio=self.ratio, delayed_step=self.delayed)

    def placements(self) -> Placements:
        """The runtime's placements for this choice on the estimator's (fake) CPU model: each target's a stand-in
        whose ``where`` is the target's (under fake tensors nothing is allocated)."""
        device = torch.device("cpu")
        return Placements.of(self.policy(), device, lambda target: DevicePlacement(device, target.where))


def host_bytes(plan: BucketPlan) -> int:
    """Bytes of the bucket's buffers the plan puts in host memory (pinned or not)."""
    return sum(s.nbytes for s in plan.buffers if s.where in (Where.HOST, Where.PINNED_HOST))


def file_bytes(plan: StagePlan, bucket: BucketPlan, state: dict[str, torch.dtype]) -> int:
    """Bytes of the offload file that hold ``bucket``: the runtime's own count (``planned_disk_bytes``) for a plan of
    that bucket alone, less the file's header (so a plan's buckets add up to its file, header aside)."""
    return planned_disk_bytes(StagePlan(plan.policy, plan.shard_index, (bucket,)), state) - HEADER_BYTES


@dataclass(frozen=True)
class OffBytes:
    """What one configuration keeps off the device."""

    host: float  # host memory: buffers placed there, and with offload to disk the window of buckets mapped from it
    disk: float  # the offload file (0 without offload to disk)


def window(files: list[int], buffer_count: int) -> int:
    """Host memory the largest ``buffer_count`` buckets' files take when mapped (``zero.runtime.offload.paging``'s
    window)."""
    return sum(sorted(files, reverse=True)[:buffer_count])
