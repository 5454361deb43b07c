"""Measuring memory: the tracker (``zero.profile``) and its report (table, JSON, plot).

Predicting memory before a run is :mod:`zero.estimator`'s."""

from zero.memory import CATEGORIES
from zero.profiler.sample import Sample
from zero.profiler.tracker import MemoryTracker, profile

__all__ = ["CATEGORIES", "MemoryTracker", "Sample", "profile"]
