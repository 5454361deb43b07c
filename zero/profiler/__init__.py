"""Memory: the tracker (``zero.profile``), its report, and the pre-flight estimator and planner."""

from zero.memory import CATEGORIES
from zero.profiler.estimator import Estimate, Plan, Trace, estimate, model_states, parse_size, plan, trace
from zero.profiler.tracker import MemoryTracker, Sample, profile
from zero.profiler.workload import Workload

__all__ = [
    "CATEGORIES", "Estimate", "MemoryTracker", "Plan", "Sample", "Trace", "estimate", "model_states", "parse_size",
    "plan", "profile", "trace", "Workload",
]
