"""Stages 0-1 under mixed precision (``precision.param_dtype`` set).

The optimizer steps fp32 master weights, so the reduced gradient it needs is not what ``p.grad``
(in the parameters' low-precision dtype) can hold: at stage 0 too, ``p.grad`` shows a
:class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard after a reduction, as at stages 1-3. Stage 0 is
then stage 1's gradient handling with one shard and an all-reduce (:class:`Replicated`).

When the reduce dtype is not the parameters' (the default: bf16 parameters, fp32 reduction),
the local gradients stay in the persistent ``grad_buffer`` (autograd accumulates into ``p.grad``
views of it, as at stages 0-1 in full precision) and each reduction copies them into a transient
staging buffer in the reduce dtype, whose chunk accumulates in a separate gradient shard
(:class:`~zero.runtime.stages.stage2.StagedReduction`, as at stage 2).
"""

from __future__ import annotations

import torch

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.stages.stage1 import Stage1
from zero.runtime.stages.stage2 import StagedReduction


class Stage1Staged(StagedReduction, Stage1):
    """Stage 1 whose reduce dtype differs from the parameters': persistent local gradients, staged reduction."""

    def local_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor | None:
        return bucket.grad_view(slot)  # stage_grad put the pass's gradient there (zeros if it had none)

    def release_local(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Nothing: the next pass's gradients replace the view's contents (``Stage1.before_pass``)."""

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        super().clear_grad(bucket, slot)  # the local gradient (no reduced gradient is carried when staged)
        self.clear_shard_of(bucket, slot)

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        self.zero_shard(bucket, set_to_none)
        super().zero_grad(bucket, set_to_none)


class Replicated:
    """Stage 0's side of a mixed-precision stage: one shard (every rank steps all of it), all-reduce."""

    number = 0
    reduce_collective = "all-reduce"
    gather_collective = None

    def num_shards(self, world_size: int) -> int:
        return 1

    @property
    def guard_reason(self) -> str:
        return (
            "belongs to the fp32 master weights (mixed precision); p.grad, in the parameters' low-precision "
            "dtype, does not hold it"
        )

    def reduce(self, bucket: Bucket, comm: Communicator) -> Handle:
        return comm.all_reduce(bucket.staging.data, what=f"all-reduce of {bucket}")

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        return None


class Stage0Mixed(Replicated, Stage1):
    """Stage 0 with master weights, reduced in the parameters' dtype (in place)."""


class Stage0MixedStaged(Replicated, Stage1Staged):
    """Stage 0 with master weights, reduced in another dtype (staged)."""
