"""Mixed precision: the policy (typed, validated once in ``ZeroConfig``) and the dtypes it gives each bucket.

With ``param_dtype`` set, forward and backward run on low-precision parameters (bf16 or fp16),
autograd's gradients are reduced in ``reduce_dtype`` and kept as this rank's gradient shard,
and the wrapped ``torch.optim`` optimizer steps an fp32 *master* copy of this rank's shard
only, which is then cast back into the low-precision parameters. Buffers (BatchNorm
statistics) keep their dtype. Where it runs (the parameters' casts, the forward inputs' casts):
:mod:`zero.runtime.precision`.

Note on the buffers of a bucket (``zero.runtime.buffers.bucket``), with ``P`` the padded bucket and ``C = P/N``
this rank's chunk; "alias" means the role is a view of another role's memory when dtype and
device agree, so a plain fp32 run holds exactly what it held before mixed precision existed:

==================  =====  ==================  ================================================
role                size   dtype               alias of / lifetime
==================  =====  ==================  ================================================
parameters          P      compute             stages 0-2 persistent, stage 3 while gathered
parameter shard     C      compute             stage 3: the all-gather's source
master shard        C      master              the chunk of the parameters (or stage 3's shard)
local gradients     P      compute             stages 0-1 persistent (``p.grad`` views into it);
                                               stages 2-3 autograd's own ``p.grad``
staging             P      reduce              the local gradients themselves at stages 0-1 when
                                               reduce = compute; else transient, per reduction
gradient shard      C      reduce              the chunk of staging at stages 0-1 when staging is
                                               the local gradients; else persistent until cleared
master gradients    C      master              the gradient shard; else transient, during step()
==================  =====  ==================  ================================================

``compute`` is ``param_dtype`` (or the parameter's own dtype without one), ``master`` is the
parameter's own dtype promoted to at least fp32 (or its own dtype without ``param_dtype``: a
model built in bf16 and wrapped without a policy trains in pure bf16, as plain PyTorch does),
and ``reduce`` is ``reduce_dtype`` (default fp32 with a ``param_dtype``, else ``compute``).
With ``reduce_dtype = param_dtype`` these are the ZeRO paper's mixed-precision buffers
(2-byte parameters and gradients, 12 bytes of fp32 master, m and v per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
MAX_SCALE = 2.0**64  # far above any useful loss scale (fp16 gradients overflow long before)


@dataclass(frozen=True)
class BufferDtypes:
    """The dtypes of one bucket's buffers (see the module Note)."""

    compute: torch.dtype  # parameters and autograd's gradients
    master: torch.dtype  # what the wrapped optimizer steps
    reduce: torch.dtype  # what the gradient collective moves; the gradient shard

    @property
    def separate_master(self) -> bool:
        return self.master != self.compute


class LossScale(BaseModel):
    """Dynamic loss scaling for fp16, with ``torch.amp.GradScaler``'s semantics and defaults: the loss
    is multiplied by ``scale``; a step whose gradients hold inf/NaN on any rank is skipped (on every
    rank) and the scale multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a
    row it is multiplied by ``growth_factor``. An overflow that would take the scale below
    ``min_scale`` raises an error instead (training has diverged, or a loss is inf/NaN at any scale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init_scale: float = Field(2.0**16, strict=True, allow_inf_nan=False, gt=0, le=MAX_SCALE)
    growth_factor: float = Field(2.0, strict=True, allow_inf_nan=False, gt=1, le=2**16)
    backoff_factor: float = Field(0.5, strict=True, allow_inf_nan=False, gt=0, lt=1)
    growth_interval: int = Field(2000, strict=True, ge=1, le=2**31 - 1)
    min_scale: float = Field(1.0, strict=True, allow_inf_nan=False, gt=0, le=MAX_SCALE)

    @model_validator(mode="after")
    def _min_below_init(self) -> "LossScale":
        if self.min_scale > self.init_scale:
            raise ValueError(f"loss_scale.min_scale ({self.min_scale}) must not exceed init_scale ({self.init_scale})")
        return self


class MixedPrecision(BaseModel):
    """The mixed-precision policy of :class:`zero.ZeroConfig` (``precision=``).

    Example: ``ZeroConfig(precision={"param_dtype": "bf16"})`` (reduce in fp32, the default), or
    ``{"param_dtype": "bf16", "reduce_dtype": "bf16"}`` to halve the gradient traffic. Dtypes are
    ``"fp32"``, ``"bf16"``, ``"fp16"`` (``torch.bfloat16`` and ``"bfloat16"`` are accepted too).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    param_dtype: Optional[Literal["bf16", "fp16"]] = Field(
        None,
        description="Dtype of the parameters in forward and backward (and of the all-gather); the optimizer "
        "steps fp32 master shards. None: parameters keep their own dtype and are stepped directly.",
    )
    reduce_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        None,
        description="Dtype of the gradient reduce-scatter and of the gradient shard kept until the step. Default "
        "with param_dtype: fp32 (exact sums, 2x the traffic of param_dtype). Needs param_dtype.",
    )
    cast_forward_inputs: bool = Field(
        True,
        strict=True,
        description="Cast floating-point tensors passed to the model's forward to param_dtype (as FSDP2 does).",
    )
    loss_scale: Optional[LossScale] = Field(
        None,
        description="Dynamic loss scaling (fp16 only; on by default for fp16, with GradScaler's defaults). "
        "Scale the loss with opt.backward(loss) or opt.scale_loss(loss).backward().",
    )

    @field_validator("param_dtype", "reduce_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        if isinstance(value, torch.dtype):
            names = {v: k for k, v in DTYPES.items()}
            if value not in names:
                raise ValueError(f"unsupported dtype {value}; use one of {', '.join(DTYPES)}")
            return names[value]
        if isinstance(value, str):
            return _ALIASES.get(value.removeprefix("torch."), value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "MixedPrecision":
        if self.param_dtype is None:
            if self.reduce_dtype is not None:
                raise ValueError(
                    "precision.reduce_dtype needs precision.param_dtype: without it gradients are reduced in the "
                    "parameters' own dtype. Set param_dtype too, or leave reduce_dtype unset."
                )
        elif self.reduce_dtype == "fp16" and self.param_dtype == "bf16":
            raise ValueError(
                "precision.reduce_dtype='fp16' cannot hold bf16 gradients: fp16's range ends at 65504, bf16's at "
                "3.4e38, so large gradients would become inf. Use reduce_dtype 'fp32' or 'bf16'."
            )
        if self.loss_scale is not None and self.param_dtype != "fp16":
            raise ValueError(
                f"precision.loss_scale is for fp16 (its narrow range underflows small gradients); param_dtype is "
                f"{self.param_dtype or 'unset (full precision)'}, which needs no loss scaling. Remove loss_scale."
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None

    @property
    def scaling(self) -> Optional[LossScale]:
        """The loss scaling in effect: fp16 scales by default."""
        if self.param_dtype != "fp16":
            return None
        return self.loss_scale or LossScale()

    def dtypes(self, param_dtype: torch.dtype, full: bool = False) -> BufferDtypes:
        """The buffers' dtypes for a bucket of parameters built in ``param_dtype`` (``full``: parameters of a
        module with floating-point buffers, :func:`zero.runtime.precision.parameters.full_precision_parameters`)."""
        if self.param_dtype is None or full:
            return BufferDtypes(param_dtype, param_dtype, param_dtype)
        compute = DTYPES[self.param_dtype]
        master = torch.promote_types(param_dtype, torch.float32)
        return BufferDtypes(compute, master, DTYPES[self.reduce_dtype or "fp32"])
