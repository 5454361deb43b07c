"""What the estimator prices of offload: the choice (``estimate(offload=..., params_offload=...)``) checked by
``zero.offload``'s and ``zero.config``'s rules, and the host-memory and disk bytes of the buffers the stage plan
puts off the device.

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
from typing import Union

import torch

from zero.offload import Offload
from zero.runtime.buffers.placement import DevicePlacement, Placements, Where
from zero.runtime.buffers.plan import BucketPlan, StagePlan
from zero.runtime.offload.disk import HEADER_BYTES, planned_disk_bytes

OFFLOADS = ("none", "cpu", "disk")  # fastest first: the planner's order
BUFFER_COUNTS = (1, 64)  # as zero.Offload.buffer_count takes it
# offload to disk names a directory; the estimator's configurations carry this one (the runtime makes nothing here)
DISK_PATH = "/local_nvme/zero"

OffloadArg = Union[bool, str, None]


@dataclass(frozen=True)
class OffloadChoice:
    """Where the optimizer's side and stage 3's parameter shards live, as ``Offload`` places them."""

    optimizer: str = "none"  # where the optimizer's side lives: "none" (the device), "cpu" or "disk"
    params: str = "none"  # stage 3's parameter shards: "none", "cpu" or "disk"
    buffer_count: int = 2
    ratio: float = 1.0  # partial offload: the share of the buckets' elements whose optimizer side is off the device

    @property
    def offloaded(self) -> bool:
        return self.optimizer != "none" and self.ratio > 0

    @property
    def on_disk(self) -> bool:
        return self.optimizer == "disk"

    def policy(self) -> Offload:
        """The ``zero.Offload`` that runs this choice (with :data:`DISK_PATH` as its directory when on disk)."""
        return Offload(optimizer=self.optimizer, params=self.params, buffer_count=self.buffer_count,
                       path=DISK_PATH if self.on_disk else None, ratio=self.ratio)

    def placements(self) -> Placements:
        """The runtime's placements for this choice on the estimator's (fake) CPU model; disk is a placement whose
        ``where`` says so (under fake tensors nothing is allocated)."""
        policy, device = self.policy(), torch.device("cpu")
        return Placements.of(policy, device, DevicePlacement(device, Where.DISK) if policy.on_disk else None)

    def config(self) -> dict:
        """``ZeroConfig(offload=...)``'s value (only what differs from the defaults)."""
        return self.policy().model_dump(exclude_defaults=True)


def offload_choice(offload: OffloadArg, params_offload: str, stage: int, buffer_count: int = 2,
                   ratio: float = 1.0) -> OffloadChoice:
    """``estimate()``'s offload arguments checked as ``ZeroConfig`` checks ``offload=`` (``ValueError`` naming the fix):
    ``offload`` is where the optimizer's side goes (``False``/``True`` read as ``"none"``/``"cpu"``),
    ``params_offload`` where stage 3's parameter shards go, which takes the optimizer's side off the device too
    (to disk with ``"disk"``, else to host memory); ``ratio`` the share of it offloaded (``offload.ratio``)."""
    optimizer = ("cpu" if offload else "none") if isinstance(offload, bool) or offload is None else offload
    if optimizer not in OFFLOADS:
        raise ValueError(f"offload must be 'none', 'cpu' or 'disk' (False and True read as 'none' and 'cpu'), "
                         f"got {offload!r}")
    if params_offload not in OFFLOADS:
        raise ValueError(f"params_offload must be 'none', 'cpu' or 'disk', got {params_offload!r}")
    if not (isinstance(buffer_count, int) and BUFFER_COUNTS[0] <= buffer_count <= BUFFER_COUNTS[1]):
        raise ValueError(f"buffer_count (buckets mapped in host memory at a time with offload to disk) must be a "
                         f"whole number from {BUFFER_COUNTS[0]} to {BUFFER_COUNTS[1]}, got {buffer_count!r}")
    if params_offload != "none" and stage != 3:
        raise ValueError(f"params_offload={params_offload!r} needs stage 3 (got stage {stage}): only stage 3 shards "
                         "the parameters. Use stage=3, or params_offload='none'.")
    if params_offload == "disk" and optimizer == "cpu":
        raise ValueError("params_offload='disk' keeps the optimizer's side on disk too (the master beside the "
                         "parameter shard): use offload='disk' (or leave it 'none') with it")
    if optimizer == "none" and params_offload != "none":  # the parameter shard's offload takes the optimizer along
        optimizer = params_offload
    if optimizer != "none" and stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3: stage 0 keeps the whole optimizer state on every rank. "
                         "Use stage 1 or higher, or offload='none'.")
    if ratio != 1.0 and (optimizer != "cpu" or not 0 <= ratio <= 1):
        raise ValueError(f"offload_ratio={ratio!r} is the share of the optimizer side offloaded to host memory: a "
                         "number from 0 to 1, with offload='cpu' (not 'disk')")
    return OffloadChoice(optimizer, params_offload, buffer_count, ratio)


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
