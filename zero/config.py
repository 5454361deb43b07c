"""``ZeroConfig``: every user-facing setting, validated once at the edge (pydantic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

SUPPORTED_STAGES = (0, 1, 2)


class ZeroConfig(BaseModel):
    """Settings for :class:`zero.ZeroOptimizer`.

    Build it with keyword arguments, or load it from a JSON or YAML file with
    :meth:`from_file`. Unknown fields are rejected, so a typo fails loudly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: int = Field(
        2,
        description="0: plain data parallelism (all-reduce); 1: shard optimizer state; "
        "2: also shard gradients.",
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

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in SUPPORTED_STAGES:
            allowed = ", ".join(map(str, SUPPORTED_STAGES))
            raise ValueError(f"stage must be one of {allowed} (got {stage}); stage 3 is not implemented yet")
        return stage

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
