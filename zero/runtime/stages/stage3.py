"""Stage 3: also shard the parameters.

Each rank keeps only its chunk of every bucket (``shard_buffer``, ``1/N`` of the model);
the optimizer updates it in place and nothing is gathered after the step. A bucket's
full ``param_buffer`` exists only while its unit is gathered: :class:`ParamGatherer`
(``zero.runtime.gathering.gatherer``) calls :meth:`unshard` before the unit's forward and again
before its backward, and :meth:`reshard` after each. Gradients are handled exactly as at
stage 2 (staged per bucket, reduce-scattered, kept as a ``1/N`` shard: the same
:class:`~zero.runtime.stages.gradients.StagedGradients`).

While sharded, every parameter's ``.data`` is a guarded placeholder (see
``zero.runtime.buffers.sharded_param``), never a view of released memory.
"""

from __future__ import annotations

import torch

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.sharded_param import make_sharded, set_data
from zero.runtime.stages.gradients import AutogradLocal, StagedGradients, sharded_reason
from zero.runtime.stages.stage import ReduceScatter, Stage


class Stage3(Stage):
    number = 3
    sharded_params = True
    gather_collective = "all-gather per unit"

    def __init__(self) -> None:
        super().__init__(ReduceScatter(), StagedGradients(AutogradLocal(), sharded_reason(self.number)))

    def init_params(self, bucket: Bucket) -> None:
        """Keep this rank's chunk of the parameters and turn each parameter into a placeholder."""
        bucket.make_views()
        for slot in bucket.slots:
            bucket.copy_to_shard(slot, slot.tensor)
        nan = bucket.nan()  # one element, shared by the bucket's placeholders
        for slot in bucket.slots:
            make_sharded(slot.param, slot.name)
            slot.placeholder = nan.expand(slot.shape)
            set_data(slot.param, slot.placeholder, sharded=True)

    def gather_params(self, bucket: Bucket, comm: Communicator) -> Handle | None:
        """Nothing after the step: the next forward gathers the updated shards."""
        return None

    # ----- gathering, driven by ParamGatherer --------------------------------------------------------

    def unshard(
        self, bucket: Bucket, comm: Communicator, *, exact: bool = False, source: torch.Tensor | None = None
    ) -> Handle:
        """Allocate ``param_buffer`` and start gathering every rank's chunk into it (through the communicator's
        codec, which may quantize, unless ``exact``: gathers outside training, whose values the user keeps).
        ``source``: this rank's chunk over ``comm``'s ranks, if not its shard (hpZ's secondary copy)."""
        bucket.param_buffer.allocate(zero=False)  # the all-gather writes every element, padding included
        if source is None:
            bucket.params.shard_buffer.prefetch()  # on disk: read ahead, as far ahead as the gatherer unshards units
            source = bucket.shard.to(comm.device, non_blocking=True)  # copied up from the host if offloaded
        handle = comm.all_gather(bucket.param_buffer.data, source, what=f"all-gather of {bucket}", exact=exact)
        bucket.param_buffer.start_collective()
        return handle

    def end_unshard(self, bucket: Bucket) -> None:
        """The gather has completed (its handle was waited on): ``param_buffer`` may be read."""
        bucket.param_buffer.end_collective()
        # on disk: the shard is not needed in memory until the next gather or step (nor are the pages of the bucket's
        # other regions the kernel mapped in with it: file faults map the cached pages around them)
        bucket.evict()

    def attach(self, bucket: Bucket) -> None:
        """The gather has completed: point each parameter at its whole value."""
        self.end_unshard(bucket)
        for slot in bucket.slots:
            set_data(slot.param, slot.view, sharded=False)

    def write_back(self, bucket: Bucket) -> None:
        """Copy edits made to the gathered parameters into this rank's shard."""
        with torch.no_grad():
            bucket.shard.copy_(bucket.chunk_of(bucket.param_buffer))

    def detach_storage(self, bucket: Bucket) -> None:
        """Let tensors taken from the gathered parameters (e.g. a ``state_dict()``) keep their values:
        the bucket gathers into a new storage from now on and the old one lives as long as they do.
        (The parameters still point at the old storage: :meth:`reshard` is what comes next.)"""
        bucket.param_buffer.disown()
        bucket.make_views()

    def reshard(self, bucket: Bucket) -> None:
        """Release ``param_buffer`` and point each parameter at its placeholder."""
        for slot in bucket.slots:
            set_data(slot.param, slot.placeholder, sharded=True)
        bucket.param_buffer.free()
