"""``Bucket``: one layout bound to its parameters, the flat buffers its plan lists, and local optimizer pieces.

The buffers are built once, from the bucket's plan (``zero.runtime.buffers.plan``: its table says which exist at
each stage and precision, their sizes, dtypes and where they live), each on its placement; the stage then
only moves them between states (``zero.runtime.buffers.flat_buffer``). What it holds, by concern, each an object
with exactly the buffers its plan declared (``zero.runtime.buffers.bucket_buffers``):

* ``buffers``: every buffer with bytes of its own, by role; ``param_buffer`` (params) is in every bucket;
* ``params``: ``WholeParams`` (stages 0-2) or ``ShardedParams`` (stage 3: ``shard_buffer``), with ``shard``,
  this rank's chunk of the parameters;
* ``master_copy``: ``MasterCopy`` (a master chunk of its own) or ``NoMasterCopy`` (the optimizer steps ``shard``);
* ``grads``: ``InPlaceGrads`` / ``CarriedGrads`` (the persistent gradient buffer reduced in place, stage 1's carry),
  ``StagedGrads`` / ``BufferedStagedGrads`` (a transient staging buffer and a gradient shard of its own), or
  ``NoGrads`` (frozen), with ``staging`` and ``grad_shard``;
* ``master_grads``: ``MasterGrads`` (the optimizer's gradients in a buffer of their own) or ``NoMasterGrads``;
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
from zero.runtime.buffers.bucket_buffers import (
    MasterCopy,
    MasterGrads,
    NoMasterCopy,
    NoMasterGrads,
    ShardedParams,
    WholeParams,
    adopt_edits_,
    grads_of,
    span_view,
)
from zero.runtime.buffers.flat_buffer import FlatBuffer
from zero.runtime.buffers.layout import ParamSpan, Piece
from zero.runtime.buffers.local_tensor import PlainLocal, TensorParallelLocal
from zero.runtime.buffers.placement import DevicePlacement, Placements
from zero.runtime.buffers.plan import BucketPlan, Role
from zero.runtime.buffers.sharded_param import cast_after_wrapping, placeholder
from zero.runtime.buffers.units import UnitSpec

__all__ = ["Bucket", "LocalPiece", "ParamSlot", "adopt_edits_"]  # (adopt_edits_: the estimator traces it)


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
        self.unit = None  # stage 3: the UnitSpec whose forward gathers this bucket (join_unit)
        self.module = ""  # the path of its unit's module, which the profiler names its buffers by
        on_device = placements.device if placements.device.device == device else DevicePlacement(device)
        sides = {"device": on_device, "optimizer": placements.optimizer, "shard": placements.shard}
        self.buffers: dict[Role, FlatBuffer] = {  # what the plan gave bytes of its own; resident ones zeroed
            spec.role: FlatBuffer(
                spec.numel, spec.dtype, sides[spec.side], allocate=spec.resident, name=spec.role.value
            )
            for spec in plan.buffers
            if spec.view_of is None
        }
        start, end = self.layout.chunk_range(shard_index)
        chunk = (start, end - start)
        self.param_buffer: FlatBuffer = self.buffers[Role.PARAMS]
        self.params = (ShardedParams if plan.has(Role.SHARD) else WholeParams)(self.buffers, chunk)
        self.master_copy = (
            MasterCopy(self.buffers, self.params, placements) if plan.has(Role.MASTER) else NoMasterCopy(self.params)
        )
        self.grads = grads_of(self.buffers, chunk, plan.trainable)
        self.master_grads = (
            MasterGrads(self.buffers, self.grads) if plan.has(Role.MASTER_GRAD) else NoMasterGrads(self.grads)
        )
        # an owner reads a whole parameter's master in the parameters it holds, unless the master is apart from them
        self.master_apart = plan.has(Role.MASTER) or plan.has(Role.SHARD)
        self.pieces: list[LocalPiece] = []
        self.num_ready = 0

    def __repr__(self) -> str:
        names = [s.name for s in self.slots]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} params)" if len(names) > 3 else "")
        return f"{'' if self.trainable else 'frozen '}bucket {self.index} [{shown}]"

    # ----- construction ---------------------------------------------------------------------------

    def add(self, slot: ParamSlot) -> None:
        self.slots.append(slot)

    def join_unit(self, unit: UnitSpec) -> None:
        """Stage 3: ``unit``'s forward gathers this bucket."""
        self.unit, self.module = unit, unit.name

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
        view of it (stages 0-2); a master chunk of its own gets the values before the cast."""
        self.make_views()
        with torch.no_grad():
            for slot in self.slots:
                tensor = slot.tensor
                self.copy_to_master(slot, tensor.data)
                slot.view.copy_(tensor.data)
                tensor.data = slot.view

    @property
    def used_pieces(self) -> list[LocalPiece]:
        """The pieces of parameters that have a gradient (``used_anywhere``: on some rank, as of the last
        reduction), in the bucket's order: what clipping and the step read."""
        return [p for p in self.pieces if p.slot.used_anywhere]

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
        ``master`` (and, when it is a copy of its own, cast into ``shard``)."""
        self._copy_pieces(slot, whole, [*self.master_copy.copies(), self.shard])

    def copy_to_master(self, slot: ParamSlot, whole: torch.Tensor) -> None:
        """Copy the pieces of ``whole`` in this rank's chunk into a master copy of its own (none: nothing to do, the
        parameters' chunk is the master)."""
        self._copy_pieces(slot, whole, self.master_copy.copies())

    def _copy_pieces(self, slot: ParamSlot, whole: torch.Tensor, targets: list[torch.Tensor]) -> None:
        flat = whole.detach().reshape(-1)  # 1D
        with torch.no_grad():
            for piece in self.layout.pieces(self.shard_index) if targets else ():
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
        """Cast the master chunk into this rank's chunk of the parameters (after a step or a load; nothing when the
        optimizer steps the parameters' own chunk)."""
        self.master_copy.push()

    def adopt_edits(self) -> None:
        """Take into the master chunk the elements of this rank's parameter chunk that differ from it cast
        down: values written since the last step (``model.load_state_dict()``, an edit inside
        ``gathered_parameters()``). The other elements keep their full precision."""
        self.master_copy.adopt_edits()

    def makes_master_grads(self, inv_scale: float) -> bool:
        """Whether :meth:`make_master_grads` touches the gradients (else they are the optimizer's as they are)."""
        return self.master_grads.touches(inv_scale)

    def make_master_grads(self, inv_scale: float) -> None:
        """The optimizer's gradients: the gradient shard in the master dtype, divided by the loss scale
        (``inv_scale`` 1.0: none). In place when ``grad_shard`` is in the master dtype already."""
        self.master_grads.make(inv_scale)

    def release_master_grads(self) -> None:
        self.master_grads.release()

    def evict(self) -> None:
        """Offload to disk: write the buffers back and drop them from memory until their next use (else nothing)."""
        for buffer in self.offloaded_buffers():
            buffer.evict()

    def offloaded_buffers(self, grads_only: bool = False) -> list[FlatBuffer]:
        """The optimizer side's buffers, and stage 3's parameter shard (``grads_only``: the gradient shards only)."""
        grads = self.grads.offloaded() + self.master_grads.offloaded()
        if grads_only:
            return grads
        return grads + self.master_copy.offloaded() + self.params.offloaded()

    # ----- views ----------------------------------------------------------------------------------

    def chunk_of(self, buffer: FlatBuffer) -> torch.Tensor:
        """This rank's chunk of a full-size buffer (1D view)."""
        start, end = self.layout.chunk_range(self.shard_index)
        return buffer.view(start, end - start)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk of the parameters (1D, compute dtype): at stages 0-2 a view of
        ``param_buffer``, at stage 3 its own buffer."""
        return self.params.shard

    @property
    def master(self) -> torch.Tensor:
        """The chunk the optimizer steps (1D): a master copy of its own, or ``shard`` itself (the step then
        writes the parameters directly)."""
        return self.master_copy.master

    @property
    def staging(self) -> FlatBuffer:
        """What the gradient collective reduces (a trainable bucket's: the gradient buffer when reduced in place)."""
        return self.grads.staging

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced gradient chunk (1D, reduce dtype): its own buffer when the reduction is staged,
        else this rank's chunk of the gradient buffer (reduced in place)."""
        return self.grads.grad_shard

    @property
    def secondary_buffer(self) -> FlatBuffer:
        """hpZ's secondary copy of the parameters (only a stage-3 bucket under ``hpz_partition_size`` has one)."""
        return self.buffers[Role.SECONDARY]

    def staging_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slot's span of ``staging``, shaped like the parameter."""
        return span_view(self.grads.staging, slot)

    @property
    def step_grads(self) -> torch.Tensor:
        """The optimizer's gradient chunk (1D): a copy of its own, or ``grad_shard``."""
        return self.master_grads.step_grads

    def grad_piece(self, piece: LocalPiece) -> torch.Tensor:
        """The optimizer's gradient for one local piece (1D view of :attr:`step_grads`)."""
        return self.step_grads.narrow(0, piece.piece.chunk_start, piece.piece.numel)

    def pieces_of(self, slot: ParamSlot, chunk: torch.Tensor) -> list[torch.Tensor]:
        """The slot's elements in ``chunk`` (1D, one chunk long: ``grad_shard``, the carry), as views."""
        return [chunk.narrow(0, p.piece.chunk_start, p.piece.numel) for p in self.pieces if p.slot is slot]

    def zero_pieces_of(self, slot: ParamSlot, chunk: torch.Tensor) -> None:
        for view in self.pieces_of(slot, chunk):
            view.zero_()

    def nan(self) -> torch.Tensor:
        """One NaN element of the parameters' dtype and device: placeholders and gradient guards expand it."""
        buffer = self.param_buffer.storage_tensor  # (dtype and device only)
        return placeholder((), buffer.dtype, buffer.device)

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
        module = self.module
        host = self.placements.optimizer.where.suffix if self.offloaded else ""
        names = {  # in the plan's order of roles
            Role.PARAMS: ("parameters", "communication", "all-gather") if gathering
            else ("parameters", "parameters", self.params.label),
            Role.SHARD: ("parameters", "parameters", "shard" + self.placements.shard.where.suffix),
            Role.SECONDARY: ("parameters", "parameters", "secondary copy (hpZ)"),
            Role.MASTER: ("optimizer_state", "optimizer_state", "master weights" + host),
            Role.GRADS: ("gradients", "gradients", "buckets"),
            Role.STAGING: ("gradients", "communication", "reduce-scatter"),  # exists only for the collective
            Role.GRAD_SHARD: ("gradients", "gradients", "shard" + host),
            Role.GRAD_CARRY: ("gradients", "gradients", "carried"),
            Role.MASTER_GRAD: ("gradients", "gradients", "master" + host),
        }
        for role, (kind, category, label) in names.items():
            if role in self.buffers:
                yield kind, MemoryItem(category, label, self.buffers[role].storage_tensor, module)
        if self.plan.has(Role.GRAD_SHARD) and Role.GRAD_SHARD not in self.buffers:  # a view of the gradient buffer
            yield "gradients", MemoryItem("gradients", "shard", self.grad_shard, module)
        for slot in self.slots:
            grad = slot.grad
            if grad is not None:  # stages 2-3: autograd's gradient, not yet staged; or a guard
                label = "placeholder" if grad is slot.grad_guard else "whole"
                yield "gradients", MemoryItem("gradients", label, grad, module)
            if slot.local_grad is not None:
                yield "gradients", MemoryItem("gradients", "whole", slot.local_grad, module)
        for placeholder_ in self.params.placeholders(self.slots):
            yield "parameters", MemoryItem("parameters", "placeholder", placeholder_, module)

    # ----- per-backward bookkeeping -----------------------------------------------------------------

    def start_round(self) -> None:
        self.num_ready = 0
        for slot in self.slots:
            slot.ready = False

    @property
    def is_ready(self) -> bool:
        return self.num_ready == len(self.slots)
