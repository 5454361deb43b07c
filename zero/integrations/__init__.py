"""Training with ``zero`` where users already train: Hugging Face ``Trainer`` (:mod:`zero.integrations.transformers`)
and ``Accelerate`` (:mod:`zero.integrations.accelerate`).

Neither library is a dependency of ``zero``: each submodule imports its library when it is imported.
Both integrations rest on the same three rules, the traps a ``ZeroOptimizer`` falls into otherwise:

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
from typing import ContextManager

from zero.optimizer import ZeroOptimizer

CHECKPOINT_DIR = "zero_checkpoint"  # the portable checkpoint inside a Trainer or Accelerate checkpoint folder


class WeakNoSync:
    """``opt.no_sync`` without keeping ``opt`` alive: set as the model's ``no_sync``, the method Accelerate calls on a
    DDP model to accumulate locally. Pickles as a no-op (``torch.save(model)`` keeps working)."""

    def __init__(self, opt: ZeroOptimizer | None = None):
        self._ref = weakref.ref(opt) if opt is not None else None

    def __call__(self) -> ContextManager[None]:
        owner = self._ref() if self._ref is not None else None
        return owner.no_sync() if owner is not None else contextlib.nullcontext()

    def __reduce__(self):
        return (WeakNoSync, ())
