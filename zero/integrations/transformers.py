"""``ZeroTrainer``: Hugging Face ``transformers.Trainer`` with ``ZeroOptimizer`` at any stage.

::

    trainer = ZeroTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0,
                          gradient_accumulation_steps=2), train_dataset=ds, zero_config=zero.ZeroConfig(stage=3))
    trainer.train()                                   # torchrun --nproc-per-node N script.py
    trainer.save_model("out")                         # model.safetensors + config: from_pretrained("out")
    trainer.train(resume_from_checkpoint=True)        # at any world size and stage

With ``offload={"optimizer": "cpu", "ratio": "auto"}`` pass ``zero_example=zero.StepExample(loss=lambda model, inputs:
model(**inputs).loss, batch=(one_collated_micro_batch,))``: the Trainer's own batches are not drawn for it (that would
move its data order).

The Trainer builds its optimizer as usual (``TrainingArguments``' ``optim``, learning rate, weight
decay groups; or ``optimizers=(torch_optimizer, None)``) and this class wraps it in
``ZeroOptimizer``; the LR scheduler is built on the wrapped optimizer, so schedules act on the
shards. Each Trainer path that would be wrong with sharded state is replaced:

* **No DDP.** The model is marked as already prepared (Accelerate's ``_is_accelerate_prepared``), so
  ``accelerator.prepare`` places it without wrapping it in ``DistributedDataParallel``; its
  ``no_sync`` is ``ZeroOptimizer.no_sync``, which the Trainer's accumulation uses (through
  ``accelerator.no_sync``) for every micro-batch but the last.
* **Clipping and the logged norm** (``_clip_grad_norm``, ``_get_grad_norm``): ``opt.clip_grad_norm_``,
  the true global norm over every shard.
* **Checkpoints** (``save_model``, ``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``,
  ``_load_from_checkpoint``): every rank saves :func:`zero.save_checkpoint` (model, master weights,
  optimizer, scheduler) into ``CHECKPOINT/zero_checkpoint``; rank 0 then exports it with
  :func:`zero.consolidate` as ``model.safetensors`` (or shards) next to the config, which
  ``from_pretrained`` loads. Resuming loads the portable checkpoint (any world size and stage)
  after the optimizer and scheduler exist.

Those six methods (one public, five private) are the Trainer internals this class relies on,
checked against ``transformers`` 5.x. Refused with the fix named: ``TrainingArguments(bf16=True)``
or ``fp16=True`` (Accelerate's autocast around a model ZeroOptimizer manages; pass
``zero_config=ZeroConfig(precision={"param_dtype": "bf16"})`` instead) and DeepSpeed or FSDP
arguments (another sharding engine).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from zero.auto_ratio import StepExample
from zero.checkpoint.consolidate import consolidate
from zero.checkpoint.portable import load_checkpoint, save_checkpoint
from zero.config import ZeroConfig
from zero.integrations import CHECKPOINT_DIR, WeakNoSync
from zero.optimizer import ZeroOptimizer


class ZeroTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is a ``ZeroOptimizer`` built from ``zero_config`` (see the module
    docstring; every other argument is the Trainer's)."""

    def __init__(self, *args: Any, zero_config: ZeroConfig | None = None, zero_example: StepExample | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.zero_config = zero_config or ZeroConfig()
        self.zero_example = zero_example  # offload.ratio='auto': the loss and one micro-batch (zero.StepExample)
        self.zero_optimizer: ZeroOptimizer | None = None
        if self.args.bf16 or self.args.fp16:
            raise ValueError(
                "TrainingArguments(bf16=True/fp16=True) autocasts around a model that ZeroOptimizer already manages; "
                "set them to False and pass zero_config=ZeroConfig(precision={'param_dtype': 'bf16'}) instead"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("ZeroTrainer shards with ZeroOptimizer; remove the DeepSpeed or FSDP arguments")

    # ----- the optimizer -------------------------------------------------------------------------------

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (from ``TrainingArguments`` or ``optimizers=``), wrapped in ``ZeroOptimizer``."""
        if self.zero_optimizer is None:
            plain = super().create_optimizer(model)
            if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", None) is plain:
                raise ValueError(
                    "optimizers=(optimizer, scheduler): the scheduler was built on the plain optimizer, which "
                    "ZeroOptimizer replaces, so its learning rates would never reach the shards; pass "
                    "optimizers=(optimizer, None) and set lr_scheduler_type in TrainingArguments, or build both on a "
                    "ZeroOptimizer"
                )
            wrapped = (plain if isinstance(plain, ZeroOptimizer)
                       else ZeroOptimizer(plain, self.model, config=self.zero_config, example=self.zero_example))
            if wrapped.module is not self.model:
                raise ValueError("the ZeroOptimizer passed in optimizers= wraps another model than the Trainer's")
            self.zero_optimizer = self.optimizer = wrapped
            self.model._is_accelerate_prepared = True  # accelerator.prepare: place it, never DDP (see the docstring)
            self.model.no_sync = WeakNoSync(wrapped)
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self.zero_optimizer.clip_grad_norm_(float("inf"))

    # ----- checkpoints ---------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank saves the portable checkpoint; rank 0 exports the model for ``from_pretrained``. Outside a
        Trainer checkpoint (``_internal_call`` False) the portable checkpoint is removed after the export."""
        if self.zero_optimizer is None:  # nothing is sharded yet
            return super().save_model(output_dir, _internal_call)
        output_dir = Path(output_dir if output_dir is not None else self.args.output_dir)
        checkpoint = output_dir / CHECKPOINT_DIR
        save_checkpoint(checkpoint, self.model, self.zero_optimizer, scheduler=self.lr_scheduler,
                        progress=self.args.should_save)
        def export() -> None:  # rank 0; a failure there is raised on every rank, of every shard group
            if self.args.should_save:
                self._export(checkpoint, output_dir, keep_checkpoint=_internal_call)

        self.zero_optimizer.comm.everywhere(export, f"exporting the model to {output_dir}", every_group=True)

    def _export(self, checkpoint: Path, output_dir: Path, keep_checkpoint: bool) -> None:
        """``model.safetensors`` (or shards), the config, generation config and tokenizer, for ``from_pretrained``."""
        consolidate(checkpoint, output_dir, progress=False)
        for extra in (self.model.config, getattr(self.model, "generation_config", None), self.processing_class):
            if extra is not None and hasattr(extra, "save_pretrained"):
                extra.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if not keep_checkpoint:
            shutil.rmtree(checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: ``save_model`` saved the optimizer and the scheduler in the portable checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """The weights come with the optimizer state, in ``_load_optimizer_and_scheduler``."""
        if not (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = Path(checkpoint) / CHECKPOINT_DIR
        if not path.is_dir():
            raise ValueError(f"{checkpoint} holds no {CHECKPOINT_DIR}/: it was not saved by ZeroTrainer")
        load_checkpoint(path, self.model, self.zero_optimizer, scheduler=self.lr_scheduler,
                        progress=self.args.should_save)
