"""Mixed precision: the policy (typed, validated once in ``ZeroConfig``) and the dtypes it gives each bucket.

With ``param_dtype`` set, forward and backward run on low-precision parameters (bf16 or fp16),
autograd's gradients are reduced in ``reduce_dtype`` and kept as this rank's gradient shard,
and the wrapped ``torch.optim`` optimizer steps an fp32 *master* copy of this rank's shard
only, which is then cast back into the low-precision parameters. Buffers (BatchNorm
statistics) keep their dtype.

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
from functools import partial
from typing import Any, Iterable, Literal, Optional

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
        """The buffers' dtypes for a bucket of parameters built in ``param_dtype`` (``full``: parameters of
        a module with floating-point buffers, see :func:`full_precision_parameters`)."""
        if self.param_dtype is None or full:
            return BufferDtypes(param_dtype, param_dtype, param_dtype)
        compute = DTYPES[self.param_dtype]
        master = torch.promote_types(param_dtype, torch.float32)
        return BufferDtypes(compute, master, DTYPES[self.reduce_dtype or "fp32"])


def full_precision_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """Parameters of modules that hold floating-point buffers (BatchNorm's running statistics): they stay in
    their own dtype, as autocast keeps batch norm in fp32. Kernels take low-precision inputs with fp32
    weights and statistics, not bf16 weights with fp32 statistics, and the statistics keep their dtype."""
    kept = set()
    for module in model.modules():
        if any(b is not None and b.is_floating_point() for b in module.buffers(recurse=False)):
            kept.update(module.parameters(recurse=False))
    return kept


def cast_unmanaged_parameters(model: torch.nn.Module, policy: MixedPrecision, keep: set[torch.nn.Parameter]) -> None:
    """Cast the model's floating-point parameters not in ``keep`` (those the buckets manage, and those of
    :func:`full_precision_parameters`) to ``param_dtype``: frozen parameters kept whole at stages 0-2
    compute in it too (a one-time cast: nothing updates them)."""
    if policy.param_dtype is None:
        return
    dtype = DTYPES[policy.param_dtype]
    for p in model.parameters():
        if p not in keep and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def check_device_supports(policy: MixedPrecision, device: torch.device) -> None:
    """Raise if ``device`` cannot compute in ``policy.param_dtype`` (a tiny matmul is tried)."""
    if policy.param_dtype is None:
        return
    dtype = DTYPES[policy.param_dtype]
    reason = None
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        reason = "this GPU has no bf16 support (compute capability 8.0 or newer is needed)"
    else:
        try:
            a = torch.ones(2, 2, dtype=dtype, device=device)
            (a @ a).sum().item()
        except (RuntimeError, TypeError) as err:
            reason = f"a {policy.param_dtype} matmul fails there ({err})"
    if reason is not None:
        raise ValueError(
            f"precision.param_dtype={policy.param_dtype!r} cannot run on {device}: {reason}. Choose another "
            "param_dtype (bf16 runs on CPUs and on GPUs of compute capability 8.0+), or leave it unset."
        )


def cast_inputs(dtype: torch.dtype, value: Any) -> Any:
    """``value`` with every floating-point tensor in it (nested in lists, tuples, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_inputs(dtype, v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_inputs(dtype, v) for v in value)
    if isinstance(value, dict):
        return {k: cast_inputs(dtype, v) for k, v in value.items()}
    return value


class ModuleInputCast:
    """A forward pre-hook on a module that computes in ``dtype``: its floating-point inputs of another dtype are cast
    to ``dtype`` (``cast``, the ``cast_forward_inputs`` setting), or refused with an error naming the module, the
    tensor's dtype and the setting. Inputs already in ``dtype`` (the common case) are only looked at; outputs are
    not cast back."""

    def __init__(self, dtype: torch.dtype, name: str, cast: bool):
        self.dtype, self.name, self.cast = dtype, name, cast

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        other = _other_dtype(self.dtype, args) or (_other_dtype(self.dtype, kwargs) if kwargs else None)
        if other is None:
            return None
        if not self.cast:
            raise ValueError(
                f"module {self.name or '<root>'!r} ({type(module).__name__}) computes in {self.dtype} "
                f"(precision.param_dtype) but received a {other} tensor, and precision.cast_forward_inputs=False "
                "leaves inputs as they are. Cast the tensor to the model's dtype where it is made, or set "
                "cast_forward_inputs=True (the default: floating inputs are cast at the entry of each such module)."
            )
        return cast_inputs(self.dtype, args), cast_inputs(self.dtype, kwargs)


def _other_dtype(dtype: torch.dtype, value: Any) -> torch.dtype | None:
    """The dtype of the first floating-point tensor in ``value`` (nested as :func:`cast_inputs` walks) that is not
    ``dtype``, if any."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() and value.dtype != dtype else None
    if isinstance(value, (list, tuple)):
        return next((d for d in map(partial(_other_dtype, dtype), value) if d is not None), None)
    if isinstance(value, dict):
        return next((d for d in map(partial(_other_dtype, dtype), value.values()) if d is not None), None)
    return None


def input_casts(model: torch.nn.Module, dtype: torch.dtype, cast: bool, units: Iterable[str] = ()) -> list[Any]:
    """Register :class:`ModuleInputCast` on every module that owns a parameter in ``dtype`` (after the policy cast
    the model) and on the modules named in ``units`` (stage 3's units, as FSDP2 casts the inputs of each module it
    wraps); the hooks' handles. A floating tensor made inside forward in another dtype (``torch.ones(...)``,
    ``x.float()``, a sum with an fp32 mask) is cast where it enters such a module: modules that keep full precision
    (:func:`full_precision_parameters`) and integer inputs are left alone."""
    wanted = set(units) if cast else set()
    for name, module in model.named_modules():
        if any(p.is_floating_point() and p.dtype == dtype for p in module.parameters(recurse=False)):
            wanted.add(name)
    return [module.register_forward_pre_hook(ModuleInputCast(dtype, name, cast), with_kwargs=True)
            for name, module in model.named_modules() if name in wanted]
