"""What the user did to a published ``p.grad`` between backward passes, applied as PyTorch would.

After a reduction every parameter with a gradient publishes one (the whole gradient at stage 0, a
:class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard at stages 1-3). Before the next pass, or the step,
:func:`apply_user_edit` reads what became of it: ``None`` clears the gradient (``model.zero_grad()``, ``p.grad =
None``); on the guard, ``zero_()`` zeroes it and ``div_`` / ``mul_`` by a number scale it (torch's pipelining's
``scale_grads``); another tensor put in its place is adopted at stage 0 (stages 1-3 refuse it: the guard says why).
"""

from __future__ import annotations

from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.stages.stage0 import Stage0


def apply_user_edit(stage: Stage0, bucket: Bucket, slot: ParamSlot, reduced: bool) -> None:
    """Apply what was done to ``slot``'s ``p.grad``; ``reduced``: the gradients are reduced (not local ones of
    ``no_sync()`` passes)."""
    grad = slot.grad
    if grad is None:
        if slot.has_grad:
            stage.clear_grad(bucket, slot)
            slot.used_here = slot.used_anywhere = False
            slot.local_grad = slot.wide_grad = None
    elif grad is slot.grad_guard:
        scalings = grad.take_scalings()
        if scalings:
            stage.scale_grad(bucket, slot, scalings, reduced=reduced)
        if grad.take_zeroed():
            stage.clear_grad(bucket, slot)
            if slot.local_grad is not None:
                slot.local_grad.zero_()
    elif reduced:  # stage 0: a gradient the user set (stages 1-3 refuse)
        stage.adopt_grad(bucket, slot)
        slot.used_here = slot.used_anywhere = True
