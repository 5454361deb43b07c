"""``Bucket``: one layout bound to its parameters, flat buffers and local optimizer pieces.

A bucket owns (sizes in elements; ``P`` = padded bucket size, ``C = P / num_shards``):

* ``params``      the model parameters packed in it; their ``.data`` are views of ``param_buffer``
* ``param_buffer`` FlatBuffer(P): the full parameters (stages 0-2 keep them whole; stage 3 only
                   while its unit is gathered)
* ``shard_buffer`` FlatBuffer(C), stage 3 only: this rank's persistent chunk of the parameters
* ``grad_buffer`` FlatBuffer(P): full-size gradients; persistent or transient, as the stage decides
* ``grad_shard``  (C,) this rank's reduced, averaged gradient chunk
* ``grad_carry``  FlatBuffer(C), stage 1 only: reduced gradients set aside while another backward
                   pass adds to them before ``step()`` (allocated only then)
* ``shard``       (C,) this rank's chunk of the parameters, which the inner optimizer updates
* ``pieces``      1D views of ``shard``, one per parameter overlapping the chunk; these are
                   the tensors the wrapped ``torch.optim`` optimizer sees

A *frozen* bucket (stage 3: parameters with ``requires_grad=False``, sharded and gathered
with their unit like the others) has no gradient buffers and no pieces.

Per backward pass it also tracks which parameters have handed in their gradient.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from zero.flat_buffer import FlatBuffer
from zero.layout import BucketLayout, ParamSpan, Piece
from zero.memory import MemoryItem
from zero.sharded_param import cast_after_wrapping


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
    used_here: bool = False  # got a gradient on this rank since the last zero_grad(set_to_none=True)
    used_anywhere: bool = False  # ... on any rank, as of the last reduction (p.grad defined in PyTorch terms)
    ready: bool = False  # handed in its gradient in the current backward pass

    @property
    def bucket(self) -> "Bucket":
        return self.bucket_ref()

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
    """Runtime state of one :class:`~zero.layout.BucketLayout` on one rank."""

    def __init__(
        self, layout: BucketLayout, shard_index: int, dtype: torch.dtype, device: torch.device, trainable: bool = True
    ):
        self.layout = layout
        self.index = layout.index
        self.shard_index = shard_index
        self.trainable = trainable
        self.slots: list[ParamSlot] = []
        self.unit = None  # stage 3: the UnitSpec whose forward gathers this bucket
        self.param_buffer = FlatBuffer(layout.padded_numel, dtype, device, allocate=False)  # the stage fills it
        self.shard_buffer: FlatBuffer | None = None  # stage 3
        self.grad_buffer: FlatBuffer | None = None  # set by the stage
        self.grad_shard: torch.Tensor | None = None  # set by the stage
        self.grad_shard_buffer: FlatBuffer | None = None  # set by stages that own grad_shard separately
        self.grad_carry: FlatBuffer | None = None  # stage 1
        self.pieces: list[LocalPiece] = []
        self.num_ready = 0

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
            slot.view = self.param_buffer.view(slot.span.offset, slot.span.numel, slot.param.shape)
        if released:
            self.param_buffer.free()

    def adopt_whole(self) -> None:
        """Copy every parameter into ``param_buffer`` and make its ``.data`` a view of it (stages 0-2)."""
        self.param_buffer.allocate()
        self.make_views()
        with torch.no_grad():
            for slot in self.slots:
                slot.view.copy_(slot.param.data)
                slot.param.data = slot.view

    def build_pieces(self) -> None:
        """Create the inner optimizer's tensors: views of this rank's chunk (none in a frozen bucket)."""
        if not self.trainable:
            return
        slot_of = {slot.span.param_index: slot for slot in self.slots}
        shard = self.shard
        self.pieces = [
            LocalPiece(slot_of[p.param_index], p, shard.narrow(0, p.chunk_start, p.numel))
            for p in self.layout.pieces(self.shard_index)
        ]

    def copy_to_shard(self, slot: ParamSlot, whole: torch.Tensor) -> None:
        """Copy the pieces of ``whole`` (the slot's full value) that fall in this rank's chunk into ``shard``."""
        flat = whole.detach().reshape(-1)  # 1D
        with torch.no_grad():
            for piece in self.layout.pieces(self.shard_index):
                if piece.param_index == slot.span.param_index:
                    self.shard.narrow(0, piece.chunk_start, piece.numel).copy_(
                        flat.narrow(0, piece.param_start, piece.numel)
                    )

    # ----- views ----------------------------------------------------------------------------------

    def chunk_of(self, buffer: FlatBuffer) -> torch.Tensor:
        """This rank's chunk of a full-size buffer (1D view)."""
        start, end = self.layout.chunk_range(self.shard_index)
        return buffer.view(start, end - start)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk of the parameters (1D), which the optimizer updates: at stages 0-2 a view
        of ``param_buffer`` (the step writes the parameters directly), at stage 3 ``shard_buffer``."""
        if self.shard_buffer is not None:
            return self.shard_buffer.data
        return self.chunk_of(self.param_buffer)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The slot's gradient inside ``grad_buffer``, shaped like the parameter."""
        assert self.grad_buffer is not None
        return self.grad_buffer.view(slot.span.offset, slot.span.numel, slot.param.shape)

    def grad_piece(self, piece: LocalPiece) -> torch.Tensor:
        """The reduced gradient for one local piece (1D view of ``grad_shard``)."""
        assert self.grad_shard is not None
        return self.grad_shard.narrow(0, piece.piece.chunk_start, piece.piece.numel)

    def zero_pieces_of(self, slot: ParamSlot, chunk: torch.Tensor) -> None:
        """Zero the slot's elements in ``chunk`` (1D, one chunk long: ``grad_shard``, ``grad_carry``)."""
        for piece in self.pieces:
            if piece.slot is slot:
                chunk.narrow(0, piece.piece.chunk_start, piece.piece.numel).zero_()

    def check_attached(self, whole: bool) -> None:
        """Raise if a parameter changed dtype or device after wrapping (``model.to()``); with ``whole``
        (its values are in ``param_buffer``), also if its ``.data`` no longer views the buffer."""
        buffer = self.param_buffer.data
        for slot in self.slots:
            p = slot.param
            if (p.dtype, p.device) != (buffer.dtype, buffer.device) or (whole and p.data_ptr() != slot.view.data_ptr()):
                raise ValueError(cast_after_wrapping(slot.name))

    # ----- memory ----------------------------------------------------------------------------------

    def named_memory(self, gathering: bool) -> Iterator[MemoryItem]:
        """Every tensor this bucket owns, named for the memory profiler (``gathering``: stage 3's
        all-gather into ``param_buffer`` is in flight, e.g. a prefetch)."""
        module = self.unit.name if self.unit is not None else ""
        if gathering:
            yield MemoryItem("communication", "all-gather", self.param_buffer.data, module)
        else:
            yield MemoryItem("parameters", "whole" if self.shard_buffer is None else "gathered", self.param_buffer.data, module)
        if self.shard_buffer is not None:
            yield MemoryItem("parameters", "shard", self.shard_buffer.data, module)
        if self.grad_buffer is not None:
            if self.grad_shard_buffer is None:  # stages 0-1: whole gradients live in it
                yield MemoryItem("gradients", "buckets", self.grad_buffer.data, module)
            else:  # stages 2-3: a staging buffer that exists only for the reduce-scatter
                yield MemoryItem("communication", "reduce-scatter", self.grad_buffer.data, module)
        if self.grad_shard_buffer is not None:
            yield MemoryItem("gradients", "shard", self.grad_shard_buffer.data, module)
        if self.grad_carry is not None:
            yield MemoryItem("gradients", "carried", self.grad_carry.data, module)
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None:  # stages 2-3: autograd's gradient, not yet staged; or a guard
                yield MemoryItem("gradients", "placeholder" if grad is slot.grad_guard else "whole", grad, module)
            if slot.local_grad is not None:
                yield MemoryItem("gradients", "whole", slot.local_grad, module)
            if slot.placeholder is not None:
                yield MemoryItem("parameters", "placeholder", slot.placeholder, module)

    # ----- per-backward bookkeeping -----------------------------------------------------------------

    def start_round(self) -> None:
        self.num_ready = 0
        for slot in self.slots:
            slot.ready = False

    @property
    def is_ready(self) -> bool:
        return self.num_ready == len(self.slots)
