"""One contiguous 1D buffer that hands out views; the only place storage is freed.

Note: freeing uses ``untyped_storage().resize_(0)`` rather than dropping the tensor.
Views handed out earlier (parameter ``.data``, gradient views, optimizer pieces)
keep pointing at the same storage object, so they become valid again, without
being re-created, as soon as ``allocate()`` resizes the storage back. Autograd's
saved references to such views stay valid for the same reason (FSDP2 relies on it).

Pinned host buffers (CPU offload with a GPU) keep their bytes: page-locking is slow to set up and
limited, so ``free()`` only marks them unallocated (``is_allocated``), and ``allocate()`` takes them back.
"""

from __future__ import annotations

import torch

from zero.offload import host_buffer


class FlatBuffer:
    """A 1D tensor of ``numel`` elements whose storage can be released and restored."""

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, allocate: bool = True, pin: bool = False
    ):
        self.numel = numel
        self.dtype = dtype
        self.pinned = pin
        if pin:  # page-locked host memory (for asynchronous copies to a GPU): its bytes are kept
            self.data = host_buffer(numel, dtype, pin=True)
            self._live = allocate
            return
        self.data = torch.empty(numel, dtype=dtype, device=device)  # 1D
        if allocate:
            self.data.zero_()
        else:  # large host allocations are mapped lazily, so the empty() above touched no memory
            self.free()

    @property
    def nbytes(self) -> int:
        return self.numel * self.data.element_size()

    @property
    def is_allocated(self) -> bool:
        if self.pinned:
            return self._live
        return self.data.untyped_storage().size() > 0

    def allocate(self, zero: bool = True) -> None:
        """Give the storage back its bytes (a no-op when already allocated)."""
        if not self.is_allocated:
            if self.pinned:
                self._live = True
            else:
                self.data.untyped_storage().resize_(self.nbytes)
            if zero:
                self.data.zero_()

    def free(self) -> None:
        """Release the storage's bytes (pinned: mark them unused); views stay attached to the storage."""
        if self.pinned:
            self._live = False
            return
        self.data.untyped_storage().resize_(0)

    def disown(self) -> None:
        """Leave the current storage, and every view of it, to whoever still holds them, and start
        over with a new, unallocated storage (views must be made again)."""
        self.data = torch.empty(self.numel, dtype=self.dtype, device=self.data.device)
        self.free()

    def view(self, start: int, numel: int, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
        """A view of ``numel`` elements from ``start``, optionally reshaped (create views while allocated;
        they stay attached across ``free()`` / ``allocate()``)."""
        assert 0 <= start and start + numel <= self.numel, (start, numel, self.numel)
        flat = self.data.narrow(0, start, numel)
        return flat if shape is None else flat.view(shape)
