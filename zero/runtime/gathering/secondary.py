"""Where a stage-3 unit is gathered from: every rank's shard (the primary partition), or, with ZeRO++'s hierarchical
partitioning (``communication.hierarchy="hpz"``), in backward, the secondary copies held inside this rank's group.

``ParamGatherer`` asks its source for each bucket's gather (:meth:`unshard`) and tells it when one has completed
(:meth:`gathered`). Whether a gather reads the copies is the schedule's decision (``from_copies``:
``zero.runtime.gathering.gather_order.GatherOrder``, shared with the estimator's count of those gathers).

Note: a secondary copy is this rank's chunk of the parameters *within its group* (``P / g`` elements of a bucket of
``P``, ``g`` ranks a group), cut from the whole ``param_buffer`` as each primary gather completes, so it holds what
forward computed with (int8-decoded values under qwZ). Backward gathers the group's copies, exactly (the identity
codec), when the unit's copy is *current*: refreshed by a gather since the last time every unit was released
(``ParamGatherer.reshard_all``: before each step, at the end of each backward, around checkpoints) or its shard was
written (``gathered_parameters()``'s write-back). Otherwise backward gathers from the primary shards, as without
hpZ; a copy is never read stale.
"""

from __future__ import annotations

from zero.comm.communicator import Communicator, Handle
from zero.runtime.buffers.bucket import Bucket


class PrimaryShards:
    """Every gather from every rank's shard (no secondary copy)."""

    def unshard(self, stage, bucket: Bucket, comm: Communicator, *, exact: bool, from_copies: bool) -> Handle:
        return stage.unshard(bucket, comm, exact=exact)

    def gathered(self, bucket: Bucket) -> None:
        """``bucket``'s gather has completed."""


class SecondaryCopies(PrimaryShards):
    """hpZ: backward gathers inside ``group`` from each rank's secondary copy (see the module's Note)."""

    def __init__(self, group: Communicator):
        self.group = group
        self._refresh: set[int] = set()  # buckets (by index) being gathered from the primary shards

    def unshard(self, stage, bucket: Bucket, comm: Communicator, *, exact: bool, from_copies: bool) -> Handle:
        if from_copies:
            return stage.unshard(bucket, self.group, exact=True, source=bucket.secondary_buffer.data)
        self._refresh.add(bucket.index)
        return stage.unshard(bucket, comm, exact=exact)

    def gathered(self, bucket: Bucket) -> None:
        if bucket.index not in self._refresh:
            return
        self._refresh.discard(bucket.index)
        copy = bucket.secondary_buffer.data
        copy.copy_(bucket.param_buffer.data.narrow(0, self.group.rank * copy.numel(), copy.numel()))
