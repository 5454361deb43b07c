"""What a stage does with gradients: where the local ones accumulate, what ``p.grad`` shows after a reduction, and how
another backward pass before ``step()`` adds to a reduced gradient. Each stage (``zero.runtime.stages``) holds one of
these, chosen from its number and the precision, and the plan gives each bucket the buffers it reads
(``zero.runtime.buffers.bucket_buffers``: the object each method reads has the buffer, by construction).

Where the local gradients are (a component of each kind below):

* :class:`BufferLocal`: in the persistent gradient buffer (stages 0-1): each ``p.grad`` is a view of it, autograd
  accumulates in place, as with DDP;
* :class:`AutogradLocal`: in ``p.grad``, allocated by autograd as they arrive (stages 2-3), until the bucket is
  reduced.

The reductions:

* :class:`WholeGradients` (stage 0 in full precision): the gradient buffer is all-reduced in place and ``p.grad`` is
  the whole averaged gradient. Another pass adds its local gradients to the averaged ones in place, and averaging
  ``A + g_r`` over ranks gives ``A + mean(g)`` because every rank holds the same ``A``.
* :class:`CarriedGradients` (stage 1; stage 0 under mixed precision reducing in the parameters' dtype): reduced in
  place too, but this rank's chunk alone holds the result (or it belongs to the fp32 master), so ``p.grad`` is a
  :class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard. Another pass must not add its local gradients on
  top of the averaged chunk (the next reduce-scatter would average the mixture): :meth:`~CarriedGradients.reopen`
  sets the chunk aside in the carry (``1/N`` of the bucket, allocated only then), the pass's gradients are reduced
  on their own, and :meth:`~CarriedGradients.finish_reduce` adds the carry back: the arithmetic of the staged
  accumulation.
* :class:`StagedGradients` (stages 2-3; stages 0-1 under mixed precision when the reduce dtype is not the
  parameters'): when the bucket is launched its local gradients are copied into a fresh staging buffer in the
  reduce dtype (and released), which is reduced in place; this rank's chunk is added into the persistent gradient
  shard (``1/N``, on the optimizer's side: host memory when offloaded) and the staging buffer is released. At most
  ``ZeroConfig.max_in_flight_buckets`` of them are alive during backward. Another pass adds its reduced chunk to the
  shard, as PyTorch accumulates into ``p.grad``. Filling the staging buffer at launch rather than as each gradient
  arrives matters for the peak: the first gradient of a bucket arrives when its activations are all alive.

Inside ``no_sync()`` the hooks do nothing: gradients accumulate in ``p.grad`` (or the gradient buffer) until the
next synchronized backward reduces them.
"""

from __future__ import annotations

import torch

from zero.precision import MixedPrecision
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.sharded_grad import sharded_grad

# ----- where the local gradients are ------------------------------------------------------------------------------


class BufferLocal:
    """The local gradients in the persistent gradient buffer (``bucket.grads.view(slot)``)."""

    persistent = True

    @staticmethod
    def before_pass(bucket: Bucket, slot: ParamSlot) -> None:
        """Point ``p.grad`` at the slot's view of the buffer (it holds its gradient so far, zeros if none)."""
        if slot.grad is None:
            slot.grad = bucket.grads.view(slot)

    @staticmethod
    def stage_grad(bucket: Bucket, slot: ParamSlot) -> None:
        """Make sure the slot's current gradient sits in the buffer (no-op in steady state: autograd accumulates in
        place into the ``p.grad`` views); a ``p.grad`` replaced or cleared by user code is copied in (or zeroed)."""
        view = bucket.grads.view(slot)
        grad = slot.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        slot.grad = view

    @staticmethod
    def local_grad(bucket: Bucket, slot: ParamSlot) -> torch.Tensor | None:
        return bucket.grads.view(slot)  # stage_grad put the pass's gradient there (zeros if it had none)

    @staticmethod
    def release(bucket: Bucket, slot: ParamSlot) -> None:
        """Nothing: the next pass's gradients replace the view's contents."""

    @staticmethod
    def clear(bucket: Bucket, slot: ParamSlot) -> None:
        bucket.grads.view(slot).zero_()

    @staticmethod
    def zero(bucket: Bucket, set_to_none: bool) -> None:
        """Zero the buffer in place (it stays allocated, as with DDP), and the gradients outside it."""
        buffer = bucket.grads.buffer.data
        buffer.zero_()
        clear_local_grads(bucket, set_to_none, kept=buffer.untyped_storage().data_ptr())


