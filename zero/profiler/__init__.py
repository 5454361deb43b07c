"""Memory estimation (and, next, measurement) for ZeRO training."""

from zero.profiler.estimator import Estimate, Plan, Trace, estimate, model_states, parse_size, plan, trace

__all__ = ["Estimate", "Plan", "Trace", "estimate", "model_states", "parse_size", "plan", "trace"]
