"""Where a stage-3 unit is gathered from: every rank's shard (the primary partition), or, with ZeRO++'s hierarchical
partitioning (``communication.hierarchy="hpz"``), in backward, the secondary copies held inside this rank's group.

``ParamGatherer`` asks its source for each bucket's gather (:meth:`unshard`) and tells it when one has completed
(:meth:`gathered`) and when copies may have gone stale (:meth:`forget`).

Note: a secondary copy is this rank's chunk of the parameters *within its group* (``P / g`` elements of a bucket of
``P``, ``g`` ranks a group), cut from the whole ``param_buffer`` as each primary gather completes, so it holds what
forward computed with (int8-decoded values under qwZ). Backward gathers the group's copies, exactly (the identity
codec), when the bucket's copy is *current*: refreshed by a gather since the last time every unit was released
(``ParamGatherer.reshard_all``: before each step, at the end of each backward, around checkpoints) or its shard was
written (``gathered_parameters()``'s write-back). Otherwise backward gathers from the primary shards, as without
hpZ; a copy is never read stale.
"""

from __future__ import annotations

from zero.comm.communicator import Communicator, Handle
from zero.runtime.bucket import Bucket


class PrimaryShards:
    """Every gather from every rank's shard (no secondary copy)."""

    def unshard(self, stage, bucket: Bucket, comm: Communicator, *, exact: bool, backward: bool) -> Handle:
        return stage.unshard(bucket, comm, exact=exact)

    def gathered(self, bucket: Bucket) -> None:
        """``bucket``'s gather has completed."""

    def forget(self, buckets: list[Bucket]) -> None:
        """The shards of ``buckets`` may change: their copies are no longer current."""


class SecondaryCopies(PrimaryShards):
    """hpZ: backward gathers inside ``group`` from each rank's secondary copy (see the module's Note)."""

    def __init__(self, group: Communicator):
        self.group = group
        self._current: set[int] = set()  # buckets (by index) whose copy is current
        self._refresh: set[int] = set()  # buckets being gathered from the primary shards

    def unshard(self, stage, bucket: Bucket, comm: Communicator, *, exact: bool, backward: bool) -> Handle:
        if backward and not exact and bucket.index in self._current:
            return stage.unshard(bucket, self.group, exact=True, source=bucket.secondary_buffer.data)
        self._refresh.add(bucket.index)
        return stage.unshard(bucket, comm, exact=exact)

    def gathered(self, bucket: Bucket) -> None:
        if bucket.index not in self._refresh:
            return
        self._refresh.discard(bucket.index)
        copy = bucket.secondary_buffer.data
        copy.copy_(bucket.param_buffer.data.narrow(0, self.group.rank * copy.numel(), copy.numel()))
        self._current.add(bucket.index)

    def forget(self, buckets: list[Bucket]) -> None:
        self._current.difference_update(b.index for b in buckets)
