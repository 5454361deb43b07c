"""Measuring memory: the tracker (``zero.profile``) and its report (table, JSON, plot).

Predicting memory before a run is :mod:`zero.estimator`'s."""

from zero.memory import CATEGORIES
from zero.profiler.tracker import MemoryTracker, Sample, profile

__all__ = ["CATEGORIES", "MemoryTracker", "Sample", "profile"]
