"""The host step: the threads torch computes with while the host steps the offloaded buckets (``offload.host_threads``,
:func:`host_step_threads`), set for the step and restored after it, in the thread that steps, so the rest of the
program keeps the thread count it chose (torchrun's ``OMP_NUM_THREADS=1``, for example); and the kernel it steps with
(:func:`warn_unfused_host_step`)."""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Iterator, Literal

import torch


def host_step_threads(setting: int | Literal["auto"], local_ranks: int) -> int:
    """The threads of the host step: ``setting`` if it is a number; with ``"auto"`` the cores in this process's CPU
    affinity, divided among ``local_ranks`` (the ranks on this machine) when the affinity is the whole machine (the
    ranks were not bound to cores of their own, so they share them)."""
    if setting != "auto":
        return setting
    try:
        owned = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        owned = os.cpu_count() or 1
    if owned >= (os.cpu_count() or owned):
        owned //= max(local_ranks, 1)
    return max(owned, 1)


def warn_unfused_host_step(optimizer: torch.optim.Optimizer) -> None:
    """The host step is memory-bound: torch's fused CPU Adam/AdamW kernel runs at the bandwidth limit,
    the foreach and single-tensor ones several times slower (``benchmarks/optimizer_step.py``)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not optimizer.defaults.get("fused"):
        kernel = "single-tensor" if optimizer.defaults.get("foreach") is False else "foreach"
        warnings.warn(
            f"offloaded {type(optimizer).__name__} steps on the host with its {kernel} kernel; build it with "
            f"fused=True for a host step at memory bandwidth (about 8x faster on CPU, "
            "see benchmarks/optimizer_step.py; its rounding differs from the foreach kernel's by about 1 ulp).",
            stacklevel=4,
        )


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
