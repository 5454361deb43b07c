"""A bucket's buffers as its plan declares them: one object per concern, holding exactly the buffers it uses.

``Bucket`` (``zero.runtime.buffers.bucket``) builds them once from its plan (``zero.runtime.buffers.plan``: the only
place that decides which buffers exist); the code that reads a buffer asks the object that has it, and no reader asks
whether a field is set to learn the stage or the precision:

* the parameters: :class:`WholeParams` (stages 0-2: resident; this rank's chunk, ``shard``, a view of them) or
  :class:`ShardedParams` (stage 3: the chunk in a buffer of its own, the whole only while gathered);
* what the optimizer steps: :class:`MasterCopy` (a master chunk of its own, cast into the parameters after a step)
  or :class:`NoMasterCopy` (the parameters' own chunk: the step writes them directly);
* the gradients: :class:`InPlaceGrads` (the persistent gradient buffer, reduced in place: it is the staging buffer and
  its chunk the gradient shard; :class:`CarriedGrads` adds stage 1's carry), :class:`StagedGrads` (a transient
  staging buffer in the reduce dtype and a gradient shard of its own; :class:`BufferedStagedGrads` adds the
  persistent local gradients of stages 0-1 under mixed precision), or :class:`NoGrads` (a frozen bucket);
* the optimizer's gradients: :class:`MasterGrads` (a copy in the master dtype) or :class:`NoMasterGrads` (the
  gradient shard itself).

Each has ``offloaded()``: its buffers on the optimizer's (or stage 3's shard) side, which offload pages.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero.runtime.buffers.flat_buffer import FlatBuffer
from zero.runtime.buffers.placement import Placements
from zero.runtime.buffers.plan import Role


class Spanned(Protocol):
    """What a gradient view needs of a slot (``zero.runtime.buffers.bucket.ParamSlot``)."""

    span: object
    shape: torch.Size


def span_view(buffer: FlatBuffer, slot: Spanned) -> torch.Tensor:
    """The slot's span of a full-size buffer, shaped like the parameter."""
    return buffer.view(slot.span.offset, slot.span.numel, slot.shape)


# ----- the parameters ----------------------------------------------------------------------------------------------


class WholeParams:
    """Stages 0-2: the whole parameters stay resident; this rank's chunk is a view of them."""

    label = "whole"  # what the profiler calls the parameter buffer

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        self.buffer, self.chunk = buffers[Role.PARAMS], chunk

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk of the parameters (1D, compute dtype)."""
        return self.buffer.view(*self.chunk)

    def placeholders(self, slots: list) -> list[torch.Tensor]:
        """What the parameters' ``.data`` are while sharded: none here (they are views of the buffer)."""
        return []

    def offloaded(self) -> list[FlatBuffer]:
        return []


class ShardedParams:
    """Stage 3: this rank's chunk persists in ``shard_buffer``; the whole parameters exist while gathered."""

    label = "gathered"

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        self.buffer, self.shard_buffer, self.chunk = buffers[Role.PARAMS], buffers[Role.SHARD], chunk

    @property
    def shard(self) -> torch.Tensor:
        return self.shard_buffer.data

    def placeholders(self, slots: list) -> list[torch.Tensor]:
        """Each slot's placeholder (its ``.data`` while sharded: ``zero.runtime.buffers.sharded_param``)."""
        return [slot.placeholder for slot in slots]

    def offloaded(self) -> list[FlatBuffer]:
        return [self.shard_buffer]


# ----- what the optimizer steps ------------------------------------------------------------------------------------


class MasterCopy:
    """A master chunk of its own (mixed precision, or an offloaded optimizer): cast into the parameters' chunk after a
    step or a load."""

    def __init__(self, buffers: dict[Role, FlatBuffer], params: WholeParams | ShardedParams, placements: Placements):
        self.buffer, self.params, self.placements = buffers[Role.MASTER], params, placements

    @property
    def master(self) -> torch.Tensor:
        return self.buffer.data

    def copies(self) -> list[torch.Tensor]:
        """The chunks holding the parameters' values besides the parameters' own: the master."""
        return [self.master]

    def push(self) -> None:
        """Cast the master chunk into this rank's chunk of the parameters. Offloaded to a GPU: cast on the host into
        pinned memory, then one asynchronous copy up."""
        master, shard = self.buffer.data, self.params.shard
        with torch.no_grad():
            if master.device == shard.device:
                shard.copy_(master)
            else:
                low = torch.empty(master.shape, dtype=shard.dtype, pin_memory=self.placements.pin)
                low.copy_(master)
                shard.copy_(low, non_blocking=self.placements.pin)  # the host allocator keeps ``low`` until done

    def adopt_edits(self) -> None:
        adopt_edits_(self.buffer.data, self.params.shard)

    def offloaded(self) -> list[FlatBuffer]:
        return [self.buffer]


class NoMasterCopy:
    """The optimizer steps the parameters' own chunk: nothing to cast, nothing to adopt."""

    def __init__(self, params: WholeParams | ShardedParams):
        self.params = params

    @property
    def master(self) -> torch.Tensor:
        return self.params.shard

    def copies(self) -> list[torch.Tensor]:
        return []

    def push(self) -> None:
        pass

    def adopt_edits(self) -> None:
        pass

    def offloaded(self) -> list[FlatBuffer]:
        return []


ADOPT_BLOCK = 1 << 20  # elements per pass of adopt_edits_: bounds its temporaries to a few MiB


