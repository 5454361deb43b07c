"""The planner's choice of partial offload (``offload.ratio``): the smallest share of the optimizer side offloaded to
host memory whose peak fits, among the ratios at which one more bucket goes to the host."""

from __future__ import annotations

import math
from typing import Any, Callable

from zero.estimator.schedule import Layout


def least_offload(priced: Callable[[float], Any], boundaries: list[float], full: Any, budget: float) -> Any:
    """The CPU-offload estimate (a :class:`zero.estimator.Estimate`, as ``priced(ratio)`` makes it) with the smallest
    ``offload_ratio`` (the most of the optimizer side left on the device, stepping there) whose peak fits ``budget``;
    ``full`` (ratio 1) fits. The ratios tried are ``boundaries`` (offload moves whole buckets:
    :func:`offload_boundaries`), by bisection: the peak falls as the ratio grows."""
    low, high, best = 0, len(boundaries) - 1, full
    while low <= high:
        middle = (low + high) // 2
        e = priced(boundaries[middle])
        if e.peak <= budget:
            best, high = e, middle - 1
        else:
            low = middle + 1
    return best


def offload_boundaries(layout: Layout) -> list[float]:
    """The ``offload.ratio`` values at which one more bucket goes to the host (``Placements.for_buckets``: the first
    buckets, as long as they hold at most the ratio of the elements), from 0 (none) to 1 (all), each the smallest
    ratio that offloads its buckets (rounded up at 1e-12)."""
    sizes = [b.wire.padded for b in layout.buckets]
    total, held, out = sum(sizes), 0, [0.0]
    for size in sizes:
        held += size
        out.append(min(1.0, math.ceil(held / total * 1e12) / 1e12))
    return sorted(set(out))
