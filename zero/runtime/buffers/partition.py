"""Build the runtime buckets for a model and a wrapped optimizer (construction only).

Parameters are packed into bucket layouts (``zero.runtime.buffers.layout``), each layout gets its plan
(``zero.runtime.buffers.plan``: which buffers, where), and each bucket is built from its plan. The stage then fills
them (``Stage.init_params``): whole parameters at stages 0-2, shards at stage 3.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from zero.precision import BufferDtypes
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.layout import plan_buckets
from zero.runtime.buffers.local_tensor import local_of
from zero.runtime.buffers.placement import DevicePlacement, Placements
from zero.runtime.buffers.plan import StagePlan, StagePolicy, plan_bucket
from zero.runtime.buffers.units import UnitSpec
from zero.runtime.guards.ownership import managed_elsewhere


@dataclass
class Partition:
    """The buckets of one rank, plus the parameters left out of them."""

    buckets: list[Bucket]  # trainable buckets first, then frozen ones (stage 3)
    frozen: list[tuple[str, torch.nn.Parameter]]  # in the optimizer, requires_grad=False, kept whole (stages 0-2)
    units: list[UnitSpec]  # stage 3's units of gathering (empty at stages 0-2)
    plan: StagePlan  # every bucket's buffers and collectives

    @property
    def trainable_buckets(self) -> list[Bucket]:
        return [bucket for bucket in self.buckets if bucket.trainable]

    @property
    def slots(self) -> list[ParamSlot]:
        """The trainable parameters' slots."""
        return [slot for bucket in self.trainable_buckets for slot in bucket.slots]

    @property
    def frozen_slots(self) -> list[ParamSlot]:
        """Stage 3: the frozen parameters sharded in frozen buckets."""
        return [slot for bucket in self.buckets if not bucket.trainable for slot in bucket.slots]

    @property
    def numel(self) -> int:
        """Ψ: trainable elements managed (no padding)."""
        return sum(bucket.layout.numel for bucket in self.trainable_buckets)

    @property
    def padded_numel(self) -> int:
        return sum(bucket.layout.padded_numel for bucket in self.trainable_buckets)

    @property
    def frozen_numel(self) -> int:
        """Elements of the frozen parameters sharded at stage 3 (no padding)."""
        return sum(bucket.layout.numel for bucket in self.buckets if not bucket.trainable)


