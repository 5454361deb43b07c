"""``Bucket``: one layout bound to its parameters, the flat buffers its plan lists, and local optimizer pieces.

The buffers are built once, from the bucket's plan (``zero.runtime.buffers.plan``: its table says which exist at
each stage and precision, their sizes, dtypes and where they live), each on its placement; the stage then
only moves them between states (``zero.runtime.buffers.flat_buffer``). The attributes, by role:

* ``param_buffer`` (params), ``shard_buffer`` (shard, stage 3), ``master_buffer`` (master, or ``None``: the
  optimizer steps ``shard`` itself), ``grad_buffer`` (grads, stages 0-1), ``staging`` (staging: the gradient
  buffer itself when the reduction is in place), ``grad_shard_buffer`` (grad_shard, when staged; else
  ``grad_shard`` is this rank's chunk of the gradient buffer), ``grad_carry`` (stage 1 in place),
  ``master_grad`` (the optimizer's own gradients), ``secondary_buffer`` (hpZ's secondary copy);
* ``slots``: the model parameters packed in it, whose ``.data`` are views of ``param_buffer``;
* ``pieces``: 1D views of ``master``, one per parameter overlapping this rank's chunk: the tensors the wrapped
  ``torch.optim`` optimizer sees.

A *frozen* bucket (stage 3: parameters with ``requires_grad=False``, sharded and gathered with their unit like
the others) has no gradient buffers, no master and no pieces. Per backward pass a bucket also tracks which
parameters have handed in their gradient.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from zero.memory import MemoryItem
from zero.runtime.buffers.flat_buffer import FlatBuffer
from zero.runtime.buffers.layout import ParamSpan, Piece
from zero.runtime.buffers.local_tensor import PlainLocal, TensorParallelLocal
from zero.runtime.buffers.placement import DevicePlacement, Placements
from zero.runtime.buffers.plan import BucketPlan, Role
from zero.runtime.buffers.sharded_param import cast_after_wrapping


@dataclass
class ParamSlot:
    """One parameter and where it lives, with its gradient bookkeeping."""

    param: torch.nn.Parameter
    name: str
    group_index: int  # index of its param group in the wrapped optimizer (-1: frozen, not stepped)
    bucket_ref: "weakref.ref[Bucket]"  # weak: the bucket holds its slots, and a cycle would outlive the model
    span: ParamSpan
    order: int = 0  # position in model.named_parameters()
    view: torch.Tensor | None = None  # the parameter's shape, inside ``bucket.param_buffer``
    placeholder: torch.Tensor | None = None  # stage 3: its ``.data`` while sharded
    grad_guard: torch.Tensor | None = None  # stages 1-3: its p.grad while the reduced gradient is sharded
    local_grad: torch.Tensor | None = None  # stages 1-3: no_sync() gradients kept behind the guard between passes
    wide_grad: torch.Tensor | None = None  # no_sync() gradients accumulated in the wider reduce dtype (bf16 -> fp32)
    used_here: bool = False  # got a gradient on this rank since the last zero_grad(set_to_none=True)
    used_anywhere: bool = False  # ... on any rank, as of the last reduction (p.grad defined in PyTorch terms)
    ready: bool = False  # handed in its gradient in the current backward pass
    local: PlainLocal | TensorParallelLocal = PlainLocal()  # how to reach its local tensor (a DTensor's: tp)

    @property
    def bucket(self) -> "Bucket":
        return self.bucket_ref()

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor whose ``.data`` is managed: the parameter itself, or its local tensor under tensor parallelism
        (``zero.runtime.buffers.local_tensor``)."""
        return self.local.local(self.param)

    @property
    def shape(self) -> torch.Size:
        """The local tensor's shape (what the flat buffers hold of the parameter on this rank)."""
        return self.tensor.shape

    @property
    def grad(self) -> torch.Tensor | None:
        """The local tensor of ``p.grad`` (``None`` without one)."""
        return self.local.local_grad(self.param.grad)

    @grad.setter
    def grad(self, local: torch.Tensor | None) -> None:
        self.param.grad = self.local.param_grad(local)

    @property
    def has_grad(self) -> bool:
        """Whether, in PyTorch terms, the parameter has a gradient (here or on another rank)."""
        return self.used_here or self.used_anywhere


