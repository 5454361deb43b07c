"""Giving the model back: ``ZeroOptimizer.close()``, and what happens when an optimizer is dropped.

Closing removes every hook the optimizer put on the model and its parameters and, at stage 3,
gathers every parameter (a collective: every rank closes) into a plain ``nn.Parameter`` of its
own, whole, with its identity kept, bucket by bucket (with ``offload.params``, into host memory:
the model may be larger than the device); gradients behind guards are dropped. At stages 0-2 the
parameters are whole already (views of the optimizer's flat buffers, which they keep alive).

A stage-3 optimizer dropped without ``close()`` cannot gather in its finalizer: a collective
there would run whenever the garbage collector gets to it, on each rank at another moment, and
hang. In a world of one nothing is communicated, so the parameters are made whole at once;
otherwise (or when the process group was destroyed first) they stay sharded, each holding on to
its shards, and the next ``ZeroOptimizer`` built over the model gathers them first (its constructor
runs on every rank at the same point). Until then any use of them raises an error that says so.
A finalizer never raises: what it cannot do is left to that error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.placement import HOST
from zero.runtime.buffers.sharded_param import unmanaged_class
from zero.runtime.stages.stage import Stage


class ModelRelease:
    """What one optimizer must undo on the model: its hooks and (stage 3) the sharding of its parameters."""

    def __init__(self, hooks: list[Any], buckets: list[Bucket], stage: Stage, comm: Communicator, *, sharded: bool):
        self.hooks = hooks  # RemovableHandles
        self.buckets = buckets
        self.sharded = buckets if sharded else []  # stage 3's buckets (trainable and frozen) are sharded
        self.stage = stage
        self.comm = comm
        self.done = False

    def close(self) -> None:
        """Remove the hooks; make the stage-3 parameters whole (collective)."""
        if self.done:
            return
        self.remove_hooks()
        for bucket in self.buckets:
            self.stage.drop_guards(bucket)
        self.unshard_all()

    def dropped(self) -> None:
        """The optimizer was garbage-collected without ``close()`` (see the module docstring)."""
        if self.done:
            return
        self.remove_hooks()
        if not self.comm.destroyed and self.comm.skips_collectives:
            self.unshard_all()
            return
        for bucket in self.sharded:
            for slot in bucket.slots:
                slot.param._zero_dropped_by = self

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def unshard_all(self) -> None:
        """Gather every sharded bucket and turn each of its parameters into a whole ``nn.Parameter`` (a unit still
        gathered when its optimizer was dropped is gathered again: its shards are what counts).

        One bucket at a time, the next one's gather in flight: the device never holds more than two gathered
        buckets beyond the parameters given back, and with ``offload.params`` those go where the shards were (host
        memory), so a model larger than the device can be given back."""
        for bucket in self.sharded:
            bucket.param_buffer.abandon()
        handles = {}
        for i, bucket in enumerate(self.sharded):
            for ahead in self.sharded[i : i + 2]:
                if ahead not in handles:
                    handles[ahead] = self.stage.unshard(ahead, self.comm, exact=True)
            handles.pop(bucket).wait()
            self.stage.end_unshard(bucket)
            home = HOST if bucket.placements.params_offloaded else None
            for slot in bucket.slots:
                whole = slot.view.detach().to(home or slot.view.device, copy=True)
                param = slot.param
                param.__class__ = unmanaged_class(param)
                with torch.no_grad():
                    slot.tensor.data = whole
                for attr in ("_zero_name", "_zero_sharded", "_zero_owner", "_zero_dropped_by"):
                    param.__dict__.pop(attr, None)
            bucket.param_buffer.free()
        self.done = True


def gather_dropped_shards(model: nn.Module) -> None:
    """Before a new optimizer is built over ``model``: gather the parameters that a dropped stage-3
    optimizer left sharded (every rank builds the new optimizer, so every rank gathers)."""
    releases: dict[int, ModelRelease] = {}
    for p in model.parameters():
        release = p.__dict__.get("_zero_dropped_by")
        if release is not None:
            releases.setdefault(id(release), release)
    for release in releases.values():  # in the order of the model's parameters: the same on every rank
        release.unshard_all()
