"""What a memory tracker records, as the report reads it: the :class:`Sample` (live bytes at one point of
the run) and :class:`Recording`, the finished run's figures.

The tracker (:mod:`zero.profiler.tracker`) writes them; the report (:mod:`zero.profiler.report`) reads them.
Both import this module and the report never imports the tracker, so the dependency goes one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zero.profiler.allocator import Allocator


@dataclass
class Sample:
    """Live bytes at one point of the run."""

    index: int
    time: float  # seconds since the tracker started
    step: int  # optimizer steps completed before this sample
    phase: str
    module: str  # the module running ("" outside any)
    event: str  # what triggered the sample
    categories: dict[str, int]
    labels: dict[str, int]  # "category/label" -> bytes
    modules: dict[str, int]  # module -> bytes of storages it created or serves ("" : the whole model)
    allocated: int = 0  # the allocator's figure
    entry_alive: int = 0  # bytes of storages alive on entry that are still alive (CPU reconciliation)
    created_ptrs: frozenset[int] = frozenset()  # addresses of the temporaries (CPU reconciliation)
    module_categories: dict[tuple[str, str], int] = field(default_factory=dict)  # (module, category) -> bytes

    @property
    def total(self) -> int:
        return sum(self.categories.values())

    @property
    def unexplained(self) -> int:
        return self.allocated - self.total


class Recording(Protocol):
    """What the report reads from a finished run (a :class:`~zero.profiler.tracker.MemoryTracker` is one)."""

    samples: list[Sample]
    device: torch.device
    allocator: Allocator  # its name, its peak and the peak without the collectives' own buffers
    run: dict[str, Any]  # what the plot's title names: model, params, stage, world_size, rank

    @property
    def steps(self) -> int:
        """Optimizer steps taken while recording."""
        ...
