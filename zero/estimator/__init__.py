"""Predicting memory before a run: the estimator and planner price the optimizer's own buckets, units and
schedule on fake tensors (nothing is allocated).

Measuring memory during a run is :mod:`zero.profiler`'s."""

from zero.estimator.estimator import Estimate, Plan, Trace, estimate, model_states, parse_size, plan, trace
from zero.estimator.pipeline import Pipeline
from zero.estimator.traffic import Collective, Traffic
from zero.estimator.workload import Workload

__all__ = ["Collective", "Estimate", "Pipeline", "Plan", "Trace", "Traffic", "Workload", "estimate", "model_states",
           "parse_size", "plan", "trace"]
