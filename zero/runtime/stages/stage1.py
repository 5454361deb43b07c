"""Stage 1: shard the optimizer state.

Gradients stay whole and persistent as at stage 0, but each bucket is reduce-scattered
in place: afterwards this rank's chunk of the gradient buffer holds the summed gradient
(already averaged) for the elements it owns (``grad_shard`` is a view of that chunk), and the rest of the
buffer still holds local gradients, which nothing reads. The inner optimizer steps
only this rank's chunk, so its state is ``1/N`` of the model; updated chunks are
then all-gathered in place into ``param_buffer``.

After a reduction ``p.grad`` is a :class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard: no rank has
the whole averaged gradient. Another backward pass before ``step()`` carries the reduced chunk across it
(:class:`~zero.runtime.stages.gradients.CarriedGradients`).

Under mixed precision with a reduce dtype other than the parameters' (the default: bf16 parameters, fp32 reduction),
the local gradients stay in the persistent gradient buffer and each reduction copies them into a transient staging
buffer in the reduce dtype, whose chunk accumulates in a separate gradient shard
(:class:`~zero.runtime.stages.gradients.StagedGradients`, as at stage 2).
"""

from __future__ import annotations

from zero.comm.communicator import Communicator, Handle
from zero.precision import MixedPrecision
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.stages.gradients import buffered_gradients, sharded_reason
from zero.runtime.stages.stage import ReduceScatter, Stage, all_gather_after_step


class Stage1(Stage):
    number = 1
    gather_collective = "all-gather after the step"

    def __init__(self, precision: MixedPrecision | None = None):
        precision = precision or MixedPrecision()
        super().__init__(ReduceScatter(), buffered_gradients(precision, sharded_reason(self.number)))

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        return all_gather_after_step(bucket, comm)
