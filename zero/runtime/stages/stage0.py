"""Stage 0: plain data parallelism, the reference point.

Every rank holds whole parameters, whole gradients and whole optimizer state, as
``DistributedDataParallel`` does: gradients live in persistent flat buckets (each
``p.grad`` is a view into one), each bucket is all-reduced in place as soon as its
gradients are ready (divided by the world size first, as DDP does). There is one shard per bucket: the whole of it.

Several backward passes before one ``step()`` need nothing special: autograd adds the next
pass's local gradients to the averaged ones in place, and averaging ``A + g_r`` over ranks
gives ``A + mean(g)`` because every rank holds the same ``A``. ``p.grad`` is always the real,
whole, averaged gradient, so ``torch.nn.utils.clip_grad_norm_`` and ``model.zero_grad()`` work
on it as with DDP.
"""

from __future__ import annotations

import torch

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.plan import StagePolicy


class Stage0:
    number = 0
    persistent_grads = True  # what the plan gives each bucket (zero.runtime.buffers.plan.StagePolicy)
    staged = False
    carries = False
    sharded_params = False
    reduce_collective = "all-reduce"
    gather_collective: str | None = None

    def num_shards(self, world_size: int) -> int:
        """How many ways each bucket is split (1: every rank owns all of it)."""
        return 1

    # ----- parameter and gradient storage ------------------------------------------------------------

    def init_params(self, bucket: Bucket) -> None:
        """Move the bucket's parameters into its flat buffer, whole (stages 0-2)."""
        bucket.pack_params()

    def policy(self, world_size: int, secondary_shards: int = 1) -> StagePolicy:
        """What this stage keeps per bucket, for the plan (``secondary_shards``: hpZ's group size, stage 3)."""
        return StagePolicy(
            number=self.number,
            num_shards=self.num_shards(world_size),
            persistent_grads=self.persistent_grads,
            staged=self.staged,
            carries=self.carries,
            sharded_params=self.sharded_params,
            reduce=self.reduce_collective,
            gather=self.gather_collective,
            secondary_shards=secondary_shards,
        )

    def init_grads(self, bucket: Bucket) -> None:
        """Prepare ``p.grad`` handling (the gradient buffer itself is planned: each ``p.grad`` points into it
        from the first backward, and the collective reduces it in place)."""

    # ----- one backward pass ----------------------------------------------------------------------------

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Point ``p.grad`` where autograd should accumulate in the coming pass: the slot's view of
        ``grad_buffer`` (it holds the slot's gradient so far, zeros if it has none)."""
        if slot.grad is None:
            slot.grad = bucket.grad_view(slot)

    def reopen(self, bucket: Bucket) -> None:
        """Reduced gradients are about to receive another pass's local ones (before ``step()``)."""

    def close(self, bucket: Bucket) -> None:
        """Undo :meth:`reopen`: the pass brought no gradient (``torch.autograd.grad``)."""

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Make sure the slot's current gradient sits in ``grad_buffer`` (no-op in steady state).

        Autograd accumulates in place into the ``p.grad`` views, so the data is usually there
        already; a ``p.grad`` replaced or cleared by user code is copied in (or zeroed).
        """
        view = bucket.grad_view(slot)
        grad = slot.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        slot.grad = view

    def published_grad(self, bucket: Bucket, slot: ParamSlot):
        """What ``p.grad`` shows after a reduction: here the whole averaged gradient."""
        return bucket.grad_view(slot)

    def adopt_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """``p.grad`` was set after the reduction (``p.grad = p.grad * 2``): copy it in."""
        self.stage_grad(bucket, slot)

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """The user cleared this parameter's gradient (``model.zero_grad()``)."""
        bucket.grad_view(slot).zero_()

    # ----- reduction ----------------------------------------------------------------------------------

    def collect(self, bucket: Bucket) -> torch.Tensor:
        """Gather the bucket's local gradients into ``staging`` and return it (here: they are in it)."""
        return bucket.staging.data

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
        """The collective: every rank gets the whole sum."""
        return comm.all_reduce(bucket.staging.data, what=f"all-reduce of {bucket}")

    def finish_reduce(self, bucket: Bucket) -> None:
        """Called once the bucket's collective has completed (the averaged result is in place)."""

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        """Zero the persistent gradient bucket in place (it stays allocated, as with DDP); with
        ``set_to_none`` every ``p.grad`` becomes ``None``, otherwise those that exist are zeros."""
        assert bucket.grad_buffer is not None
        bucket.grad_buffer.data.zero_()
        if set_to_none:
            for slot in bucket.slots:
                slot.grad = slot.local_grad = None
        else:
            zero_local_grads(bucket)

    # ----- after the optimizer step -----------------------------------------------------------------

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        """Bring every rank's updated chunk to every rank (nothing to do: all ranks stepped all of it)."""
        return None


def zero_local_grads(bucket: Bucket) -> None:
    """Zero the gradients autograd holds in ``p.grad`` outside the bucket's buffers (not yet staged),
    as ``zero_grad(set_to_none=False)`` would."""
    staged = bucket.grad_buffer.data.untyped_storage().data_ptr() if bucket.grad_buffer is not None else None
    for slot in bucket.slots:
        for grad in (slot.grad, slot.local_grad):
            if grad is not None and grad is not slot.grad_guard and grad.untyped_storage().data_ptr() != staged:
                grad.zero_()
