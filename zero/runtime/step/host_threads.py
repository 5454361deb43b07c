"""The threads torch computes with while the host steps the offloaded buckets (``offload.host_threads``,
``zero.offload.host_step_threads``): set for the step and restored after it, in the thread that steps, so the rest
of the program keeps the thread count it chose (torchrun's ``OMP_NUM_THREADS=1``, for example)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class HostThreads:
    """``scope()``: torch's intra-op thread count is ``count`` inside it (``None``: left alone, nothing is stepped on
    the host)."""

    def __init__(self, count: int | None):
        self.count = count

    @contextmanager
    def scope(self) -> Iterator[None]:
        before = torch.get_num_threads()
        if self.count is None or self.count == before:
            yield
            return
        torch.set_num_threads(self.count)
        try:
            yield
        finally:
            torch.set_num_threads(before)
