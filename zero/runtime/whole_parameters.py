"""Whole parameters outside forward (``ZeroOptimizer.gathered_parameters``): gather the units that hold them,
and on exit share one rank's edits (optional), write the edits back into each rank's shard and release. With
``offload.params`` the whole parameters are gathered into host memory instead, one bucket at a time, so that a model
larger than the device can be read and edited whole."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.placement import HOST
from zero.runtime.buffers.sharded_param import cast_after_wrapping, set_data
from zero.runtime.reduction.reducer import GradState
from zero.runtime.runtime import Runtime, wait_all

Targets = torch.nn.Module | torch.nn.Parameter | Iterable[torch.nn.Module | torch.nn.Parameter] | None


@contextmanager
def gathered_parameters(runtime: Runtime, targets: Targets, modifier_rank: int | None) -> Iterator[None]:
    runtime.check_open()
    runtime.reducer.drain_interrupted()
    runtime.flush()
    gatherer, stage = runtime.gatherer, runtime.stage
    if runtime.reducer.state is GradState.REDUCING or gatherer.in_forward:
        raise ValueError("gathered_parameters() cannot be used inside forward or backward")
    if modifier_rank is not None:
        _check_modifier(modifier_rank, runtime.comm)
    buckets = buckets_of(runtime, targets)
    units = gatherer.units_of(s.param for b in buckets for s in b.slots)
    if runtime.placements.params_offloaded:
        with _gathered_on_host(runtime, units, modifier_rank):
            yield
        return
    for unit in units:
        if not runtime.comm.codec.exact_gather:
            gatherer.reshard(unit)  # a unit a forward left gathered holds quantized values: gather it exactly
        gatherer.unshard(unit, exact=True)
    for unit in units:
        gatherer.wait(unit)
    try:
        yield
    finally:
        if modifier_rank is not None:
            what = f"broadcast of rank {modifier_rank}'s edited parameters"
            wait_all([runtime.comm.broadcast(b.param_buffer.data, modifier_rank, what=what) for b in buckets])
        for unit in units:
            for bucket in unit.buckets:
                bucket.check_attached(whole=True)
                stage.write_back(bucket)
                stage.detach_storage(bucket)
            gatherer.forget(unit)
            gatherer.reshard(unit)


@contextmanager
def _gathered_on_host(runtime: Runtime, units: list, modifier_rank: int | None) -> Iterator[None]:
    """``offload.params``: the whole parameters in host memory, where their shards live, gathered one bucket at a
    time on the device (the model may be larger than the device); on exit each rank's chunk of the edits goes
    straight into its shard (a modifier's edits reach the others through the device, again one bucket at a time)."""
    gatherer, stage, comm = runtime.gatherer, runtime.stage, runtime.comm
    buckets = [b for unit in units for b in unit.buckets]
    for unit in units:
        gatherer.reshard(unit)  # (the root may still be gathered on the device)
    wholes, views = {}, []  # (each slot with its view of the whole parameters)
    for bucket in buckets:
        stage.unshard(bucket, comm, exact=True).wait()
        stage.end_unshard(bucket)
        wholes[bucket] = bucket.param_buffer.data.to(HOST, copy=True)
        bucket.param_buffer.free()
        for slot in bucket.slots:
            views.append((slot, wholes[bucket].narrow(0, slot.span.offset, slot.span.numel).view(slot.shape)))
            set_data(slot.param, views[-1][1], sharded=False)
    try:
        yield
    finally:
        for slot, view in views:  # an edit that replaced .data (model.to(), a cast) would be lost: refuse it
            if slot.tensor.data_ptr() != view.data_ptr():
                raise ValueError(cast_after_wrapping(slot.name))
        for bucket in buckets:
            whole = wholes[bucket]
            if modifier_rank is not None:
                staged = whole.to(comm.device)
                what = f"broadcast of rank {modifier_rank}'s edited {bucket}"
                comm.broadcast(staged, modifier_rank, what=what).wait()
                whole.copy_(staged)
            start, end = bucket.layout.chunk_range(bucket.shard_index)
            with torch.no_grad():
                bucket.shard.copy_(whole.narrow(0, start, end - start))
            for slot in bucket.slots:
                set_data(slot.param, slot.placeholder, sharded=True)
        for unit in units:
            gatherer.forget(unit)


def _check_modifier(rank: int, comm: Communicator) -> None:
    if 0 <= rank < comm.world_size:
        return
    if comm.replicas is not None:
        raise ValueError(f"modifier_rank={rank} is not a rank of the shard group (0..{comm.world_size - 1}): with "
                         "hierarchical sharding, edit on a rank of the first group (its edits reach every rank)")
    raise ValueError(f"modifier_rank={rank} is not a rank of this ZeroOptimizer's group (0..{comm.world_size - 1})")


def buckets_of(runtime: Runtime, targets: Targets) -> list[Bucket]:
    """The buckets holding the parameters of ``targets`` (all of them for ``None``)."""
    if targets is None:
        return list(runtime.buckets)
    items = [targets] if isinstance(targets, torch.nn.Module | torch.Tensor) else list(targets)
    wanted: set[int] = set()
    for item in items:
        params = item.parameters() if isinstance(item, torch.nn.Module) else [item]
        wanted.update(id(p) for p in params)
    known = {id(p) for p in runtime.module.parameters()}
    if not wanted <= known:
        raise ValueError("gathered_parameters() got parameters that are not in the model this ZeroOptimizer wraps")
    return [b for b in runtime.buckets if any(id(s.param) in wanted for s in b.slots)]
