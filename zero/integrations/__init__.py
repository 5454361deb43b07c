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
from typing import Callable, ContextManager

from zero.optimizer import ZeroOptimizer

CHECKPOINT_DIR = "zero_checkpoint"  # the portable checkpoint inside a Trainer or Accelerate checkpoint folder


def weak_no_sync(opt: ZeroOptimizer) -> Callable[[], ContextManager[None]]:
    """``opt.no_sync`` as a function that does not keep ``opt`` alive (set as the model's ``no_sync``, the method
    Accelerate calls on a DDP model to accumulate locally)."""
    ref = weakref.ref(opt)

    def no_sync() -> ContextManager[None]:
        owner = ref()
        return owner.no_sync() if owner is not None else contextlib.nullcontext()

    return no_sync
