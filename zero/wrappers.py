"""Wrappers that cannot be composed with ZeroOptimizer: ``DistributedDataParallel``.

Note: DDP all-reduces every gradient from hooks of its own and views them in buckets of its
own, while ZeroOptimizer reduces (and at stages 1-3 shards) the same gradients: together they
fail inside backward with torch's "more than one element of the written-to tensor refers to a
single memory location", or abort the process at stage 3. A DDP wrapper around the model, or
inside it, is refused when the optimizer is built; one built later around the model is found
on the model's first forward, from the call stack (DDP's ``forward`` calls the model).
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
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code in _DDP_FORWARD:
                caller = frame.f_locals.get("self")
                if isinstance(caller, DistributedDataParallel) and any(m is model for m in caller.module.modules()):
                    raise ValueError(_WRAPPED.format(what="the model ZeroOptimizer manages (found at its first forward)"))
            frame = frame.f_back
    finally:
        del frame


_DDP_FORWARD = frozenset({DistributedDataParallel.forward.__code__, DistributedDataParallel._run_ddp_forward.__code__})
