"""``ZeroOptimizer`` in an ``accelerate.Accelerator`` script.

::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, opt, train_dl = zero.integrations.accelerate.prepare(
        accelerator, model, torch.optim.AdamW(model.parameters(), lr=3e-4), train_dl, stage=2)
    scheduler = accelerator.prepare(get_scheduler("cosine", opt, ...))   # built on the optimizer returned
    for batch in train_dl:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                norm = opt.clip_grad_norm_(1.0)       # not accelerator.clip_grad_norm_
            opt.step()                                # skipped on accumulation micro-batches
            scheduler.step()
            opt.zero_grad()
    accelerator.save_state("ckpt")                    # every rank; zero's part in ckpt/zero_checkpoint

:func:`prepare` wraps the optimizer in ``ZeroOptimizer`` (keyword arguments are ``zero.ZeroConfig``
fields), places the model on ``accelerator.device`` without DDP, gives the model a ``no_sync`` so
that ``accelerator.accumulate`` accumulates locally (no communication until the last micro-batch),
returns the optimizer wrapped as Accelerate wraps optimizers (``step()`` and ``zero_grad()`` act only
when ``accelerator.sync_gradients``; ``ZeroOptimizer``'s own methods pass through), prepares the other
objects (data loaders, schedulers) with ``accelerator.prepare``, and registers ``save_state``/``load_state``
hooks that save and load the
model and optimizer with :func:`zero.save_checkpoint` and :func:`zero.load_checkpoint` in
``OUTPUT_DIR/zero_checkpoint``. The model is never passed to ``accelerator.prepare``: Accelerate
would wrap it in DDP, and its ``save_state`` would gather a stage-3 model's ``state_dict`` on rank 0.

Refused, with the fix named: Accelerate's own mixed precision (use ``precision=`` here), and a
scheduler built on the plain optimizer (its learning rates would never reach the sharded one).
Works under ``accelerate launch`` and ``torchrun`` alike.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from zero.checkpoint.portable import load_checkpoint, save_checkpoint
from zero.integrations import CHECKPOINT_DIR, WeakNoSync
from zero.optimizer import ZeroOptimizer


def prepare(accelerator: Accelerator, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], *others: Any, **zero_config: Any) -> tuple:
    """Return ``(model, optimizer, *others)`` ready for ``accelerator``'s training loop (see the module docstring).
    ``optimizer`` is a plain ``torch.optim`` optimizer over ``model``'s parameters, a list of them (Muon + AdamW: one
    ``ZeroOptimizer`` steps both), or a ``ZeroOptimizer``."""
    plain = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) autocasts around a model that ZeroOptimizer "
            "already manages; use Accelerator() and pass precision={'param_dtype': 'bf16'} to prepare() instead"
        )
    for other in others:
        if any(getattr(other, "optimizer", None) is o for o in plain) and not isinstance(optimizer, ZeroOptimizer):
            raise ValueError(
                f"the {type(other).__name__} was built on the plain optimizer, which ZeroOptimizer replaces: its "
                "learning rates would never reach the sharded one. Build it on the optimizer prepare() returns, "
                "then pass it to accelerator.prepare()"
            )
    model.to(accelerator.device)
    opt = optimizer if isinstance(optimizer, ZeroOptimizer) else ZeroOptimizer(optimizer, model, **zero_config)
    if opt.module is not model:
        raise ValueError("the ZeroOptimizer passed to prepare() wraps another model")
    if accelerator.num_processes != opt.comm.data_parallel_size:
        raise ValueError(
            f"Accelerate sees {accelerator.num_processes} process(es) but the ZeroOptimizer's process group has "
            f"{opt.comm.data_parallel_size} ranks, so Accelerate would neither split the data nor keep to the main "
            "process where it should. On CPU under torchrun, build Accelerator(cpu=True) (or set "
            "ACCELERATE_USE_CPU=1), so that Accelerate joins the process group"
        )
    model.no_sync = WeakNoSync(opt)  # what accelerator.no_sync()/accumulate() call on a DDP model
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: save_checkpoint(
        os.path.join(output_dir, CHECKPOINT_DIR), model, opt, progress=accelerator.is_main_process))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: load_checkpoint(
        os.path.join(input_dir, CHECKPOINT_DIR), model, opt, progress=accelerator.is_main_process))
    prepared = accelerator.prepare(*others) if others else ()
    prepared = prepared if isinstance(prepared, tuple) else (prepared,)
    return (model, AcceleratedZeroOptimizer(opt, device_placement=False), *prepared)


class AcceleratedZeroOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper (``step()``/``zero_grad()`` only when ``accelerator.sync_gradients``) that
    also answers for the ``ZeroOptimizer`` inside: ``clip_grad_norm_``, ``no_sync``, ``gathered_parameters``,
    ``flush``, ``backward``, ``comm_stats``, ..."""

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper itself lacks
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