@torch.no_grad()
def adopt_edits_(master: torch.Tensor, shard: torch.Tensor) -> None:
    """Write into ``master`` (1D) the elements of ``shard`` (its low-precision copy, 1D) that differ from ``master``
    cast down, one block of ``ADOPT_BLOCK`` elements at a time, so that its temporaries (the cast copies, the mask
    and the result, about 11 bytes per element for bf16) stay a few MiB whatever the bucket's size, also when
    ``master`` is in host memory."""
    for start in range(0, master.numel(), ADOPT_BLOCK):
        high, low = master[start : start + ADOPT_BLOCK], shard[start : start + ADOPT_BLOCK]
        here = high.to(device=low.device)  # ``high`` itself when both are on one device
        edited = low.ne(here.to(low.dtype))
        high.copy_(torch.where(edited, low.to(high.dtype), here))


# ----- the gradients -----------------------------------------------------------------------------------------------


class InPlaceGrads:
    """Stages 0-1 reducing in the parameters' dtype: the persistent gradient buffer (``p.grad`` views of it) is what
    the collective reduces (``staging``), and this rank's chunk of it is the reduced gradient shard."""

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        self.buffer, self.chunk = buffers[Role.GRADS], chunk
        self.staging = self.buffer

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.buffer.view(*self.chunk)

    def view(self, slot: Spanned) -> torch.Tensor:
        """The slot's local gradient inside the gradient buffer, shaped like the parameter."""
        return span_view(self.buffer, slot)

    def offloaded(self) -> list[FlatBuffer]:
        return []


class CarriedGrads(InPlaceGrads):
    """:class:`InPlaceGrads` with ``carry``: reduced gradients set aside while another pass adds to the buffer."""

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        super().__init__(buffers, chunk)
        self.carry = buffers[Role.GRAD_CARRY]


class StagedGrads:
    """Each reduction copies the local gradients into a transient ``staging`` buffer (the reduce dtype), whose reduced
    chunk accumulates in a gradient shard of its own (``shard_buffer``, on the optimizer's side)."""

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        self.staging, self.shard_buffer = buffers[Role.STAGING], buffers[Role.GRAD_SHARD]

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.shard_buffer.data

    def offloaded(self) -> list[FlatBuffer]:
        return [self.shard_buffer]


class BufferedStagedGrads(StagedGrads):
    """:class:`StagedGrads` whose local gradients sit in a persistent gradient buffer (stages 0-1 under mixed precision,
    reducing in another dtype), as :class:`InPlaceGrads`'s do."""

    def __init__(self, buffers: dict[Role, FlatBuffer], chunk: tuple[int, int]):
        super().__init__(buffers, chunk)
        self.buffer = buffers[Role.GRADS]

    def view(self, slot: Spanned) -> torch.Tensor:
        return span_view(self.buffer, slot)


class NoGrads:
    """A frozen bucket: no gradient buffer of any kind."""

    def offloaded(self) -> list[FlatBuffer]:
        return []


Grads = InPlaceGrads | StagedGrads | NoGrads


def grads_of(buffers: dict[Role, FlatBuffer], chunk: tuple[int, int], trainable: bool) -> Grads:
    """The gradient buffers the plan declared (its buffers, built by role)."""
    if not trainable:
        return NoGrads()
    if Role.STAGING in buffers:  # a staging buffer of its own
        return (BufferedStagedGrads if Role.GRADS in buffers else StagedGrads)(buffers, chunk)
    return (CarriedGrads if Role.GRAD_CARRY in buffers else InPlaceGrads)(buffers, chunk)


# ----- the optimizer's gradients -----------------------------------------------------------------------------------


class MasterGrads:
    """The optimizer's gradients in a buffer of their own (the master dtype, or the host when the gradient shard is on
    the device), made from the gradient shard at each step."""

    def __init__(self, buffers: dict[Role, FlatBuffer], grads: Grads):
        self.buffer, self.grads = buffers[Role.MASTER_GRAD], grads

    @property
    def step_grads(self) -> torch.Tensor:
        return self.buffer.data

    def touches(self, inv_scale: float) -> bool:
        return True

    def make(self, inv_scale: float) -> None:
        self.buffer.ensure_allocated(zero=False)
        self.buffer.data.copy_(self.grads.grad_shard, non_blocking=self.buffer.pinned)
        if inv_scale != 1.0:
            self.buffer.data.mul_(inv_scale)

    def release(self) -> None:
        self.buffer.free()

    def made(self) -> list[torch.Tensor]:
        """This step's copy, if made already."""
        return [self.buffer.data] if self.buffer.is_allocated else []

    def offloaded(self) -> list[FlatBuffer]:
        return [self.buffer]


class NoMasterGrads:
    """The optimizer's gradients are the gradient shard itself (divided in place by the loss scale, if any)."""

    def __init__(self, grads: Grads):
        self.grads = grads

    @property
    def step_grads(self) -> torch.Tensor:
        return self.grads.grad_shard

    def touches(self, inv_scale: float) -> bool:
        return inv_scale != 1.0

    def make(self, inv_scale: float) -> None:
        if inv_scale != 1.0:
            self.grads.grad_shard.mul_(inv_scale)

    def release(self) -> None:
        pass

    def made(self) -> list[torch.Tensor]:
        return []

    def offloaded(self) -> list[FlatBuffer]:
        return []
