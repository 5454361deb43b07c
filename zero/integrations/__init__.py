"""Where ``zero`` meets the tools users already train with: Hugging Face ``Trainer``
(:mod:`zero.integrations.transformers`) and ``Accelerate`` (:mod:`zero.integrations.accelerate`). DeepSpeed's JSON
configs are read by ``ZeroConfig.from_deepspeed`` with :mod:`zero.deepspeed` (below ``zero.config``);
:mod:`zero.integrations.deepspeed_config` re-exports its reader under the name it had here.

**What it may import.** The integrations sit above the whole library (they import ``zero.optimizer``,
``zero.config``, ``zero.checkpoint`` and their own library, which is not a dependency of ``zero``: each submodule
imports its library when it is imported). This ``__init__``, which holds what the Trainer and Accelerate submodules
share, imports nothing of ``zero`` and no integration's library, so importing one submodule runs no other's.

The Trainer and Accelerate integrations rest on the same three rules, the traps a ``ZeroOptimizer`` falls into
otherwise:

* **Never DistributedDataParallel.** ``ZeroOptimizer`` reduces the gradients itself; DDP on top would
  reduce them twice and undo stage 2's saving.
* **Clip through the optimizer.** At stages 1-3 no rank holds a whole gradient, so
  ``torch.nn.utils.clip_grad_norm_`` (what both libraries call) cannot see the global norm;
  ``opt.clip_grad_norm_`` computes it over every shard and returns it, for logging too.
* **Checkpoint with every rank.** Each rank owns a part of the state: saving is
  :func:`zero.save_checkpoint` on every rank, and the model exported for ``from_pretrained`` is
  consolidated from it (stage 3 never holds the whole model on a rank).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import ContextManager, Protocol

CHECKPOINT_DIR = "zero_checkpoint"  # the portable checkpoint inside a Trainer or Accelerate checkpoint folder


class _Accumulates(Protocol):
    """What ``WeakNoSync`` calls: a ``ZeroOptimizer`` (not imported here: see the module docstring)."""

    def no_sync(self) -> ContextManager[None]: ...


class WeakNoSync:
    """``opt.no_sync`` without keeping ``opt`` alive: set as the model's ``no_sync``, the method Accelerate calls on a
    DDP model to accumulate locally. Pickles as a no-op (``torch.save(model)`` keeps working)."""

    def __init__(self, opt: _Accumulates | None = None):
        self._ref = weakref.ref(opt) if opt is not None else None

    def __call__(self) -> ContextManager[None]:
        owner = self._ref() if self._ref is not None else None
        return owner.no_sync() if owner is not None else contextlib.nullcontext()

    def __reduce__(self):
        return (WeakNoSync, ())