class AutogradLocal:
    """The local gradients in ``p.grad``, autograd's own tensors, until the bucket is launched."""

    persistent = False

    @staticmethod
    def before_pass(bucket: Bucket, slot: ParamSlot) -> None:
        """Autograd accumulates apart (from the ``no_sync()`` gradient, if any)."""

    @staticmethod
    def stage_grad(bucket: Bucket, slot: ParamSlot) -> None:
        """Nothing yet: the gradient waits in ``p.grad`` until the bucket is launched."""

    @staticmethod
    def local_grad(bucket: Bucket, slot: ParamSlot) -> torch.Tensor | None:
        return slot.grad

    @staticmethod
    def release(bucket: Bucket, slot: ParamSlot) -> None:
        slot.grad = None

    @staticmethod
    def clear(bucket: Bucket, slot: ParamSlot) -> None:
        pass

    @staticmethod
    def zero(bucket: Bucket, set_to_none: bool) -> None:
        clear_local_grads(bucket, set_to_none)


def clear_local_grads(bucket: Bucket, set_to_none: bool, kept: int = -1) -> None:
    """With ``set_to_none`` every ``p.grad`` (and gradient kept behind a guard) becomes ``None``; otherwise those
    autograd holds outside the bucket's buffers (not yet staged; ``kept``: the storage of the gradient buffer, zeroed
    by the caller) are zeroed, as ``zero_grad(set_to_none=False)`` would."""
    for slot in bucket.slots:
        if set_to_none:
            slot.grad = slot.local_grad = None
            continue
        for grad in (slot.grad, slot.local_grad):
            if grad is not None and grad is not slot.grad_guard and grad.untyped_storage().data_ptr() != kept:
                grad.zero_()


Local = BufferLocal | AutogradLocal


# ----- the reductions ---------------------------------------------------------------------------------------------


class WholeGradients:
    """Stage 0 in full precision: ``p.grad`` is the whole averaged gradient (see the module docstring)."""

    staged = False
    carries = False

    def __init__(self) -> None:
        self.local = BufferLocal()
        self.persistent = self.local.persistent

    def init(self, bucket: Bucket) -> None:
        """Nothing: each ``p.grad`` points into the planned gradient buffer from the first backward."""

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.before_pass(bucket, slot)

    def reopen(self, bucket: Bucket) -> None:
        """Nothing: the next pass adds to the averaged gradients in place."""

    def close(self, bucket: Bucket) -> None:
        pass

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.stage_grad(bucket, slot)

    def published_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor:
        return bucket.grads.view(slot)

    def publish_unreduced(self, bucket: Bucket, slot: ParamSlot) -> None:
        """A pass that was not reduced added its local gradient to the averaged one in place: ``p.grad`` shows the
        sum (the view), also where user code had cleared it."""
        if slot.grad is None:
            slot.grad = self.published_grad(bucket, slot)

    def drop_guards(self, bucket: Bucket) -> None:
        """Nothing: ``p.grad`` is the whole gradient, which the parameter keeps."""

    def adopt_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """``p.grad`` was set after the reduction (``p.grad = p.grad * 2``): copy it in."""
        self.local.stage_grad(bucket, slot)

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.clear(bucket, slot)

    def collect(self, bucket: Bucket) -> torch.Tensor:
        return bucket.staging.data  # (the gradient buffer: the local gradients are in it)

    def finish_reduce(self, bucket: Bucket) -> None:
        """Nothing: the averaged result is in place."""

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        self.local.zero(bucket, set_to_none)


