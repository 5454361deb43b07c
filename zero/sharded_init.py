"""``init_sharded``: build a model on ``meta`` and hold only its stage-3 shards (never the whole model)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zero.config import ZeroConfig
from zero.optimizer import ZeroOptimizer
from zero.runtime.materialize import InitFn


def init_sharded(
    build_fn: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer | Sequence[torch.optim.Optimizer]],
    *,
    init_fn: InitFn | None = None,
    config: ZeroConfig | None = None,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """Build a model without ever holding it whole: on ``meta``, then stage-3 shards only.

    ``build_fn()`` runs under ``torch.device("meta")``; ``make_optimizer(model)`` builds the optimizer (or a list) over
    its parameters; each rank then initializes its shards one module at a time with the model's own
    ``reset_parameters()`` and ``init_fn`` (see :mod:`zero.runtime.materialize` for when that equals building the
    model normally with the same seed; every rank must use the same seed). Returns ``(model, optimizer)``::

        model, opt = zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters()),
                                       init_fn=init_gpt_weights)
    """
    with torch.device("meta"):
        model = build_fn()
    overrides = {**overrides, "stage": 3}
    return model, ZeroOptimizer(make_optimizer(model), model, config=config, process_group=process_group,
                                init_fn=init_fn, device=device, **overrides)
