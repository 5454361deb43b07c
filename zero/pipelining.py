"""Pipeline parallelism with torch's own schedules (``torch.distributed.pipelining``) over parts trained by a
``ZeroOptimizer``: :class:`PipelineStage`, torch's stage with the gradient reduction held back to once per step.

torch's ``PipelineStage`` holds the reduction back until a step's last micro-batch only for DDP and FSDP modules
(it checks their classes); any other module gets a plain backward per micro-batch, so ``ZeroOptimizer`` would reduce
once per micro-batch, M times the traffic. This stage, built with torch's arguments, runs every micro-batch's backward
with the synchronization off (the gradients accumulate locally) and, at the schedule's gradient reduction after the
last one, reduces them once, with torch's division by the number of micro-batches (``scale_grads``) folded into the
reduction's division by the dp size. The zero-bubble schedules split each backward into an input pass and a weight
pass, whose gradients torch computes with ``torch.autograd.grad`` and writes into ``p.grad`` by hand, past the
optimizer's hooks: this stage hands them to the optimizer after each weight pass (at stage 3 with the units kept
gathered from the input pass to the step, ``set_reshard_after_backward(False)``: the weight pass reads them). It
also tells the optimizer the pipeline's ranks, so that ``clip_grad_norm_`` returns and applies the whole model's
norm. With several parts on one rank under one optimizer (interleaved schedules), the reduction waits for the last
of them. See docs/parallelism.md.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from zero.optimizer import ZeroOptimizer
from zero.runtime.guards.ownership import optimizer_of


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (the same arguments) for a part trained by a ``ZeroOptimizer``: micro-batches
    accumulate gradients locally, the schedule's reduction after the last one reduces them once (divided by the
    micro-batches with ``scale_grads``), and ``opt.clip_grad_norm_`` adds up over ``group``, the pipeline's ranks.

    ``optimizer``: the ``ZeroOptimizer`` over ``submodule`` (by default the one managing its parameters; one over
    several parts, an ``nn.ModuleList`` of them, serves each part's stage). ``tied_weights``: tensors that parts on
    different ranks both hold, each as its parameters' names in the parts (the whole model's), the same list on every
    stage, e.g. ``[("tok_embeddings.weight", "output.weight")]``: their gradients are summed over the parts and the
    clip counts them once (an undeclared one is refused at the first step). Build the optimizer before this stage::

        opt = zero.ZeroOptimizer(torch.optim.AdamW(part.parameters()), part, stage=2, mesh=mesh["dp"])
        stage = zero.pipelining.PipelineStage(part, pp_rank, pp_size, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 *args: Any, optimizer: ZeroOptimizer | None = None,
                 tied_weights: Sequence[Sequence[str]] = (), **kwargs: Any):
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        if self.dw_builder is not None:
            raise ValueError("zero.pipelining.PipelineStage was given a dw_builder: a weight pass of its own, run "
                             "outside backward, which ZeroOptimizer cannot see; leave dw_builder out (the zero-bubble "
                             "schedules split backward without one)")
        self.optimizer = optimizer if optimizer is not None else _optimizer_over(submodule)
        self.pipeline = self.optimizer.runtime.join_pipeline(self.group or dist.group.WORLD, stage_index, submodule,
                                                             tuple(tuple(names) for names in tied_weights))

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full":  # stage 3: the weight pass reads what the input pass gathered
            self.optimizer.set_reshard_after_backward(False)
        with self.optimizer.no_sync():
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if backward_type == "weight":  # p.grad written by hand: no hook saw it
                self.optimizer.runtime.reducer.accumulate_written(list(self.submod.parameters()))
        return result

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The schedule's reduction after this part's last backward of the step: once every part of the optimizer
        has had it, the gradients are reduced, divided by ``grad_scale_factor`` too (torch's ``scale_grads``)."""
        if self.pipeline.part_done(self.stage_index):
            if not self.pipeline.connected:  # the first step: the ranks compare what they hold (tied weights)
                self.optimizer.runtime.connect_pipeline(self.pipeline.modules)
            self.optimizer.reduce_gradients(grad_scale_factor)
            self.pipeline.tie.take_part()

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Called instead of :meth:`perform_reduce_grad` by torch's schedules that have no reduction action."""
        self.perform_reduce_grad(grad_scale_factor)


def _optimizer_over(submodule: torch.nn.Module) -> ZeroOptimizer:
    params = [p for p in submodule.parameters() if p.requires_grad]
    found = {id(o): o for o in map(optimizer_of, params) if o is not None}
    if len(found) != 1 or any(optimizer_of(p) is None for p in params):
        raise ValueError(
            "zero.pipelining.PipelineStage trains its part with the ZeroOptimizer that manages the part's parameters, "
            f"but {'none manages them' if not found else 'not one ZeroOptimizer manages them all'}: build "
            "ZeroOptimizer(opt, part, ...) over the part (or over a ModuleList of this rank's parts) before its "
            "stage, or pass optimizer=..."
        )
    return next(iter(found.values()))
