"""The wrapped ``torch.optim`` optimizers: which step path each takes, and rebuilding each over this rank's share.

Two step paths, chosen per optimizer, never silently:

* *flat*, for update rules that act element by element (torch's SGD, Adam, AdamW, ... listed in
  :data:`ELEMENTWISE_OPTIMIZERS`, and third-party classes the user declares in
  ``ZeroConfig.elementwise_optimizers``): rebuilt over 1D pieces of this rank's flat master chunk and stepped bucket
  by bucket (``zero.runtime.step.stepper``), exact because no element's update reads another element;
* *whole*, for every other optimizer (Muon, Adafactor, LAMB, Shampoo, SOAP, any class zero does not know, a subclass
  of torch's own): rebuilt over stand-ins of the whole parameters this rank owns (``zero.runtime.buffers.owners``)
  and stepped once per step on whole tensors (``zero.runtime.step.owner_step``), so that it sees exactly the shapes,
  gradients and state single-process training gives it.

A whole optimizer whose update of a parameter reads that parameter alone (:data:`PER_PARAMETER_OPTIMIZERS`, and
classes declared in ``ZeroConfig.per_parameter_optimizers``) has an owner per parameter, balanced over the ranks.
Any other one may read several of its parameters in one step (a global gradient norm: ``Lamb(pre_norm=True)``,
Adan, D-Adaptation), so all its parameters have one owner, which steps the optimizer exactly as one process would.

LBFGS (a closure that re-evaluates the whole model) and SparseAdam (sparse gradients) cannot be stepped per
parameter and are refused by name. Several optimizers over one model (``ZeroOptimizer([muon, adamw], model)``) are
one list of parameter groups, numbered in order (each optimizer's groups a range of it): the buckets, checkpoints and
``ZeroOptimizer.param_groups`` use those numbers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zero.runtime.guards.ownership import managed_elsewhere

# Update rules that act element by element: correct on any slice of a flattened parameter.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
)
# Whole-parameter rules known to update each parameter from that parameter alone: an owner per parameter. By root
# package and class name (torch.optim.Muon lives in torch.optim._muon).
PER_PARAMETER_OPTIMIZERS = ("torch.Muon", "torch.Adafactor", "pytorch_optimizer.Lamb", "pytorch_optimizer.SOAP")
# Their settings that read all parameters at once (then one owner, as for an unknown rule).
COUPLING_SETTINGS = {"pytorch_optimizer.Lamb": "pre_norm"}
# Rules that cannot be stepped one parameter at a time, and why.
REFUSED = {
    "LBFGS": "its step re-evaluates the whole model through a closure and keeps one history over all parameters",
    "SparseAdam": "it steps sparse gradients, and ZeRO reduces dense flat buckets",
}


@dataclass
class Inner:
    """One wrapped optimizer, rebuilt over this rank's share of its parameters."""

    optimizer: torch.optim.Optimizer  # the rebuilt one: over pieces (flat) or over stand-ins of owned parameters
    whole: bool  # stepped on whole parameters by their owners
    groups: range  # its parameter groups' numbers among every wrapped optimizer's groups


