"""Stage 2: also shard the gradients.

A bucket's full-size ``grad_buffer`` exists only while that bucket is being reduced:
gradients stay in ``p.grad`` (allocated by autograd as they arrive) until all of the
bucket's gradients are in; then they are copied into a fresh ``grad_buffer`` and each
``p.grad`` is dropped, the buffer is reduce-scattered in place, this rank's chunk
(already averaged) is added into the persistent ``grad_shard`` (``1/N`` of the bucket),
and the full buffer's storage is released. At most ``ZeroConfig.max_in_flight_buckets``
buffers are alive at once during backward. Another backward pass before ``step()`` adds
its reduced chunk to ``grad_shard``, as PyTorch accumulates into ``p.grad``.

Note: filling the buffer at launch rather than as each gradient arrives matters for the
peak. The first gradient of a bucket arrives when backward has just reached its layers
and their activations are all alive; by the time the last one arrives most have been freed.

Inside ``no_sync()`` the hooks do nothing, so gradients accumulate whole in ``p.grad``
(as with DDP and FSDP) until the next synchronized backward reduces them.
"""

from __future__ import annotations

from zero.bucket import Bucket, ParamSlot
from zero.comm import Communicator, Handle
from zero.flat_buffer import FlatBuffer
from zero.stages.stage0 import zero_local_grads
from zero.stages.stage1 import Stage1


class Stage2(Stage1):
    number = 2

    def init_grads(self, bucket: Bucket) -> None:
        params = bucket.param_buffer
        bucket.grad_buffer = FlatBuffer(params.numel, params.dtype, params.data.device, allocate=False)
        chunk = bucket.layout.chunk_numel
        bucket.grad_shard_buffer = FlatBuffer(chunk, params.dtype, params.data.device, allocate=False)
        bucket.grad_shard = bucket.grad_shard_buffer.data
        self.init_guards(bucket)

    # ----- one backward pass ----------------------------------------------------------------------------

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Autograd accumulates apart; the reduced gradient so far waits in ``grad_shard``."""
        self.unguard(slot)

    def reopen(self, bucket: Bucket) -> None:
        """Nothing to set aside: the next reduction is added to ``grad_shard``."""

    def close(self, bucket: Bucket) -> None:
        """Nothing was set aside."""

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Nothing yet: the gradient waits in ``p.grad`` until the bucket is launched."""

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        if bucket.grad_shard_buffer.is_allocated:
            bucket.zero_pieces_of(slot, bucket.grad_shard)

    # ----- reduction ----------------------------------------------------------------------------------

    def launch_reduce(self, bucket: Bucket, comm: Communicator) -> Handle:
        """Move the bucket's gradients into a fresh staging buffer, release each ``p.grad``, reduce."""
        self._allocate_staging(bucket)
        for slot in bucket.slots:
            view = bucket.grad_view(slot)
            grad = slot.param.grad
            if grad is None:  # no gradient on this rank (possibly on others)
                view.zero_()
            else:
                view.copy_(grad)
            slot.param.grad = None
        return super().launch_reduce(bucket, comm)

    @staticmethod
    def _allocate_staging(bucket: Bucket) -> None:
        """Allocate the staging buffer uninitialized (every span gets written) but zero its padding."""
        assert bucket.grad_buffer is not None
        bucket.grad_buffer.allocate(zero=False)
        layout = bucket.layout
        if layout.padding:
            bucket.grad_buffer.view(layout.numel, layout.padding).zero_()

    def finish_reduce(self, bucket: Bucket) -> None:
        """Add the averaged chunk into the persistent shard and release the full buffer."""
        assert bucket.grad_buffer is not None and bucket.grad_shard_buffer is not None
        reduced = bucket.chunk_of(bucket.grad_buffer)
        if bucket.grad_shard_buffer.is_allocated:  # a later pass before step(): accumulate
            bucket.grad_shard.add_(reduced)
        else:  # first pass since zero_grad(): one copy instead of zero-fill + add
            bucket.grad_shard_buffer.allocate(zero=False)
            bucket.grad_shard.copy_(reduced)
        bucket.grad_buffer.free()

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        """Drop (or zero) the gradient shard; with ``set_to_none`` also every ``p.grad``."""
        if set_to_none:
            bucket.grad_shard_buffer.free()
            for slot in bucket.slots:
                slot.param.grad = slot.local_grad = None
            return
        if bucket.grad_shard_buffer.is_allocated:
            bucket.grad_shard.zero_()
        zero_local_grads(bucket)