class GuardedGradients:
    """After a reduction ``p.grad`` is a guard (the reduced gradient is sharded, or belongs to the fp32 master):
    what every reduction but :class:`WholeGradients` shares. ``reason`` completes "the reduced gradient of <name> ..."
    in the guard's errors."""

    staged = False
    carries = False

    def __init__(self, local: Local, reason: str):
        self.local, self.reason = local, reason
        self.persistent = local.persistent

    def init(self, bucket: Bucket) -> None:
        """Make each slot's ``p.grad`` guard (one element for the whole bucket)."""
        nan = bucket.nan()
        for slot in bucket.slots:
            slot.grad_guard = sharded_grad(slot.shape, slot.name, self.reason, nan)

    def before_pass(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Autograd accumulates apart from the reduced gradient, from the ``no_sync()`` gradient kept behind the guard
        if there is one."""
        if not self.unguard(slot):
            self.local.before_pass(bucket, slot)

    @staticmethod
    def unguard(slot: ParamSlot) -> bool:
        """Swap the guard in ``p.grad`` for the ``no_sync()`` gradient kept behind it (``None`` if none)."""
        if slot.grad is not slot.grad_guard:
            return False
        slot.grad, slot.local_grad = slot.local_grad, None
        return True

    def stage_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.stage_grad(bucket, slot)

    def published_grad(self, bucket: Bucket, slot: ParamSlot) -> torch.Tensor:
        slot.grad_guard.take_zeroed()  # a new reduction: a zero_() before it is moot
        return slot.grad_guard

    def publish_unreduced(self, bucket: Bucket, slot: ParamSlot) -> None:
        """A reduced gradient plus a pass's local one that was not reduced: ``p.grad`` could show only the local part,
        so it goes behind the guard like the rest (:meth:`before_pass` brings it back)."""
        slot.local_grad, slot.grad = slot.grad, self.published_grad(bucket, slot)

    @staticmethod
    def drop_guards(bucket: Bucket) -> None:
        """The optimizer lets go of the model: a guard in ``p.grad`` becomes ``None`` (no rank holds the whole
        gradient)."""
        for slot in bucket.slots:
            if slot.grad is slot.grad_guard:
                slot.grad = None

    def adopt_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        """Only the guard may be there: p.grad cannot carry a sharded gradient."""
        raise ValueError(
            f"p.grad of {slot.name!r} was replaced after backward. The reduced gradient {self.reason}, so "
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
        for chunk in (bucket.grad_shard, *bucket.master_grads.made()):
            for view in bucket.pieces_of(slot, chunk):
                for name, value in scalings:
                    getattr(view, name)(value)


class CarriedGradients(GuardedGradients):
    """Reduced in place in the gradient buffer, a reduced chunk carried across another pass (the module docstring)."""

    carries = True

    def __init__(self, reason: str):
        super().__init__(BufferLocal(), reason)

    def reopen(self, bucket: Bucket) -> None:
        carry = bucket.grads.carry
        assert not carry.is_allocated
        carry.allocate(zero=False)
        carry.data.copy_(bucket.grad_shard)
        bucket.grad_shard.zero_()  # parameters without a reduced gradient accumulate here in place

    def close(self, bucket: Bucket) -> None:
        """Undo :meth:`reopen`: the pass brought no gradient (``torch.autograd.grad``)."""
        carry = bucket.grads.carry
        assert carry.is_allocated
        bucket.grad_shard.copy_(carry.data)
        carry.free()

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.clear(bucket, slot)
        if bucket.grads.carry.is_allocated:
            bucket.zero_pieces_of(slot, bucket.grads.carry.data)

    def collect(self, bucket: Bucket) -> torch.Tensor:
        return bucket.staging.data

    def finish_reduce(self, bucket: Bucket) -> None:
        """Add back the reduced gradients set aside by :meth:`reopen`, if any."""
        carry = bucket.grads.carry
        if carry.is_allocated:
            bucket.grad_shard.add_(carry.data)
            carry.free()

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        bucket.grads.carry.free()
        self.local.zero(bucket, set_to_none)  # without set_to_none the guards stay: zero gradients exist


class StagedGradients(GuardedGradients):
    """Copied into a transient staging buffer in the reduce dtype, each reduced chunk added into a gradient shard of
    its own (the module docstring)."""

    staged = True

    def reopen(self, bucket: Bucket) -> None:
        """Nothing to set aside: the next reduction is added to the gradient shard."""

    def close(self, bucket: Bucket) -> None:
        """Nothing was set aside."""

    def clear_grad(self, bucket: Bucket, slot: ParamSlot) -> None:
        self.local.clear(bucket, slot)
        if bucket.grads.shard_buffer.is_allocated:
            bucket.zero_pieces_of(slot, bucket.grad_shard)

    def collect(self, bucket: Bucket) -> torch.Tensor:
        """Copy the bucket's local gradients into a fresh staging buffer (releasing them) and return it."""
        staging = bucket.staging
        staging.allocate(zero=False)  # uninitialized (every span gets written) but its padding zeroed
        layout = bucket.layout
        if layout.padding:
            staging.view(layout.numel, layout.padding).zero_()
        for slot in bucket.slots:
            view = bucket.staging_view(slot)
            grad = self.local.local_grad(bucket, slot)
            if grad is None:  # no gradient on this rank (possibly on others)
                view.zero_()
            else:
                view.copy_(grad)
            if slot.wide_grad is not None:  # accumulated under no_sync() in the reduce dtype
                view.add_(slot.wide_grad)
                slot.wide_grad = None
            self.local.release(bucket, slot)
        return staging.data

    def finish_reduce(self, bucket: Bucket) -> None:
        """Add the averaged chunk into the persistent shard and release the full buffer."""
        reduced = bucket.chunk_of(bucket.staging)
        shard = bucket.grads.shard_buffer
        if shard.is_allocated:  # a later pass before step(): accumulate
            bucket.placements.wait()  # offload: the earlier pass's chunk has landed on the host
            bucket.grad_shard.add_(reduced.to(bucket.grad_shard.device))
        else:  # first pass since zero_grad(): one copy instead of zero-fill + add (offload: down to the host)
            shard.allocate(zero=False)
            bucket.placements.copy_down(bucket.grad_shard, reduced)
        shard.evict()  # on disk: written back until the step reads it
        bucket.staging.free()

    def zero_grad(self, bucket: Bucket, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero the gradient shard, then the local gradients."""
        shard = bucket.grads.shard_buffer
        if set_to_none:
            shard.free()
        elif shard.is_allocated:
            bucket.grad_shard.zero_()
        self.local.zero(bucket, set_to_none)


Gradients = WholeGradients | CarriedGradients | StagedGradients


def sharded_reason(number: int) -> str:
    """Why ``p.grad`` cannot hold the reduced gradient at stages 1-3 (for the guard's errors)."""
    return f"is sharded across ranks (ZeRO stage {number}): no rank holds it whole"


def buffered_gradients(precision: MixedPrecision, reason: str) -> CarriedGradients | StagedGradients:
    """Stages 0-1's guarded gradients, local ones in the persistent buffer: reduced in place when the reduce dtype is
    the parameters' (always without mixed precision), else staged in the reduce dtype."""
    in_place = not precision.enabled or (precision.reduce_dtype or "fp32") == precision.param_dtype
    return CarriedGradients(reason) if in_place else StagedGradients(BufferLocal(), reason)
