"""``ZeroConfig``: every user-facing setting, validated once at the edge (pydantic).

Validation is strict, so a value of the wrong kind fails here rather than deep inside the
optimizer: integer fields take Python ints only (not bools, not floats such as ``2.0``, not
strings), float fields take finite ints or floats (not bools, strings, ``inf`` or ``nan``),
bool fields take ``True``/``False`` only, and every number has finite bounds (the
constants below). A JSON or YAML file gives the same types (YAML note: write ``1.0e-3``, as
PyYAML reads ``1e-3`` as a string).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from zero.activations import ActivationCheckpointing
from zero.comm.policy import Communication
from zero.deepspeed.reader import DeepSpeedConfig, read_deepspeed
from zero.offload import Offload
from zero.precision import MixedPrecision

# how mixed-precision Adam steps on the device (zero.runtime.step.stepper)
StepKernel = Literal["auto", "torch", "triton"]

SUPPORTED_STAGES = (0, 1, 2, 3)
MAX_MB = 2.0**20  # 1 TiB: above any real bucket or unit
MAX_COUNT = 2**16  # more buckets or units than any model has: use it for "no limit"
MIN_TIMEOUT_S = 0.001  # collectives wait in whole milliseconds; less would round to 0, i.e. no timeout
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week, well inside the 32-bit milliseconds of backend timeouts
CONTAINER_CLASSES = ("ModuleList", "ModuleDict", "ParameterList", "ParameterDict")  # never run a forward


class ZeroConfig(BaseModel):
    """Settings for :class:`zero.ZeroOptimizer`.

    Build it with keyword arguments, or load it from a JSON or YAML file with
    :meth:`from_file`. Unknown fields are rejected, so a typo fails loudly, and so are
    values of the wrong type or out of bounds (see the module docstring).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: int = Field(
        2,
        strict=True,
        description="0: plain data parallelism (all-reduce); 1: shard optimizer state; "
        "2: also shard gradients; 3: also shard parameters (gathered unit by unit in forward and backward).",
    )
    bucket_size_mb: float = Field(
        25.0,
        strict=True,  # takes ints too, not bools or strings
        allow_inf_nan=False,
        gt=0,
        le=MAX_MB,
        description="Capacity of one gradient/parameter bucket in MiB (one reduce-scatter and one "
        "all-gather per bucket). Smaller buckets overlap more with backward; larger ones send fewer messages.",
    )
    max_in_flight_buckets: int = Field(
        2,
        strict=True,
        ge=1,
        le=MAX_COUNT,
        description="Reductions allowed in flight at once during backward; bounds stage 2's staging memory.",
    )
    timeout_s: float = Field(
        600.0,
        strict=True,  # takes ints too, not bools or strings
        allow_inf_nan=False,
        ge=MIN_TIMEOUT_S,
        le=MAX_TIMEOUT_S,
        description="Seconds a collective may wait before it fails with an error instead of hanging "
        "(at least 0.001: timeouts are whole milliseconds; at most a week).",
    )
    sync_module_states: bool = Field(
        True,
        strict=True,
        description="Broadcast rank 0's parameters and buffers to every rank at construction (as DDP does).",
    )
    force_collectives: bool = Field(
        False,
        strict=True,
        description="Issue every collective even in a world of one process (a process group of size 1), instead "
        "of skipping communication: for testing the communication paths on a single GPU. Slower; off for training.",
    )

    precision: MixedPrecision = Field(
        default_factory=MixedPrecision,
        description="Mixed precision (zero.MixedPrecision, or a mapping of its fields): param_dtype ('bf16', "
        "'fp16') for forward/backward over fp32 master shards, reduce_dtype, cast_forward_inputs, loss_scale. "
        "Default: full precision.",
    )

    offload: Offload = Field(
        default_factory=Offload,
        description="Offload (zero.Offload, or a mapping): {'optimizer': 'cpu'} keeps the fp32 master shard, "
        "the optimizer's gradients and state in host memory and steps there (stages 1-3); {'params': 'cpu'} "
        "also keeps stage 3's parameter shards there; 'disk' with a 'path' keeps them in a file per rank "
        "(ZeRO-Infinity). Default: nothing offloaded.",
    )

    communication: Communication = Field(
        default_factory=Communication,
        description="Communication (zero.Communication, or a mapping): quantized_weights (ZeRO++ qwZ, stage 3), "
        "quantized_gradients (qgZ), block_size, gather_codec and reduce_codec (a codec of your own, by import path), "
        "and shard_size for hierarchical sharding (shard within groups of that many ranks, e.g. 'local' for one "
        "machine, replicate across them). Default: exact, one flat group.",
    )

    activation_checkpointing: Optional[ActivationCheckpointing] = Field(
        None,
        description="Checkpoint blocks' activations (zero.ActivationCheckpointing, or a mapping: classes, modules, "
        "every, selective, offload_inputs; {} checkpoints every block of the model's nn.ModuleList). "
        "Default: none.",
    )

    step_kernel: StepKernel = Field(
        "auto",
        description="The optimizer step's kernel for mixed-precision Adam/AdamW on the device: 'triton' (one pass "
        "that also writes the bf16 parameters), 'torch' (the wrapped optimizer), or 'auto': Triton on CUDA where "
        "it is installed and applies, else torch. See zero.runtime.step.stepper.",
    )

    elementwise_optimizers: tuple[StrictStr, ...] = Field(
        (),
        description="Third-party optimizer classes (names, or qualified names such as 'mylib.optim.Lion') whose "
        "update of each element reads that element alone: stepped on flat shards like torch's SGD and AdamW. "
        "Every other optimizer outside torch's elementwise list is stepped on whole parameters (exact for any rule).",
    )
    per_parameter_optimizers: tuple[StrictStr, ...] = Field(
        (),
        description="Third-party whole-parameter optimizer classes (names or qualified names) whose update of a "
        "parameter reads that parameter alone (no global norm): each parameter gets its own owner, balanced over "
        "the ranks. Other classes zero does not know are stepped with all their parameters on one rank (exact).",
    )

    unit_classes: Optional[tuple[StrictStr, ...]] = Field(
        None,
        description="Stage 3: names of the module classes that each form one gathering unit, as a list (e.g. "
        "['Block', 'GPT2Block']). Default: every module held directly in an nn.ModuleList (each "
        "transformer block). Parameters outside every unit form one more unit with the root module.",
    )
    unit_size_mb: Optional[float] = Field(
        None,
        strict=True,  # takes ints too, not bools or strings
        allow_inf_nan=False,
        gt=0,
        le=MAX_MB,
        description="Stage 3 alternative to unit_classes: make a unit of every module whose not-yet-claimed "
        "parameters reach this many MiB (children first).",
    )
    reshard_after_forward: bool = Field(
        True,
        strict=True,
        description="Stage 3: free a unit's gathered parameters after its forward and gather them again for "
        "its backward (3Ψ traffic per step, less the root unit, which backward needs at once and is kept); "
        "False keeps every unit until its backward (2Ψ, more memory).",
    )
    prefetch_units: int = Field(
        1,
        strict=True,
        ge=0,
        le=MAX_COUNT,
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

    @field_validator("unit_classes", mode="before")
    @classmethod
    def _class_list(cls, value: Any) -> Any:
        """A list (JSON, YAML, Python) or tuple of names; a lone string is the usual slip."""
        if value is not None and not isinstance(value, (list, tuple)):
            raise ValueError(
                f"unit_classes must be a list of module class names such as ['Block'], got {type(value).__name__}"
            )
        return value

    @field_validator("unit_classes")
    @classmethod
    def _class_names(cls, names: Optional[tuple[str, ...]]) -> Optional[tuple[str, ...]]:
        """At least one name, each a class name whose modules run a forward."""
        if names is not None and not names:
            raise ValueError("unit_classes must name at least one module class; leave it unset for the default units")
        for name in names or ():
            _check_class_name(name)
        return names

    @model_validator(mode="after")
    def _offload_stage(self) -> "ZeroConfig":
        if self.offload.params_on_host and self.stage != 3:
            raise ValueError(
                f"offload.params={self.offload.params!r} needs stage 3 (got stage {self.stage}): only stage 3 shards "
                "the parameters; below it every rank computes with whole parameters on the device. Use stage=3, or "
                "offload.optimizer='cpu' alone."
            )
        if self.offload.optimizer_on_host and self.stage == 0:
            raise ValueError(
                f"offload.optimizer={self.offload.optimizer!r} needs stage 1, 2 or 3 (got stage 0): stage 0 keeps the "
                "whole optimizer state on every rank. Use stage 1 or higher."
            )
        return self

    @model_validator(mode="after")
    def _communication_stage(self) -> "ZeroConfig":
        self.communication.check_stage(self.stage)  # (its rules: qwZ and lossy gather codecs need stage 3, ...)
        return self

    @model_validator(mode="after")
    def _one_unit_policy(self) -> "ZeroConfig":
        if self.unit_classes is not None and self.unit_size_mb is not None:
            raise ValueError("set either unit_classes or unit_size_mb (the stage-3 unit policy), not both")
        return self

    @property
    def bucket_size_bytes(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20))

    @property
    def unit_size_bytes(self) -> int | None:
        """Stage 3's unit size in bytes (``unit_size_mb``), or ``None`` (units by class)."""
        return None if self.unit_size_mb is None else int(self.unit_size_mb * 2**20)

    @classmethod
    def from_deepspeed(cls, source: Any, ignore: Any = (), **overrides: Any) -> DeepSpeedConfig[ZeroConfig]:
        """Translate a DeepSpeed config (a dict, or the path of its JSON file) key by key, refusing by name each key
        it cannot honour. Returns a :class:`zero.deepspeed.reader.DeepSpeedConfig` that unpacks as
        ``config, training``: the ``ZeroConfig``, and ``{"gradient_clipping", "gradient_accumulation_steps"}`` for
        the training loop to apply (``opt.clip_grad_norm_``, ``opt.no_sync()``). ``overrides``: fields set on top
        (``unit_classes=[...]``). See ``zero.deepspeed.reader`` (which reads the keys into field values;
        they are validated here) and docs/migration.md for what maps, what is ignored and why, and what is refused."""
        read = read_deepspeed(source, ignore)
        fields = {**read.config, **overrides}
        try:
            config = cls(**fields)
        except ValueError as err:
            raise ValueError(f"the DeepSpeed config maps to ZeroConfig({fields}), which is invalid: {err}") from err
        return replace(read, config=config)

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


def _check_class_name(name: str) -> None:
    """Raise if ``name`` cannot be the ``type(module).__name__`` of a unit module."""
    if not name.isidentifier():
        raise ValueError(
            f"unit_classes holds {name!r}, which is not a class name; give type(module).__name__ "
            "of the unit modules, without the module path (e.g. 'GPT2Block')"
        )
    if name in CONTAINER_CLASSES:
        raise ValueError(
            f"unit_classes holds {name!r}, a container whose forward never runs, so its unit would never "
            "be gathered; name the class of the modules inside it (e.g. 'Block')"
        )
