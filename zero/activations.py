"""Activation checkpointing by policy: ``zero.checkpoint_activations(model, policy)``.

The chosen blocks keep only their inputs from forward; backward recomputes each block's forward when it
needs the block's saved tensors. It is torch's non-reentrant checkpointing applied through module
hooks (:class:`zero.runtime.activations.checkpointing.CheckpointHooks`, as
``torch.distributed._composable.checkpoint``, the API FSDP2 composes with, applies it), so parameter names and
``state_dict`` keys are unchanged, and a recomputation calls the module again: stage 3 gathers the unit's
parameters for it through its usual hooks and backward releases them. The RNG state is restored for the
recomputation, so dropout draws the same mask and checkpointing changes no number.
Every backward pass through a block recomputes it (a second backward through a retained graph, a gradient
penalty's double backward).

Policies (:class:`ActivationCheckpointing`): the blocks are the modules of the named classes (``classes``),
or those named (``modules``), or by default every module held in an ``nn.ModuleList`` (stage 3's default
units: the transformer blocks); ``every=k`` keeps every k-th of them; ``selective=True`` also saves
matrix-multiplication outputs inside each block and recomputes only the cheap operations between them
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``; the operations are :data:`MATMULS`);
``offload_inputs=True`` keeps each checkpointed block's input in host memory (pinned with a GPU) until the
recomputation brings it back.

This module holds the policy. Where it runs: :mod:`zero.runtime.activations` (the blocks chosen, the hooks,
``zero.checkpoint_activations``); what it saves and the blocks for an activation budget
(``zero.blocks_within_budget``, from the estimator's trace): :mod:`zero.estimator.activation_budget`.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_cudnn_attention")  # fmt: skip


class ActivationCheckpointing(BaseModel):
    """Which blocks to checkpoint and how (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: Optional[tuple[StrictStr, ...]] = Field(None, description="class names of the blocks, e.g. ['Block']")
    modules: Optional[tuple[StrictStr, ...]] = Field(None, description="qualified names of the blocks")
    every: int = Field(1, strict=True, ge=1, description="checkpoint every k-th block (1: all)")
    selective: bool = Field(False, strict=True, description="also save matmul outputs; recompute only the rest")
    offload_inputs: bool = Field(False, strict=True, description="keep the blocks' inputs in host memory")
    use_reentrant: bool = Field(False, strict=True, description="must stay False: reentrant is not supported")

    @model_validator(mode="after")
    def _check(self) -> "ActivationCheckpointing":
        if self.use_reentrant:
            raise ValueError(
                "reentrant activation checkpointing (use_reentrant=True) runs a backward inside backward, which "
                "cannot hand gradients to ZeRO's hooks in order; use the default non-reentrant checkpointing"
            )
        if self.classes is not None and self.modules is not None:
            raise ValueError("give either classes or modules (the blocks to checkpoint), not both")
        return self