def build_partition(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    *,
    bucket_size_bytes: int,
    policy: StagePolicy,
    shard_index: int,
    plan: Callable[[list[torch.nn.Parameter]], list[UnitSpec]] | None = None,
    device: torch.device | None = None,
    dtypes_of: Callable[[torch.nn.Parameter], BufferDtypes] | None = None,
    placements: Placements | None = None,
    check: Callable[[StagePlan], None] | None = None,
) -> Partition:
    """Pack the optimizer's trainable parameters into buckets (no parameter data is copied yet).

    With a unit ``plan`` (stage 3) every frozen parameter of the model (``requires_grad=False``,
    in the optimizer or not) is packed too, into frozen buckets of its unit, so that a frozen
    base model with small trainable adapters is sharded like the rest.

    Parameters are packed in reverse registration order, which approximates the order in
    which backward produces their gradients, so early buckets fill (and go out) first.
    With a unit ``plan`` (stage 3) each unit gets bucket(s) of its own, whatever their size,
    and units are ordered by when backward should finish them (the unit holding the
    earliest-registered parameter last). Parameters on the ``meta`` device get buffers on
    ``device`` but are not copied (see :mod:`zero.runtime.materialize`). ``dtypes_of(p)`` gives the
    buffers' dtypes for ``p`` (``zero.precision``; default: its own dtype throughout); a bucket
    holds parameters of one kind only. ``policy`` says what the stage keeps per bucket and ``placements``
    where (default: everything on the parameters' device). ``check`` sees the whole plan before any buffer is
    allocated (e.g. that the disk has room for it).
    """
    dtypes_of = dtypes_of or (lambda p: BufferDtypes(p.dtype, p.dtype, p.dtype))
    names = {p: name for name, p in model.named_parameters()}
    order = {p: i for i, p in enumerate(names)}
    group_of: dict[torch.nn.Parameter, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} (param group {gi}) that is not "
                    f"in the model passed to ZeroOptimizer. Build the optimizer from model.parameters() of the "
                    f"same model you pass in."
                )
            group_of[p] = gi
    frozen = [(names[p], p) for p in group_of if not p.requires_grad]
    packed = sorted((p for p in group_of if p.requires_grad), key=lambda p: -order[p])
    if plan is not None:  # stage 3 shards every frozen parameter of the model (another optimizer's excepted)
        frozen = []
        packed += sorted((p for p in names if not p.requires_grad and not managed_elsewhere(p)),
                         key=lambda p: -order[p])
    if not any(p.requires_grad for p in packed):
        raise ValueError("the optimizer holds no parameter with requires_grad=True: there is nothing to train")
    locals_ = {p: local_of(p) for p in packed}  # what this rank holds of each (a DTensor's local tensor)
    numel = {p: locals_[p].local(p).numel() for p in packed}
    for p in packed:
        if p.layout != torch.strided:
            raise ValueError(f"parameter {names[p]!r} has layout {p.layout}; ZeRO packs dense (strided) parameters")
        if numel[p] == 0:
            raise ValueError(
                f"parameter {names[p]!r} has no elements on this rank, so there is nothing of it to shard. Keep it "
                "out of the optimizer (and, at stage 3, which packs every frozen parameter of the model, out of the "
                "model: a buffer), or give it a size."
            )

    def device_of(p: torch.nn.Parameter) -> torch.device:
        if p.is_meta:
            if device is None:
                raise ValueError(f"parameter {names[p]!r} is on the meta device; only stage 3 can materialize it")
            return device
        return p.device

    units = plan(packed) if plan is not None else []
    units.sort(key=lambda u: -min(order[p] for p in u.params))
    unit_of = {p: i for i, unit in enumerate(units) for p in unit.params}
    if units:  # trainable buckets first, in unit order (the reducer launches them in this order)
        packed.sort(key=lambda p: (not p.requires_grad, unit_of[p], -order[p]))
        bucket_cap = sum(numel.values())  # one bucket per unit (and dtype)
    else:
        bucket_cap = max(1, bucket_size_bytes // max(dtypes_of(p).compute.itemsize for p in packed))
    layouts = plan_buckets(
        [numel[p] for p in packed],
        [(p.dtype, dtypes_of(p), device_of(p), unit_of.get(p), p.requires_grad) for p in packed],
        bucket_cap=bucket_cap,
        num_shards=policy.num_shards,
    )
    firsts = [packed[layout.spans[0].param_index] for layout in layouts]
    where = (placements.for_buckets([layout.padded_numel for layout in layouts]) if placements
             else [Placements.on(DevicePlacement(device_of(first))) for first in firsts])
    stage_plan = StagePlan(policy, shard_index, tuple(
        plan_bucket(policy, layout, dtypes_of(first), first.requires_grad, here)
        for layout, first, here in zip(layouts, firsts, where)
    ))
    if check is not None:
        check(stage_plan)
    buckets = []
    for bucket_plan, first, here in zip(stage_plan.buckets, firsts, where):
        bucket = Bucket(bucket_plan, shard_index, device_of(first), here)
        if units:  # stage 3
            bucket.join_unit(units[unit_of[first]])
        for span in bucket_plan.layout.spans:
            p = packed[span.param_index]
            bucket.add(ParamSlot(p, names[p], group_of.get(p, -1), weakref.ref(bucket), span, order[p],
                                 local=locals_[p]))
        buckets.append(bucket)
    return Partition(buckets, frozen, units, stage_plan)
