"""Stage 1: shard the optimizer state.

Gradients stay whole and persistent as at stage 0, but each bucket is reduce-scattered
in place: afterwards this rank's chunk of ``grad_buffer`` holds the summed gradient
(already averaged) for the elements it owns (``grad_shard`` is a view of that chunk), and the rest of the
buffer still holds local gradients, which nothing reads. The inner optimizer steps
only this rank's chunk, so its state is ``1/N`` of the model; updated chunks are
then all-gathered in place into ``param_buffer``.
"""

from __future__ import annotations

from zero.bucket import Bucket
from zero.comm import Communicator, Handle
from zero.stages.stage0 import Stage0


class Stage1(Stage0):
    number = 1

    def num_shards(self, world_size: int) -> int:
        return world_size

    def launch_reduce(self, bucket: Bucket, comm: Communicator) -> Handle:
        self.prescale(bucket, comm)
        return comm.reduce_scatter(
            bucket.chunk_of(bucket.grad_buffer), bucket.grad_buffer.data, what=f"reduce-scatter of {bucket}"
        )

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        return comm.all_gather(bucket.param_buffer.data, bucket.shard, what=f"all-gather of {bucket}")
