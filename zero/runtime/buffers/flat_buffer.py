"""One contiguous 1D buffer that hands out views, with an explicit state; the only place storage is freed.

A buffer is ``RELEASED`` (no bytes), ``ALLOCATED`` (its bytes are there and may be read), or ``IN_FLIGHT``
(a collective is writing or reading it: the gradient reduction of a staging buffer, stage 3's all-gather
into the full parameters). Every transition is checked, and reading a released buffer's ``data`` raises
instead of returning stale or freed memory:

    RELEASED --allocate()--> ALLOCATED --start_collective()--> IN_FLIGHT --end_collective()--> ALLOCATED
    ALLOCATED --free()--> RELEASED

Note: freeing uses ``untyped_storage().resize_(0)`` rather than dropping the tensor.
Views handed out earlier (parameter ``.data``, gradient views, optimizer pieces)
keep pointing at the same storage object, so they become valid again, without
being re-created, as soon as ``allocate()`` resizes the storage back. Autograd's
saved references to such views stay valid for the same reason (FSDP2 relies on it).
The placement (``zero.runtime.buffers.placement``) does the resizing: pinned host buffers keep their bytes.
"""

from __future__ import annotations

from enum import Enum

import torch

from zero.runtime.buffers.placement import DevicePlacement, Placement


class BufferState(Enum):
    RELEASED = "released"
    ALLOCATED = "allocated"
    IN_FLIGHT = "in flight"


class FlatBuffer:
    """A 1D tensor of ``numel`` elements whose storage can be released and restored (see the module docstring)."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        placement: Placement | torch.device,
        *,
        allocate: bool = True,
        name: str = "buffer",
    ):
        self.numel = numel
        self.dtype = dtype
        self.name = name
        self.placement = placement if isinstance(placement, Placement) else DevicePlacement(placement)
        self._tensor = self.placement.new(numel, dtype, allocate=allocate)
        self.state = BufferState.ALLOCATED if allocate else BufferState.RELEASED

    def __repr__(self) -> str:
        return f"FlatBuffer({self.name}, {self.numel} x {self.dtype}, {self.placement.where.value}, {self.state.value})"

    @property
    def data(self) -> torch.Tensor:
        """The whole buffer (1D); only while allocated or in flight."""
        if self.state is BufferState.RELEASED:
            raise RuntimeError(f"zero internal error: {self.name} was read while released")
        return self._tensor

    @property
    def storage_tensor(self) -> torch.Tensor:
        """The tensor whatever the state, for identity and byte counting only (never read its values)."""
        return self._tensor

    @property
    def nbytes(self) -> int:
        return self.numel * self._tensor.element_size()

    @property
    def pinned(self) -> bool:
        return self._tensor.is_pinned()

    @property
    def is_allocated(self) -> bool:
        return self.state is not BufferState.RELEASED

    def _expect(self, *states: BufferState, to: str) -> None:
        assert self.state in states, f"{self.name}: cannot {to} from {self.state.value}"

    def allocate(self, zero: bool = True) -> None:
        """RELEASED -> ALLOCATED: give the storage back its bytes (zeroed with ``zero``)."""
        self._expect(BufferState.RELEASED, to="allocate")
        self.placement.restore(self._tensor)
        self.state = BufferState.ALLOCATED
        if zero:
            self._tensor.zero_()

    def ensure_allocated(self, zero: bool = True) -> None:
        """:meth:`allocate` unless allocated already (then nothing changes)."""
        if self.state is BufferState.RELEASED:
            self.allocate(zero)

    def start_collective(self) -> None:
        """ALLOCATED -> IN_FLIGHT: a collective writes or reads it until :meth:`end_collective`."""
        self._expect(BufferState.ALLOCATED, to="start a collective")
        self.state = BufferState.IN_FLIGHT

    def end_collective(self) -> None:
        """IN_FLIGHT -> ALLOCATED: the collective has completed."""
        self._expect(BufferState.IN_FLIGHT, to="end a collective")
        self.state = BufferState.ALLOCATED

    def free(self) -> None:
        """ALLOCATED -> RELEASED (a no-op when released): release the storage's bytes; views stay attached."""
        self._expect(BufferState.ALLOCATED, BufferState.RELEASED, to="free")
        if self.state is BufferState.ALLOCATED:
            self.placement.release(self._tensor)
            self.state = BufferState.RELEASED

    def abandon(self) -> None:
        """Any state -> RELEASED, for a buffer whose owner was dropped mid-use (a stage-3 unit still gathered, or
        its gather never waited on, when its optimizer was garbage-collected)."""
        if self.state is not BufferState.RELEASED:
            self.placement.release(self._tensor)
            self.state = BufferState.RELEASED

    def prefetch(self) -> None:
        """Start bringing the values into memory ahead of their use (a disk placement reads them ahead)."""
        if self.state is not BufferState.RELEASED:
            self.placement.prefetch(self._tensor)

    def evict(self) -> None:
        """The values are not needed in memory for a while (a disk placement writes them back and unmaps them)."""
        if self.state is not BufferState.RELEASED:
            self.placement.evict(self._tensor)

    def disown(self) -> None:
        """Leave the current storage, and every view of it, to whoever still holds them, and start
        over with a new, released storage (views must be made again)."""
        self._expect(BufferState.ALLOCATED, to="disown")
        self._tensor = self.placement.new(self.numel, self.dtype, allocate=False)
        self.state = BufferState.RELEASED

    def view(self, start: int, numel: int, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
        """A view of ``numel`` elements from ``start``, optionally reshaped (create views while allocated;
        they stay attached across ``free()`` / ``allocate()``)."""
        assert 0 <= start and start + numel <= self.numel, (start, numel, self.numel)
        flat = self.data.narrow(0, start, numel)
        return flat if shape is None else flat.view(shape)
