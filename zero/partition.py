"""Build the runtime buckets for a model and a wrapped optimizer (construction only).

The stage then fills them (``Stage.init_params``): whole parameters at stages 0-2, shards at stage 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zero.bucket import Bucket, ParamSlot
from zero.layout import plan_buckets
from zero.units import UnitSpec


@dataclass
class Partition:
    """The buckets of one rank, plus the parameters left out of them."""

    buckets: list[Bucket]
    frozen: list[tuple[str, torch.nn.Parameter]]  # in the optimizer but requires_grad=False
    units: list[UnitSpec]  # stage 3's units of gathering (empty at stages 0-2)

    @property
    def slots(self) -> list[ParamSlot]:
        return [slot for bucket in self.buckets for slot in bucket.slots]

    @property
    def numel(self) -> int:
        """Ψ: trainable elements managed (no padding)."""
        return sum(bucket.layout.numel for bucket in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(bucket.layout.padded_numel for bucket in self.buckets)


def build_partition(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    *,
    bucket_size_bytes: int,
    num_shards: int,
    shard_index: int,
    plan: Callable[[list[torch.nn.Parameter]], list[UnitSpec]] | None = None,
    device: torch.device | None = None,
) -> Partition:
    """Pack the optimizer's trainable parameters into buckets (no parameter data is copied yet).

    Parameters are packed in reverse registration order, which approximates the order in
    which backward produces their gradients, so early buckets fill (and go out) first.
    With a unit ``plan`` (stage 3) each unit gets bucket(s) of its own, whatever their size,
    and units are ordered by when backward should finish them (the unit holding the
    earliest-registered parameter last). Parameters on the ``meta`` device get buffers on
    ``device`` but are not copied (see :mod:`zero.materialize`).
    """
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
    trainable = sorted((p for p in group_of if p.requires_grad), key=lambda p: -order[p])
    if not trainable:
        raise ValueError("the optimizer holds no parameter with requires_grad=True: there is nothing to train")
    for p in trainable:
        if p.layout != torch.strided:
            raise ValueError(f"parameter {names[p]!r} has layout {p.layout}; ZeRO packs dense (strided) parameters")

    def device_of(p: torch.nn.Parameter) -> torch.device:
        if p.is_meta:
            if device is None:
                raise ValueError(f"parameter {names[p]!r} is on the meta device; only stage 3 can materialize it")
            return device
        return p.device

    units = plan(trainable) if plan is not None else []
    units.sort(key=lambda u: -min(order[p] for p in u.params))
    unit_of = {p: i for i, unit in enumerate(units) for p in unit.params}
    if units:
        trainable.sort(key=lambda p: (unit_of[p], -order[p]))
        bucket_cap = sum(p.numel() for p in trainable)  # one bucket per unit (and dtype)
    else:
        bucket_cap = max(1, bucket_size_bytes // max(p.element_size() for p in trainable))
    layouts = plan_buckets(
        [p.numel() for p in trainable],
        [(p.dtype, device_of(p), unit_of.get(p)) for p in trainable],
        bucket_cap=bucket_cap,
        num_shards=num_shards,
    )
    buckets = []
    for layout in layouts:
        first = trainable[layout.spans[0].param_index]
        bucket = Bucket(layout, shard_index, first.dtype, device_of(first))
        bucket.unit = units[unit_of[first]] if units else None
        for span in layout.spans:
            p = trainable[span.param_index]
            bucket.add(ParamSlot(p, names[p], group_of[p], bucket, span, order[p]))
        buckets.append(bucket)
    return Partition(buckets, frozen, units)
