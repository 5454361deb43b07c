"""Wrappers that cannot be composed with ZeroOptimizer: ``DistributedDataParallel``.

Note: DDP all-reduces every gradient from hooks of its own and views them in buckets of its
own, while ZeroOptimizer reduces (and at stages 1-3 shards) the same gradients: together they
fail inside backward with torch's "more than one element of the written-to tensor refers to a
single memory location", or abort the process at stage 3. A DDP wrapper around the model, or
inside it, is refused when the optimizer is built; one built later around the model is found
on the model's first forward, from the call stack (DDP's ``forward`` calls the model), or at stage 3
when DDP's constructor reads a sharded parameter.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

_WRAPPED = (
    "DistributedDataParallel wraps {what}; ZeroOptimizer already reduces (and shards) the gradients that DDP "
    "would all-reduce, and the two fail together inside backward. Drop the DDP wrapper: pass the plain model to "
    "ZeroOptimizer and call it directly (stage=0 is plain data parallelism, DDP's equivalent)."
)


def check_not_ddp(model: nn.Module) -> None:
    """Refuse a model that is, or holds, a DDP wrapper."""
    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            raise ValueError(_WRAPPED.format(what=f"module {name!r} of the model" if name else "the model"))


def check_not_called_by_ddp(model: nn.Module) -> None:
    """Refuse a forward of ``model`` called by a DDP wrapper: look up the call stack of the forward pre-hook for
    DDP's ``forward`` (only that frame's locals are read: reading others' would keep their objects alive)."""
    caller = _ddp_on_stack(_DDP_FORWARD)
    if caller is not None and any(m is model for m in caller.module.modules()):
        raise ValueError(_WRAPPED.format(what="the model ZeroOptimizer manages (found at its first forward)"))


def refuse_if_ddp_is_building() -> None:
    """A stage-3 parameter was used outside its unit: if DDP's constructor did it, say that DDP is the problem."""
    if _ddp_on_stack(_DDP_INIT) is not None:
        raise ValueError(_WRAPPED.format(what="a model whose parameters a stage-3 ZeroOptimizer shards"))


def _ddp_on_stack(codes: frozenset) -> DistributedDataParallel | None:
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code in codes:
                caller = frame.f_locals.get("self")
                if isinstance(caller, DistributedDataParallel):
                    return caller
            frame = frame.f_back
        return None
    finally:
        del frame


_DDP_FORWARD = frozenset({DistributedDataParallel.forward.__code__, DistributedDataParallel._run_ddp_forward.__code__})
_DDP_INIT = frozenset({DistributedDataParallel.__init__.__code__})
