"""``ZeroConfig``: every user-facing setting, validated once at the edge (pydantic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SUPPORTED_STAGES = (0, 1, 2, 3)


class ZeroConfig(BaseModel):
    """Settings for :class:`zero.ZeroOptimizer`.

    Build it with keyword arguments, or load it from a JSON or YAML file with
    :meth:`from_file`. Unknown fields are rejected, so a typo fails loudly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: int = Field(
        2,
        description="0: plain data parallelism (all-reduce); 1: shard optimizer state; "
        "2: also shard gradients; 3: also shard parameters (gathered unit by unit in forward and backward).",
    )
    bucket_size_mb: float = Field(
        25.0,
        gt=0,
        description="Capacity of one gradient/parameter bucket in MiB (one reduce-scatter and one "
        "all-gather per bucket). Smaller buckets overlap more with backward; larger ones send fewer messages.",
    )
    max_in_flight_buckets: int = Field(
        2,
        ge=1,
        description="Reductions allowed in flight at once during backward; bounds stage 2's staging memory.",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a collective may wait before it fails with an error instead of hanging.",
    )
    sync_module_states: bool = Field(
        True, description="Broadcast rank 0's parameters and buffers to every rank at construction (as DDP does)."
    )

    unit_classes: Optional[tuple[str, ...]] = Field(
        None,
        description="Stage 3: names of the module classes that each form one gathering unit (e.g. "
        "['Block', 'GPT2Block']). Default: every module held directly in an nn.ModuleList (each "
        "transformer block). Parameters outside every unit form one more unit with the root module.",
    )
    unit_size_mb: Optional[float] = Field(
        None,
        gt=0,
        description="Stage 3 alternative to unit_classes: make a unit of every module whose not-yet-claimed "
        "parameters reach this many MiB (children first).",
    )
    reshard_after_forward: bool = Field(
        True,
        description="Stage 3: free a unit's gathered parameters after its forward and gather them again for "
        "its backward (3Ψ traffic per step, less the root unit, which backward needs at once and is kept); "
        "False keeps every unit until its backward (2Ψ, more memory).",
    )
    prefetch_units: int = Field(
        1,
        ge=0,
        description="Stage 3: how many units ahead (in the order recorded on the previous step) are gathered "
        "while the current one computes; bounds the gathered working set to 1 + prefetch_units units "
        "(plus the units enclosing them).",
    )

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in SUPPORTED_STAGES:
            allowed = ", ".join(map(str, SUPPORTED_STAGES))
            raise ValueError(f"stage must be one of {allowed} (got {stage})")
        return stage

    @model_validator(mode="after")
    def _one_unit_policy(self) -> "ZeroConfig":
        if self.unit_classes is not None and self.unit_size_mb is not None:
            raise ValueError("set either unit_classes or unit_size_mb (the stage-3 unit policy), not both")
        return self

    @property
    def bucket_size_bytes(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20))

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "ZeroConfig":
        """Load a ``.json``, ``.yaml`` or ``.yml`` file; keyword ``overrides`` win over the file."""
        path = Path(path)
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON") from err
            data = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"{path}: unknown config format {path.suffix!r}; use .json, .yaml or .yml")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of ZeroConfig fields, got {type(data).__name__}")
        return cls(**{**data, **overrides})
