"""What the user did to a published ``p.grad`` between backward passes, applied as PyTorch would.

After a reduction every parameter with a gradient publishes one (the whole gradient at stage 0, a
:class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard at stages 1-3). Before the next pass, or the step,
:func:`apply_user_edit` reads what became of it: ``None`` clears the gradient (``model.zero_grad()``, ``p.grad =
None``); on the guard, ``zero_()`` zeroes it and ``div_`` / ``mul_`` by a number scale it (torch's pipelining's
``scale_grads``); another tensor put in its place is adopted at stage 0 (stages 1-3 refuse it: the guard says why).

A ``p.grad`` that no backward pass delivered (``torch.autograd.grad`` or ``torch.func``, then ``p.grad = g``; the
weight pass of torch's zero-bubble schedules over torch's own ``PipelineStage``) was never reduced across ranks, and
``step()`` would ignore it: :func:`refuse_hand_written` says so instead of a step that silently changes nothing.
"""

from __future__ import annotations

from typing import Sequence

from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.stages.stage import Stage


def apply_user_edit(stage: Stage, bucket: Bucket, slot: ParamSlot, reduced: bool) -> None:
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


def refuse_hand_written(slots: Sequence[ParamSlot]) -> None:
    """Raise if any of ``slots`` has a ``p.grad`` though no backward pass gave one since the gradients were last
    cleared (the gradients are empty): it was written by hand, past the hooks that reduce gradients."""
    if slots:
        names = ", ".join(repr(slot.name) for slot in slots[:3]) + (" ..." if len(slots) > 3 else "")
        raise ValueError(
            f"p.grad of {names} was set outside a backward pass ZeroOptimizer saw (torch.autograd.grad or torch.func, "
            "then p.grad = g; or the weight pass of torch's zero-bubble schedules over torch's own PipelineStage): "
            "gradients are reduced across ranks from backward's hooks, so step() would ignore it. Compute them "
            "with loss.backward() (zero-bubble schedules: use zero.pipelining.PipelineStage), or clear them with "
            "opt.zero_grad()"
        )
