"""Build the runtime buckets for a model and a wrapped optimizer (construction only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.bucket import Bucket, ParamSlot
from zero.layout import plan_buckets


@dataclass
class Partition:
    """The buckets of one rank, plus the parameters left out of them."""

    buckets: list[Bucket]
    frozen: list[tuple[str, torch.nn.Parameter]]  # in the optimizer but requires_grad=False

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
) -> Partition:
    """Pack the optimizer's trainable parameters into buckets and move them into flat buffers.

    Parameters are packed in reverse registration order, which approximates the order in
    which backward produces their gradients, so early buckets fill (and go out) first.
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

    itemsize = max(p.element_size() for p in trainable)
    layouts = plan_buckets(
        [p.numel() for p in trainable],
        [(p.dtype, p.device) for p in trainable],
        bucket_cap=max(1, bucket_size_bytes // itemsize),
        num_shards=num_shards,
    )
    buckets = []
    for layout in layouts:
        first = trainable[layout.spans[0].param_index]
        bucket = Bucket(layout, shard_index, first.dtype, first.device)
        for span in layout.spans:
            p = trainable[span.param_index]
            bucket.adopt(ParamSlot(p, names[p], group_of[p], bucket, span))
        buckets.append(bucket)
    return Partition(buckets, frozen)