class ParamGroups:
    """The parameter groups of every wrapped optimizer, in order (the original dicts: what the partition reads)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        starts = [0]
        for optimizer in optimizers:
            starts.append(starts[-1] + len(optimizer.param_groups))
        self.ranges = [range(a, b) for a, b in zip(starts, starts[1:])]


def as_list(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers ``ZeroOptimizer`` was given: one, or a list or tuple of them."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("ZeroOptimizer got an empty list of optimizers; pass at least one torch.optim optimizer")
    return optimizers


def is_elementwise(optimizer: torch.optim.Optimizer, declared: Sequence[str]) -> bool:
    """Whether the optimizer takes the flat path: a class of :data:`ELEMENTWISE_OPTIMIZERS` itself (a subclass may
    change the rule), or one ``declared`` elementwise by class name or qualified name."""
    cls = type(optimizer)
    return cls in ELEMENTWISE_OPTIMIZERS or any(name in declared for name in (cls.__name__, _qualified(cls)))


def is_per_parameter(optimizer: torch.optim.Optimizer, declared: Sequence[str]) -> bool:
    """Whether a whole-path optimizer updates each parameter from that parameter alone (an owner per parameter), or
    may read several at once (one owner for all its parameters)."""
    cls = type(optimizer)
    known = f"{cls.__module__.split('.')[0]}.{cls.__name__}"
    setting = COUPLING_SETTINGS.get(known)
    if setting is not None and getattr(optimizer, setting, False):
        return False
    return known in PER_PARAMETER_OPTIMIZERS or any(n in declared for n in (cls.__name__, _qualified(cls)))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module) -> None:
    """Each is a torch optimizer that can be stepped per parameter and has not stepped, no parameter is in two, and,
    with several, every trainable parameter of ``model`` is in one (unless another ``ZeroOptimizer`` manages it)."""
    names = {p: name for name, p in model.named_parameters()}
    seen: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"ZeroOptimizer wraps torch.optim.Optimizer instances, got {type(optimizer).__name__}")
        name = type(optimizer).__name__
        if name in REFUSED:
            raise ValueError(
                f"{name} is not supported: {REFUSED[name]}. Use a first-order optimizer (AdamW, Muon, Adafactor, ...)."
            )
        if any("step" not in s or float(s["step"]) > 0 for s in optimizer.state.values()):
            raise ValueError(
                f"the {name} optimizer has already stepped; wrap it in ZeroOptimizer before the first step "
                "(to resume training, load a ZeroOptimizer state_dict instead)"
            )
        for group in optimizer.param_groups:
            for p in group["params"]:
                if seen.setdefault(id(p), i) != i:
                    raise ValueError(
                        f"parameter {names.get(p, tuple(p.shape))!r} is in two of the optimizers given to "
                        f"ZeroOptimizer (#{seen[id(p)]} and #{i}); give each parameter to exactly one"
                    )
    missing = [name for p, name in names.items() if p.requires_grad and id(p) not in seen and not managed_elsewhere(p)]
    if len(optimizers) > 1 and missing:
        raise ValueError(
            f"the trainable parameter(s) {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''} are "
            f"in none of the {len(optimizers)} optimizers given to ZeroOptimizer, so nothing would train them; give "
            "each to one of them, or freeze it (p.requires_grad_(False))"
        )


def rebuild_flat(optimizer: torch.optim.Optimizer, groups: range, buckets) -> Inner:
    """``optimizer`` rebuilt over this rank's pieces of its parameters (same groups and hyperparameters)."""
    rebuilt = []
    for gi, group in zip(groups, optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        rebuilt.append({**hyper, "params": [p.tensor for b in buckets for p in b.pieces if p.slot.group_index == gi]})
    return Inner(same_kind(optimizer, rebuilt), False, groups)


def rebuild_whole(optimizer: torch.optim.Optimizer, groups: range, owned: list) -> Inner:
    """``optimizer`` rebuilt over the stand-ins of the parameters this rank owns (``owned``: ``(slot, stand-in)``),
    in the order of its groups (a rule summing over its parameters sums in the same order); same groups and
    hyperparameters, a group may be empty here."""
    stand_ins = {id(slot.param): stand_in for slot, stand_in in owned}
    rebuilt = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        rebuilt.append({**hyper, "params": [stand_ins[id(p)] for p in group["params"] if id(p) in stand_ins]})
    return Inner(same_kind(optimizer, rebuilt), True, groups)


def same_kind(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and defaults (those its constructor takes) over ``params``, and the
    constructor's other arguments the optimizer kept as attributes of the same name (``Lamb(pre_norm=True)`` keeps
    ``self.pre_norm``, not ``defaults["pre_norm"]``: without them the rebuilt one would step another rule)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    kept = vars(optimizer)
    for name, p in list(accepted.items())[2:]:  # (after self and params)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in kwargs and name in kept:
            kwargs[name] = kept[name]
    return cls(params, **kwargs)
