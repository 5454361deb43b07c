"""Stage 1: shard the optimizer state.

Gradients stay whole and persistent as at stage 0, but each bucket is reduce-scattered
in place: afterwards this rank's chunk of ``grad_buffer`` holds the summed gradient
(already averaged) for the elements it owns (``grad_shard`` is a view of that chunk), and the rest of the
buffer still holds local gradients, which nothing reads. The inner optimizer steps
only this rank's chunk, so its state is ``1/N`` of the model; updated chunks are
then all-gathered in place into ``param_buffer``.

After a reduction ``p.grad`` is a :class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard: no rank has
the whole averaged gradient.

Note: another backward pass before ``step()`` (accumulation without ``no_sync()``, or two
losses) must not add its local gradients on top of the averaged chunk: the next reduce-scatter
would average the mixture. So when such a pass starts (:meth:`reopen`) the averaged chunk is
set aside in ``grad_carry`` (``1/N`` of the bucket, allocated only then), the pass's local
gradients are reduced on their own, and :meth:`finish_reduce` adds the carry back: the same
arithmetic as stage 2's accumulation into its gradient shard.
"""

from __future__ import annotations

import torch

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.sharded_grad import sharded_grad
from zero.runtime.stages.stage0 import Stage0


class Stage1(Stage0):
    number = 1
    carries = True
    reduce_collective = "reduce-scatter"
    gather_collective = "all-gather after the step"

    def num_shards(self, world_size: int) -> int:
        return world_size

    def init_grads(self, bucket: Bucket) -> None:
        self.init_guards(bucket)

    @property
    def guard_reason(self) -> str:
        """Why ``p.grad`` cannot hold the reduced gradient (for the guard's errors)."""
        return f"is sharded across ranks (ZeRO stage {self.number}): no rank holds it whole"

    def init_guards(self, bucket: Bucket) -> None:
        """Make each slot's ``p.grad`` guard (one element for the whole bucket)."""
        buffer = bucket.param_buffer.storage_tensor  # (dtype and device only)
        nan = torch.full((), float("nan"), dtype=buffer.dtype, device=buffer.device)
        for slot in bucket.slots:
            slot.grad_guard = sharded_grad(slot.shape, slot.name, self.guard_reason, nan)

    # ----- one backward pass ----------------------------------------------------------------------------

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """A reduced gradient waits in ``grad_carry`` (see :meth:`reopen`); autograd accumulates apart,
        from the local gradient of earlier ``no_sync()`` passes if there is one."""
        if not self.unguard(slot):
            super().before_pass(bucket, slot)

    @staticmethod
    def unguard(slot: ParamSlot) -> bool:
        """Swap the guard in ``p.grad`` for the ``no_sync()`` gradient kept behind it (``None`` if none)."""
        if slot.grad is not slot.grad_guard:
            return False
        slot.grad, slot.local_grad = slot.local_grad, None
        return True

    def reopen(self, bucket: Bucket) -> None:
        assert bucket.grad_carry is not None and not bucket.grad_carry.is_allocated
        bucket.grad_carry.allocate(zero=False)
        bucket.grad_carry.data.copy_(bucket.grad_shard)
        bucket.grad_shard.zero_()  # parameters without a reduced gradient accumulate here in place

    def close(self, bucket: Bucket) -> None:
        assert bucket.grad_carry.is_allocated
        bucket.grad_shard.copy_(bucket.grad_carry.data)
        bucket.grad_carry.free()

    def published_grad(self, bucket: Bucket, slot: ParamSlot):
        slot.grad_guard.take_zeroed()  # a new reduction: a zero_() before it is moot
        return slot.grad_guard

    def adopt_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Only the guard may be there: p.grad cannot carry a sharded gradient."""
        raise ValueError(
            f"p.grad of {slot.name!r} was replaced after backward. The reduced gradient {self.guard_reason}, so "
            "p.grad cannot carry it; change reduced gradients only with "
            "opt.clip_grad_norm_(), and clear them with opt.zero_grad() or model.zero_grad(). (Stage 0 "
            "without mixed precision keeps whole gradients in p.grad.)"
        )

    def scale_grad(self, bucket: Bucket, slot: ParamSlot, scalings: list[tuple[str, float]], reduced: bool) -> None:
        """``p.grad.div_(n)`` (or ``mul_``) on the guard of a ``reduced`` gradient: the same on this rank's pieces
        (and on the optimizer's fp32 copy of them, if this step's is made already)."""
        if not reduced:
            raise ValueError(f"p.grad of {slot.name!r} was scaled in place while it held both a reduced gradient and "
                             "a backward pass's local one since; scale it after the reduction")
        made = bucket.master_grad is not None and bucket.master_grad.is_allocated
        for chunk in (bucket.grad_shard, bucket.master_grad.data) if made else (bucket.grad_shard,):
            for view in bucket.pieces_of(slot, chunk):
                for name, value in scalings:
                    getattr(view, name)(value)

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        super().clear_grad(bucket, slot)
        if self.carries and bucket.grad_carry.is_allocated:
            bucket.zero_pieces_of(slot, bucket.grad_carry.data)

    # ----- reduction ----------------------------------------------------------------------------------

    def reduce(self, bucket: Bucket, comm: Communicator) -> Handle:
        """The collective: each rank gets the sum of its own chunk."""
        return comm.reduce_scatter(
            bucket.chunk_of(bucket.staging), bucket.staging.data, what=f"reduce-scatter of {bucket}"
        )

    def finish_reduce(self, bucket: Bucket) -> None:
        """Add back the reduced gradients set aside by :meth:`reopen`, if any."""
        if bucket.grad_carry.is_allocated:
            bucket.grad_shard.add_(bucket.grad_carry.data)
            bucket.grad_carry.free()

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        if self.carries:
            bucket.grad_carry.free()
        super().zero_grad(bucket, set_to_none)  # without set_to_none the guards stay: zero gradients exist

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        return comm.all_gather(bucket.param_buffer.data, bucket.shard, what=f"all-gather of {bucket}")
