"""The wrapped ``torch.optim`` optimizer: which ones are exact on shards, and rebuilding one over them."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

# Update rules that act element by element: correct on any slice of a flattened parameter.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
)
# Rules that need whole tensors (factored or matrix statistics) or a closure over the whole model.
NON_ELEMENTWISE_OPTIMIZERS = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"ZeroOptimizer wraps a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    if name in NON_ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"{name} is not supported: ZeRO steps flat slices of parameters, which is exact only for "
            f"elementwise update rules. Use one of: {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        warnings.warn(
            f"{name} is not a known elementwise optimizer; ZeroOptimizer is exact only if its update of each "
            "element depends on that element alone (no per-tensor norms or shapes).",
            stacklevel=3,
        )
    stepped = any("step" not in s or float(s["step"]) > 0 for s in optimizer.state.values())
    if stepped:
        raise ValueError(
            f"the {name} optimizer has already stepped; wrap it in ZeroOptimizer before the first step "
            "(to resume training, load a ZeroOptimizer state_dict instead)"
        )


def rebuild_optimizer(optimizer: torch.optim.Optimizer, buckets) -> torch.optim.Optimizer:
    """A new optimizer of the same class whose groups hold this rank's pieces (same hyperparameters)."""
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        pieces = [p.tensor for b in buckets for p in b.pieces if p.slot.group_index == gi]
        groups.append({**hyper, "params": pieces})
    return same_kind(optimizer, groups)


def same_kind(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults (those its constructor takes) over ``params``."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return cls(params, **{k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted})
