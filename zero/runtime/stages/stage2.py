"""Stage 2: also shard the gradients.

A bucket's full-size ``staging`` buffer exists only while that bucket is being reduced:
gradients stay in ``p.grad`` (allocated by autograd as they arrive) until all of the
bucket's gradients are in; then they are copied into a fresh ``staging`` buffer (in the
reduce dtype) and each ``p.grad`` is dropped, the buffer is reduce-scattered in place, this
rank's chunk (already averaged) is added into the persistent ``grad_shard`` (``1/N`` of the
bucket), and the full buffer's storage is released. At most ``ZeroConfig.max_in_flight_buckets``
buffers are alive at once during backward. Another backward pass before ``step()`` adds
its reduced chunk to ``grad_shard``, as PyTorch accumulates into ``p.grad``.

Note: filling the buffer at launch rather than as each gradient arrives matters for the
peak. The first gradient of a bucket arrives when backward has just reached its layers
and their activations are all alive; by the time the last one arrives most have been freed.

Inside ``no_sync()`` the hooks do nothing, so gradients accumulate whole in ``p.grad``
(as with DDP and FSDP) until the next synchronized backward reduces them.

The staged reduction (:class:`StagedReduction`) also serves stages 0-1 under mixed precision
when the reduce dtype is not the parameters' (``zero.runtime.stages.mixed``): there the local
gradients sit in the persistent ``grad_buffer`` instead of ``p.grad``.
"""

from __future__ import annotations

import torch

from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.stages.stage0 import zero_local_grads
from zero.runtime.stages.stage1 import Stage1


class StagedReduction:
    """Local gradients are copied into a transient ``staging`` buffer in the reduce dtype; each
    reduction's chunk accumulates in a separate, persistent ``grad_shard``. A mixin: the class it is
    mixed into says where the local gradients are (:meth:`local_grad`, :meth:`release_local`). The staging
    buffer is on the device; the gradient shard on the optimizer's side (host memory when offloaded: each
    reduced chunk goes down as soon as its collective completes)."""

    staged = True
    carries = False  # nothing is set aside: each reduction adds into the gradient shard

    def local_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor | None:
        raise NotImplementedError

    def release_local(self, bucket: Bucket, slot: ParamSlot) -> None:
        raise NotImplementedError

    def reopen(self, bucket: Bucket) -> None:
        """Nothing to set aside: the next reduction is added to ``grad_shard``."""

    def close(self, bucket: Bucket) -> None:
        """Nothing was set aside."""

    def collect(self, bucket: Bucket) -> torch.Tensor:
        """Copy the bucket's local gradients into a fresh staging buffer (releasing them) and return it."""
        self._allocate_staging(bucket)
        for slot in bucket.slots:
            view = bucket.staging_view(slot)
            grad = self.local_grad(bucket, slot)
            if grad is None:  # no gradient on this rank (possibly on others)
                view.zero_()
            else:
                view.copy_(grad)
            if slot.wide_grad is not None:  # accumulated under no_sync() in the reduce dtype
                view.add_(slot.wide_grad)
                slot.wide_grad = None
            self.release_local(bucket, slot)
        return bucket.staging.data

    @staticmethod
    def _allocate_staging(bucket: Bucket) -> None:
        """Allocate the staging buffer uninitialized (every span gets written) but zero its padding."""
        bucket.staging.allocate(zero=False)
        layout = bucket.layout
        if layout.padding:
            bucket.staging.view(layout.numel, layout.padding).zero_()

    def finish_reduce(self, bucket: Bucket) -> None:
        """Add the averaged chunk into the persistent shard and release the full buffer."""
        reduced = bucket.chunk_of(bucket.staging)
        if bucket.grad_shard_buffer.is_allocated:  # a later pass before step(): accumulate
            bucket.placements.wait()  # offload: the earlier pass's chunk has landed on the host
            bucket.grad_shard.add_(reduced.to(bucket.grad_shard.device))
        else:  # first pass since zero_grad(): one copy instead of zero-fill + add (offload: down to the host)
            bucket.grad_shard_buffer.allocate(zero=False)
            bucket.placements.copy_down(bucket.grad_shard, reduced)
        bucket.grad_shard_buffer.evict()  # on disk: written back until the step reads it
        bucket.staging.free()

    def clear_shard_of(self, bucket: Bucket, slot: ParamSlot) -> None:
        if bucket.grad_shard_buffer.is_allocated:
            bucket.zero_pieces_of(slot, bucket.grad_shard)

    def zero_shard(self, bucket: Bucket, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero the gradient shard."""
        if set_to_none:
            bucket.grad_shard_buffer.free()
        elif bucket.grad_shard_buffer.is_allocated:
            bucket.grad_shard.zero_()


class Stage2(StagedReduction, Stage1):
    number = 2
    persistent_grads = False

    # ----- one backward pass ----------------------------------------------------------------------------

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Autograd accumulates apart; the reduced gradient so far waits in ``grad_shard``."""
        self.unguard(slot)

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Nothing yet: the gradient waits in ``p.grad`` until the bucket is launched."""

    def local_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor | None:
        return slot.grad

    def release_local(self, bucket: Bucket, slot: ParamSlot) -> None:
        slot.grad = None

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.clear_shard_of(bucket, slot)

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        """Drop (or zero) the gradient shard; with ``set_to_none`` also every ``p.grad``."""
        self.zero_shard(bucket, set_to_none)
        if set_to_none:
            for slot in bucket.slots:
                slot.grad = slot.local_grad = None
        else:
            zero_local_grads(bucket)
