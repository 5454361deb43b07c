"""The configuration the estimator prices: one :class:`zero.ZeroConfig`, the same object ``ZeroOptimizer`` runs.

``estimate()``, ``plan()``, ``zero estimate`` and ``offload.ratio="auto"`` all read a ``ZeroConfig`` (built here from
the estimator's shorthand keywords where a caller gives those), so a setting reaches the estimator the way it reaches
the runtime. Every field of ``ZeroConfig`` is in exactly one of two tables below: :data:`PRICED` (what the estimator
reads it for) or :data:`MEMORY_NEUTRAL` (why it changes no byte the estimate counts). A field of a nested policy is
covered by its own dotted name or by its policy's. ``tests/unit/test_estimator_config.py`` lists the fields and fails
on one in neither table, so a field added to the config is priced or declared neutral here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel, ValidationError
from torch import nn

from zero.config import ZeroConfig
from zero.offload import target_of
from zero.precision import MixedPrecision
from zero.runtime.buffers.units import plan_units

# the precisions the estimator's shorthand names (``estimate(precision="mixed")``, ``zero estimate --precision``)
POLICIES = {
    "fp32": MixedPrecision(),
    "mixed": MixedPrecision(param_dtype="bf16", reduce_dtype="bf16"),  # the ZeRO paper's (K = 12)
    "mixed-fp32-reduce": MixedPrecision(param_dtype="bf16"),  # the default policy: gradients reduced in fp32
}
# offload to disk names a directory; the estimator's configurations carry this one (the runtime makes nothing here)
DISK_PATH = "/local_nvme/zero"

PRICED = {
    "stage": "the stage's buffer schedule (zero.estimator.schedule) and its buckets' plans",
    "bucket_size_mb": "the buckets the runtime's own partition builds",
    "max_in_flight_buckets": "reductions outstanding at once in the replayed backward",
    "precision.param_dtype": "the traced model's dtype, the buckets' dtypes and the master weights",
    "precision.reduce_dtype": "the reduction's staging buffer and gradient shard",
    "offload.optimizer": "the buckets' placements (device, host, disk): zero.estimator.offloading",
    "offload.params": "stage 3's parameter shards' placement",
    "offload.buffer_count": "the window of buckets mapped from the offload file into host memory",
    "offload.ratio": "the share of the buckets whose optimizer side is off the device (a number; 'auto' is chosen by "
                     "pricing each ratio)",
    "offload.delayed_step": "host memory: the gradients handed to the background step",
    "communication": "the codecs' bytes in flight, hierarchical groups and hpZ's copies (zero.estimator.traffic)",
    "activation_checkpointing": "the traced model is checkpointed by the runtime's own policy",
    "elementwise_optimizers": "which optimizers step flat shards, which whole parameters (zero.estimator.optimizers)",
    "per_parameter_optimizers": "whole-parameter owners: one per parameter, or one per optimizer",
    "unit_classes": "stage 3's units, by the runtime's own planner, and the modules that cast their inputs",
    "unit_size_mb": "stage 3's units, by the runtime's own planner",
    "reshard_after_forward": "stage 3's gathering schedule (zero.runtime.gathering.gather_order): units kept gathered "
                             "from forward to backward",
    "prefetch_units": "stage 3's gathering schedule: units gathered ahead",
}
MEMORY_NEUTRAL = {
    "timeout_s": "how long a collective waits",
    "sync_module_states": "a broadcast at construction, into the parameters that exist anyway",
    "force_collectives": "issues a world of one's collectives, which hold nothing beyond their buffers",
    "step_kernel": "the fused Triton step writes in place and holds no more than the traced torch step",
    "precision.cast_forward_inputs": "with False the inputs must already be in param_dtype (else refused), which is "
                                     "the batch the estimator traces",
    "precision.loss_scale": "one scalar and an in-place unscale",
    "offload.path": "where the offload file lives, not its size",
    "offload.gpu_memory": "the budget offload.ratio='auto' fits, not a buffer",
    "offload.host_threads": "threads of the host step",
}

# the estimator's shorthand keywords, older than estimate(config=...); each sets the ZeroConfig field named
SHORTHANDS = {
    "precision": "precision ('fp32', 'mixed', 'mixed-fp32-reduce', or the field's own value)",
    "checkpointing": "activation_checkpointing (True: every block of the model's nn.ModuleList)",
    "offload": "offload.optimizer ('none', 'cpu', 'disk'; False and True read as 'none' and 'cpu'), or the field's "
               "own value",
    "params_offload": "offload.params",
    "buffer_count": "offload.buffer_count",
    "offload_ratio": "offload.ratio",
}


def leaf_fields(model: type[BaseModel] = ZeroConfig, prefix: str = "") -> Iterator[str]:
    """The dotted names of ``model``'s fields, nested policies' fields included (``precision.param_dtype``)."""
    for name, info in model.model_fields.items():
        nested = [t for t in getattr(info.annotation, "__args__", (info.annotation,))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        if nested:
            yield from leaf_fields(nested[0], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def covered(field: str, table: dict[str, str]) -> bool:
    """Whether ``table`` names ``field`` or the policy holding it."""
    parts = field.split(".")
    return any(".".join(parts[:i]) in table for i in range(1, len(parts) + 1))


def _needs_path(name: Any) -> bool:
    """Whether the offload target ``name`` names needs ``offload.path`` (an unknown name: no; ZeroConfig refuses it)."""
    try:
        return name is not None and target_of(name).needs_path
    except ValueError:
        return False


def priced_config(config: ZeroConfig | None = None, **settings: Any) -> ZeroConfig:
    """``config`` (default: ``ZeroConfig()``'s defaults) with ``settings`` applied: ``ZeroConfig`` fields by name
    (``stage=3``, ``unit_classes=["Block"]``, ``offload={...}``) or the estimator's :data:`SHORTHANDS`. Validated
    as ``ZeroOptimizer`` validates it; a rule broken is a ``ValueError`` with the rule's own message."""
    if config is not None and not isinstance(config, ZeroConfig):
        raise ValueError(f"config must be a zero.ZeroConfig, got {type(config).__name__}")
    fields = config.model_dump(exclude_unset=True) if config is not None else {}
    offload = dict(fields.get("offload") or {})
    for key, value in settings.items():
        if key == "precision" and isinstance(value, str):
            if value not in POLICIES:
                raise ValueError(f"precision must be one of {sorted(POLICIES)} (or a zero.MixedPrecision), "
                                 f"got {value!r}")
            fields["precision"] = POLICIES[value].model_dump(exclude_defaults=True)
        elif key == "checkpointing":
            fields["activation_checkpointing"] = {} if value is True else None if value in (False, None) else value
        elif key == "offload" and (value is None or isinstance(value, (bool, str))):
            offload["optimizer"] = ("cpu" if value else "none") if not isinstance(value, str) else value
        elif key == "offload":
            offload = dict(value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value)
        elif key in ("params_offload", "buffer_count", "offload_ratio"):
            offload[{"params_offload": "params", "offload_ratio": "ratio"}.get(key, key)] = value
        elif key in ZeroConfig.model_fields:
            fields[key] = value
        else:
            raise ValueError(f"unknown setting {key!r}: the estimator takes ZeroConfig's fields "
                             f"({', '.join(ZeroConfig.model_fields)}) and {', '.join(SHORTHANDS)}")
    if any(_needs_path(offload.get(side)) for side in ("optimizer", "params")) and offload.get("path") is None:
        offload["path"] = DISK_PATH
    if offload:
        fields["offload"] = offload
    try:
        return ZeroConfig(**fields)
    except ValidationError as err:
        raise_rule(err)
        raise ValueError(str(err)) from None


def raise_rule(err: ValidationError) -> None:
    """Raise the ``ValueError`` of the model rule ``err`` reports (its own message, without pydantic's framing), if
    it reports one."""
    cause = (err.errors()[0].get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):
        raise ValueError(str(cause)) from None


def precision_name(policy: MixedPrecision) -> str:
    """The shorthand name of ``policy`` (``"mixed"`` ...), or its non-default fields."""
    named = [name for name, known in POLICIES.items() if known == policy]
    return named[0] if named else str(policy.model_dump(exclude_defaults=True))


@dataclass(frozen=True)
class Units:
    """Stage 3's unit policy (``ZeroConfig.unit_classes`` or ``unit_size_mb``), planned by the runtime's planner."""

    classes: tuple[str, ...] | None = None
    size_bytes: int | None = None

    @classmethod
    def of(cls, config: ZeroConfig) -> "Units":
        return cls(config.unit_classes, config.unit_size_bytes)

    def plan(self, model: nn.Module, params: list) -> list:
        return plan_units(model, params, unit_classes=self.classes, unit_size_bytes=self.size_bytes)
