"""Stage 2: also shard the gradients.

A bucket's full-size ``staging`` buffer exists only while that bucket is being reduced:
gradients stay in ``p.grad`` (allocated by autograd as they arrive) until all of the
bucket's gradients are in; then they are copied into a fresh ``staging`` buffer (in the
reduce dtype) and each ``p.grad`` is dropped, the buffer is reduce-scattered in place, this
rank's chunk (already averaged) is added into the persistent ``grad_shard`` (``1/N`` of the
bucket), and the full buffer's storage is released
(:class:`~zero.runtime.stages.gradients.StagedGradients` over
:class:`~zero.runtime.stages.gradients.AutogradLocal`). Updated chunks are all-gathered after the step, as at
stage 1.
"""

from __future__ import annotations

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.stages.gradients import AutogradLocal, StagedGradients, sharded_reason
from zero.runtime.stages.stage import ReduceScatter, Stage, all_gather_after_step


class Stage2(Stage):
    number = 2
    gather_collective = "all-gather after the step"

    def __init__(self) -> None:
        super().__init__(ReduceScatter(), StagedGradients(AutogradLocal(), sharded_reason(self.number)))

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        return all_gather_after_step(bucket, comm)
