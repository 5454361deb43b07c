"""What every ZeRO stage is: its collectives and its gradients' handling (``zero.runtime.stages.gradients``), over
the buffers its plan gives each bucket. The reducer (``zero.runtime.reduction``) and the gatherer
(``zero.runtime.gathering``) call the methods here; a stage class (``stage0`` ... ``stage3``) states its number,
its collectives and which gradient handling it takes, mixed precision included: there is no subclass per precision.
"""

from __future__ import annotations

import torch

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.plan import StagePolicy
from zero.runtime.stages.gradients import Gradients


class AllReduce:
    """One shard (every rank steps all of the bucket); every rank gets the whole sum."""

    name = "all-reduce"

    @staticmethod
    def num_shards(world_size: int) -> int:
        return 1

    @staticmethod
    def reduce(bucket: Bucket, comm: Communicator) -> Handle:
        return comm.all_reduce(bucket.staging.data, what=f"all-reduce of {bucket}")


class ReduceScatter:
    """A shard per rank; each rank gets the sum of its own chunk."""

    name = "reduce-scatter"

    @staticmethod
    def num_shards(world_size: int) -> int:
        return world_size

    @staticmethod
    def reduce(bucket: Bucket, comm: Communicator) -> Handle:
        staging = bucket.staging
        return comm.reduce_scatter(bucket.chunk_of(staging), staging.data, what=f"reduce-scatter of {bucket}")


class Stage:
    """The protocol every stage implements, and what they share (see the module docstring)."""

    number: int
    sharded_params = False  # stage 3: only a chunk of the parameters persists
    gather_collective: str | None = None  # the parameters' collective, if any

    def __init__(self, reduction: AllReduce | ReduceScatter, gradients: Gradients):
        self.reduction, self.gradients = reduction, gradients

    @property
    def reduce_collective(self) -> str:
        return self.reduction.name

    def num_shards(self, world_size: int) -> int:
        """How many ways each bucket is split (1: every rank owns all of it)."""
        return self.reduction.num_shards(world_size)

    def policy(self, world_size: int, secondary_shards: int = 1) -> StagePolicy:
        """What this stage keeps per bucket, for the plan (``secondary_shards``: hpZ's group size, stage 3)."""
        return StagePolicy(
            number=self.number,
            num_shards=self.num_shards(world_size),
            persistent_grads=self.gradients.persistent,
            staged=self.gradients.staged,
            carries=self.gradients.carries,
            sharded_params=self.sharded_params,
            reduce=self.reduce_collective,
            gather=self.gather_collective,
            secondary_shards=secondary_shards,
        )

    # ----- parameter and gradient storage ------------------------------------------------------------

    def init_params(self, bucket: Bucket) -> None:
        """Move the bucket's parameters into its flat buffer, whole (stages 0-2)."""
        bucket.pack_params()

    def init_grads(self, bucket: Bucket) -> None:
        """Prepare ``p.grad`` handling (the gradient buffers themselves are planned)."""
        self.gradients.init(bucket)

    # ----- one backward pass ----------------------------------------------------------------------------

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Point ``p.grad`` where autograd should accumulate in the coming pass."""
        self.gradients.before_pass(bucket, slot)

    def reopen(self, bucket: Bucket) -> None:
        """Reduced gradients are about to receive another pass's local ones (before ``step()``)."""
        self.gradients.reopen(bucket)

    def close(self, bucket: Bucket) -> None:
        """Undo :meth:`reopen`: the pass brought no gradient (``torch.autograd.grad``)."""
        self.gradients.close(bucket)

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """The slot's gradient of this pass is complete: put it where the reduction reads it."""
        self.gradients.stage_grad(bucket, slot)

    def published_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor:
        """What ``p.grad`` shows after a reduction: the whole averaged gradient, or a guard."""
        return self.gradients.published_grad(bucket, slot)

    def publish_unreduced(self, bucket: Bucket, slot: ParamSlot) -> None:
        """A pass added local gradients on top of reduced ones without a reduction: what ``p.grad`` shows then."""
        self.gradients.publish_unreduced(bucket, slot)

    def drop_guards(self, bucket: Bucket) -> None:
        """The optimizer lets go of the model: no ``p.grad`` is left a guard."""
        self.gradients.drop_guards(bucket)

    def adopt_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """``p.grad`` was set after the reduction: copy it in, or refuse."""
        self.gradients.adopt_grad(bucket, slot)

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """The user cleared this parameter's gradient (``model.zero_grad()``)."""
        self.gradients.clear_grad(bucket, slot)

    def scale_grad(self, bucket: Bucket, slot: ParamSlot, scalings: list[tuple[str, float]], reduced: bool) -> None:
        """``p.grad.div_(n)`` (or ``mul_``) on a guard: the same on this rank's pieces."""
        self.gradients.scale_grad(bucket, slot, scalings, reduced)

    # ----- reduction ----------------------------------------------------------------------------------

    def collect(self, bucket: Bucket) -> torch.Tensor:
        """Gather the bucket's local gradients into ``staging`` and return it."""
        return self.gradients.collect(bucket)

    def launch_reduce(self, bucket: Bucket, comm: Communicator, divide_factor: int = 1) -> Handle:
        """Start reducing ``staging`` (filled by :meth:`collect`). It is divided by the world size before
        summing, as DDP does, so the sum is the average (and its rounding is DDP's); with hierarchical sharding
        by every rank's count, as the sum runs across the groups too. ``divide_factor``: divided by that too (a
        pipeline schedule's micro-batches: one division, not two)."""
        divisor = comm.data_parallel_size * divide_factor
        if divisor > 1:
            bucket.staging.data.div_(divisor)
        return self.reduce(bucket, comm)

    def reduce(self, bucket: Bucket, comm: Communicator) -> Handle:
        """The collective."""
        return self.reduction.reduce(bucket, comm)

    def finish_reduce(self, bucket: Bucket) -> None:
        """Called once the bucket's collective has completed."""
        self.gradients.finish_reduce(bucket)

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        """``opt.zero_grad()``: with ``set_to_none`` every ``p.grad`` becomes ``None``, otherwise those that exist are
        zeros."""
        self.gradients.zero_grad(bucket, set_to_none)

    # ----- after the optimizer step -----------------------------------------------------------------

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        """Bring every rank's updated chunk to every rank (``None``: nothing to gather)."""
        return None


def all_gather_after_step(bucket: Bucket, comm: Communicator) -> Handle:
    """Stages 1-2: every rank's updated chunk into every rank's whole parameters, in place."""
    return comm.all_gather(bucket.param_buffer.data, bucket.shard, what=f"all-gather of {bucket}")