@dataclass
class LocalPiece:
    """A piece of a parameter in this rank's chunk, as the inner optimizer sees it."""

    slot: ParamSlot
    piece: Piece
    tensor: torch.Tensor  # 1D view of the bucket's ``shard``


class Bucket:
    """Runtime state of one :class:`~zero.runtime.buffers.layout.BucketLayout` on one rank."""

    def __init__(self, plan: BucketPlan, shard_index: int, device: torch.device, placements: Placements):
        self.plan = plan
        self.layout = plan.layout
        self.dtypes = plan.dtypes
        self.placements = placements
        self.index = plan.layout.index
        self.shard_index = shard_index
        self.trainable = plan.trainable
        self.slots: list[ParamSlot] = []
        self.unit = None  # stage 3: the UnitSpec whose forward gathers this bucket
        on_device = placements.device if placements.device.device == device else DevicePlacement(device)
        sides = {"device": on_device, "optimizer": placements.optimizer, "shard": placements.shard}
        buffers = {  # resident ones allocated and zeroed (padding included)
            spec.role: FlatBuffer(
                spec.numel, spec.dtype, sides[spec.side], allocate=spec.resident, name=spec.role.value
            )
            for spec in plan.buffers
            if spec.view_of is None
        }
        self.param_buffer: FlatBuffer = buffers[Role.PARAMS]
        self.shard_buffer: FlatBuffer | None = buffers.get(Role.SHARD)
        self.master_buffer: FlatBuffer | None = buffers.get(Role.MASTER)
        self.grad_buffer: FlatBuffer | None = buffers.get(Role.GRADS)
        self.staging: FlatBuffer | None = buffers.get(Role.STAGING, self.grad_buffer)
        self.grad_shard_buffer: FlatBuffer | None = buffers.get(Role.GRAD_SHARD)
        self.grad_carry: FlatBuffer | None = buffers.get(Role.GRAD_CARRY)
        self.master_grad: FlatBuffer | None = buffers.get(Role.MASTER_GRAD)
        self.secondary_buffer: FlatBuffer | None = buffers.get(Role.SECONDARY)
        self.pieces: list[LocalPiece] = []
        self.num_ready = 0

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """This rank's reduced gradient chunk (1D, reduce dtype): its own buffer when the reduction is staged,
        else this rank's chunk of the gradient buffer (reduced in place)."""
        if self.grad_shard_buffer is not None:
            return self.grad_shard_buffer.data
        return self.chunk_of(self.grad_buffer) if self.grad_buffer is not None else None

    def __repr__(self) -> str:
        names = [s.name for s in self.slots]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} params)" if len(names) > 3 else "")
        return f"{'' if self.trainable else 'frozen '}bucket {self.index} [{shown}]"

    # ----- construction ---------------------------------------------------------------------------

    def add(self, slot: ParamSlot) -> None:
        self.slots.append(slot)

    def make_views(self) -> None:
        """Each slot's view of ``param_buffer``. Views can only be made of allocated storage; a
        released buffer is allocated untouched for the moment and released again."""
        released = not self.param_buffer.is_allocated
        if released:
            self.param_buffer.allocate(zero=False)
        for slot in self.slots:
            slot.view = self.param_buffer.view(slot.span.offset, slot.span.numel, slot.shape)
        if released:
            self.param_buffer.free()

    def pack_params(self) -> None:
        """Copy every parameter into ``param_buffer`` (cast to the compute dtype) and make its ``.data`` a
        view of it (stages 0-2); the master chunk, if any, gets the values before the cast."""
        self.make_views()
        with torch.no_grad():
            for slot in self.slots:
                tensor = slot.tensor
                if self.master_buffer is not None:
                    self.copy_to_shard(slot, tensor.data)
                slot.view.copy_(tensor.data)
                tensor.data = slot.view

    def build_pieces(self) -> None:
        """Create the inner optimizer's tensors: views of the master chunk (none in a frozen bucket)."""
        if not self.trainable:
            return
        slot_of = {slot.span.param_index: slot for slot in self.slots}
        master = self.master
        self.pieces = [
            LocalPiece(slot_of[p.param_index], p, master.narrow(0, p.chunk_start, p.numel))
            for p in self.layout.pieces(self.shard_index)
        ]

    def copy_to_shard(self, slot: ParamSlot, whole: torch.Tensor) -> None:
        """Copy the pieces of ``whole`` (the slot's full value) that fall in this rank's chunk into
        ``master`` (and, when it is separate, cast into ``shard``)."""
        flat = whole.detach().reshape(-1)  # 1D
        targets = [self.master] if self.master_buffer is None else [self.master, self.shard]
        with torch.no_grad():
            for piece in self.layout.pieces(self.shard_index):
                if piece.param_index == slot.span.param_index:
                    for target in targets:
                        target.narrow(0, piece.chunk_start, piece.numel).copy_(
                            flat.narrow(0, piece.param_start, piece.numel)
                        )

    # ----- master weights --------------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        """The optimizer's side (master, its gradients, the step) lives in host memory (``zero.offload``)."""
        return self.placements.optimizer_offloaded

    def push_master(self) -> None:
        """Cast the master chunk into this rank's chunk of the parameters (after a step or a load). Offloaded
        to a GPU: cast on the host into pinned memory, then one asynchronous copy up."""
        if self.master_buffer is None:
            return
        master, shard = self.master_buffer.data, self.shard
        with torch.no_grad():
            if master.device == shard.device:
                shard.copy_(master)
            else:
                low = torch.empty(master.shape, dtype=shard.dtype, pin_memory=self.placements.pin)
                low.copy_(master)
                shard.copy_(low, non_blocking=self.placements.pin)  # the host allocator keeps ``low`` until done

    def adopt_edits(self) -> None:
        """Take into the master chunk the elements of this rank's parameter chunk that differ from it cast
        down: values written since the last step (``model.load_state_dict()``, an edit inside
        ``gathered_parameters()``). The other elements keep their full precision."""
        if self.master_buffer is not None:
            adopt_edits_(self.master_buffer.data, self.shard)

    def makes_master_grads(self, inv_scale: float) -> bool:
        """Whether :meth:`make_master_grads` touches the gradients (else they are the optimizer's as they are)."""
        return self.master_grad is not None or inv_scale != 1.0

    def make_master_grads(self, inv_scale: float) -> None:
        """The optimizer's gradients: the gradient shard in the master dtype, divided by the loss scale
        (``inv_scale`` 1.0: none). In place when ``grad_shard`` is in the master dtype already."""
        if self.master_grad is not None:
            self.master_grad.ensure_allocated(zero=False)
            self.master_grad.data.copy_(self.grad_shard, non_blocking=self.master_grad.pinned)
            target = self.master_grad.data
        else:
            target = self.grad_shard
        if inv_scale != 1.0:
            target.mul_(inv_scale)

    def release_master_grads(self) -> None:
        if self.master_grad is not None:
            self.master_grad.free()

    def evict(self) -> None:
        """Offload to disk: write the buffers back and drop them from memory until their next use (else nothing)."""
        for buffer in self.offloaded_buffers():
            buffer.evict()

    def offloaded_buffers(self, grads_only: bool = False) -> list[FlatBuffer]:
        """The optimizer side's buffers, and stage 3's parameter shard (``grads_only``: the gradient shards only)."""
        grads = [b for b in (self.grad_shard_buffer, self.master_grad) if b is not None]
        if grads_only:
            return grads
        return grads + [b for b in (self.master_buffer, self.shard_buffer) if b is not None]

    # ----- views ----------------------------------------------------------------------------------

    def chunk_of(self, buffer: FlatBuffer) -> torch.Tensor:
        """This rank's chunk of a full-size buffer (1D view)."""
        start, end = self.layout.chunk_range(self.shard_index)
        return buffer.view(start, end - start)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk of the parameters (1D, compute dtype): at stages 0-2 a view of
        ``param_buffer``, at stage 3 ``shard_buffer``."""
        if self.shard_buffer is not None:
            return self.shard_buffer.data
        return self.chunk_of(self.param_buffer)

    @property
    def master(self) -> torch.Tensor:
        """The chunk the optimizer steps (1D): ``master_buffer``, or ``shard`` itself (the step then
        writes the parameters directly)."""
        return self.master_buffer.data if self.master_buffer is not None else self.shard

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slot's local gradient inside ``grad_buffer``, shaped like the parameter (stages 0-1)."""
        assert self.grad_buffer is not None
        return self.grad_buffer.view(slot.span.offset, slot.span.numel, slot.shape)

    def staging_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slot's span of ``staging``, shaped like the parameter."""
        assert self.staging is not None
        return self.staging.view(slot.span.offset, slot.span.numel, slot.shape)

    @property
    def step_grads(self) -> torch.Tensor:
        """The optimizer's gradient chunk (1D): ``master_grad``, or ``grad_shard``."""
        source = self.master_grad.data if self.master_grad is not None else self.grad_shard
        assert source is not None
        return source

    def grad_piece(self, piece: LocalPiece) -> torch.Tensor:
        """The optimizer's gradient for one local piece (1D view of :attr:`step_grads`)."""
        return self.step_grads.narrow(0, piece.piece.chunk_start, piece.piece.numel)

    def pieces_of(self, slot: ParamSlot, chunk: torch.Tensor) -> list[torch.Tensor]:
        """The slot's elements in ``chunk`` (1D, one chunk long: ``grad_shard``, ``grad_carry``), as views."""
        return [chunk.narrow(0, p.piece.chunk_start, p.piece.numel) for p in self.pieces if p.slot is slot]

    def zero_pieces_of(self, slot: ParamSlot, chunk: torch.Tensor) -> None:
        for view in self.pieces_of(slot, chunk):
            view.zero_()

    def check_attached(self, whole: bool) -> None:
        """Raise if a parameter changed dtype or device after wrapping (``model.to()``); with ``whole``
        (its values are in ``param_buffer``), also if its ``.data`` no longer views the buffer."""
        buffer = self.param_buffer.storage_tensor  # (dtype and device only)
        for slot in self.slots:
            p = slot.tensor
            if (p.dtype, p.device) != (buffer.dtype, buffer.device) or (whole and p.data_ptr() != slot.view.data_ptr()):
                raise ValueError(cast_after_wrapping(slot.name))

    # ----- memory ----------------------------------------------------------------------------------

    def roles(self, gathering: bool = False) -> Iterator[tuple[str, MemoryItem]]:
        """Each buffer this bucket owns as ``(model-state kind, item named for the profiler)``; kinds are
        ``parameters``, ``gradients`` and ``optimizer_state`` (where the ZeRO paper counts fp32 master
        weights). An alias appears under each role; counting by storage takes it once.
        ``gathering``: stage 3's all-gather into ``param_buffer`` is in flight (e.g. a prefetch)."""
        module = self.unit.name if self.unit is not None else ""
        if gathering:
            params = ("communication", "all-gather")
        else:
            params = ("parameters", "whole" if self.shard_buffer is None else "gathered")
        staging = self.staging if self.staging is not self.grad_buffer else None  # else: the local gradients
        host = self.placements.optimizer.where.suffix if self.offloaded else ""
        shard = "shard" + self.placements.shard.where.suffix
        roles = [
            ("parameters", *params, self.param_buffer),
            ("parameters", "parameters", shard, self.shard_buffer),
            ("parameters", "parameters", "secondary copy (hpZ)", self.secondary_buffer),
            ("optimizer_state", "optimizer_state", "master weights" + host, self.master_buffer),
            ("gradients", "gradients", "buckets", self.grad_buffer),
            ("gradients", "communication", "reduce-scatter", staging),  # exists only for the collective
            ("gradients", "gradients", "shard" + host, self.grad_shard_buffer),
            ("gradients", "gradients", "carried", self.grad_carry),
            ("gradients", "gradients", "master" + host, self.master_grad),
        ]
        for kind, category, label, buffer in roles:
            if buffer is not None:
                yield kind, MemoryItem(category, label, buffer.storage_tensor, module)
        if self.grad_shard_buffer is None and self.grad_buffer is not None:  # a view of the gradient buffer
            yield "gradients", MemoryItem("gradients", "shard", self.grad_shard, module)
        for slot in self.slots:
            grad = slot.grad
            if grad is not None:  # stages 2-3: autograd's gradient, not yet staged; or a guard
                label = "placeholder" if grad is slot.grad_guard else "whole"
                yield "gradients", MemoryItem("gradients", label, grad, module)
            if slot.local_grad is not None:
                yield "gradients", MemoryItem("gradients", "whole", slot.local_grad, module)
            if slot.placeholder is not None:
                yield "parameters", MemoryItem("parameters", "placeholder", slot.placeholder, module)

    # ----- per-backward bookkeeping -----------------------------------------------------------------

    def start_round(self) -> None:
        self.num_ready = 0
        for slot in self.slots:
            slot.ready = False

    @property
    def is_ready(self) -> bool:
        return self.num_ready == len(self.slots)


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
