"""Communication: the policy (``ZeroConfig.communication``) for what crosses the wire and between which ranks.

* ``quantized_weights`` (ZeRO++'s qwZ, stage 3): each unit's all-gather moves int8 blocks with one fp32 scale per
  ``block_size`` elements (:class:`zero.comm.codec.QuantizedWeights`), decoded into the compute dtype. The master
  weights, the optimizer and the step stay exact; only the copies forward and backward read are rounded, within
  ``max|x| / 254`` of each value (``max`` over its block). Gathers outside training
  (``opt.gathered_parameters()``, ``opt.close()``) are exact.
* ``quantized_gradients`` (ZeRO++'s qgZ, stages 1-3): each gradient reduce-scatter is one all-to-all of int8 blocks
  summed in fp32 on the receiving rank (:class:`zero.comm.codec.QuantizedGradients`); ``gradient_bits=4`` sends int4
  instead (two values a byte, as ZeRO++'s qgZ does inside a machine): half the bytes again, within ``max|x| / 14``.
* ``shard_size`` (hierarchical sharding, FSDP2's HSDP): shard over groups of ``shard_size`` consecutive ranks (one
  machine: ``"local"`` takes torchrun's ``LOCAL_WORLD_SIZE``) and replicate across the groups. Gradients are
  reduce-scattered inside the group and their shard all-reduced across groups; parameters are gathered inside
  the group only, so no parameter crosses a machine boundary. Each rank holds ``1/shard_size`` of the model states
  (not ``1/world_size``). Exact: the same numbers as the flat layout, to rounding.
* ``hierarchy="hpz"`` with ``shard_size`` (ZeRO++'s hierarchical partitioning, stage 3): the optimizer state,
  gradients and parameter shards stay sharded over every rank (``1/world_size``), and each rank also keeps a
  *secondary* copy of the parameters sharded over its group (``1/shard_size`` of the model, refreshed by every
  forward all-gather), from which backward gathers inside the group: the forward gather crosses machines, backward's
  never does. Exact. (Groups of one rank, or of every rank, are the flat layout: as DeepSpeed's
  ``zero_hpz_partition_size=1``, off.)

* ``gather_codec`` and ``reduce_codec``: a codec of your own, by import path (``"module:Class"``, a
  :class:`zero.comm.codec.Codec` subclass built with no arguments), for the all-gathers (in place of qwZ; a lossy
  one, ``exact_gather = False``, needs stage 3 as qwZ does) or for the gradient reductions (the reduce-scatters and,
  with HSDP, the sum across the groups; in place of qgZ; stages 1-3). Checked here (the module imports, the name is
  a ``Codec``); :func:`zero.comm.hierarchy.codec_of` builds it, and the estimator prices it by asking it
  (``Codec.gather_cost`` and the others), so a new codec is one class and this one setting.

Quantization is lossy and off by default; its bounds are stated in :mod:`zero.comm.quantization` and tested.
"""

from __future__ import annotations

import importlib
import os
from typing import Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from zero.comm.codec import Codec

CODEC_SETTINGS = (("gather_codec", "quantized_weights"), ("reduce_codec", "quantized_gradients"))  # (flags replaced)


def codec_class(path: str, setting: str = "gather_codec") -> type[Codec]:
    """The :class:`~zero.comm.codec.Codec` subclass ``path`` names (``"module:Class"``), imported; a ``ValueError``
    naming the cause and the fix when it does not import, is not there, is not a codec or cannot be built with no
    arguments. ``setting``: the policy's field, for the message."""
    where = f"communication.{setting}={path!r}"
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{where} is not an import path: give 'module:Class', e.g. 'mypackage.codecs:Fp8Gather' (a "
                         "zero.comm.codec.Codec subclass)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # (the module's own error, whatever it is, is the cause)
        raise ValueError(f"{where}: module {module_name!r} does not import ({type(err).__name__}: {err}); check its "
                         "name, and that it is installed or on PYTHONPATH") from err
    found = module
    for part in name.split("."):
        found = getattr(found, part, None)
    if found is None:
        raise ValueError(f"{where}: module {module_name!r} has no {name!r}; check the class's name")
    if not (isinstance(found, type) and issubclass(found, Codec)):
        raise ValueError(f"{where} names {found!r}, not a zero.comm.codec.Codec subclass: subclass Codec, with its "
                         "collectives and their costs (docs/communication.md)")
    try:
        found()
    except TypeError as err:
        raise ValueError(f"{where} cannot be built with no arguments ({err}): give its parameters defaults, or name "
                         "a subclass that sets them") from err
    return found


class Communication(BaseModel):
    """The communication policy of :class:`zero.ZeroConfig` (``communication=``); default: exact, one flat group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantized_weights: bool = Field(
        False,
        strict=True,
        description="Stage 3: all-gather parameters as int8 blocks with a scale each (ZeRO++ qwZ); lossy, about "
        "0.27x fp32's bytes. The master weights stay exact.",
    )
    quantized_gradients: bool = Field(
        False,
        strict=True,
        description="Reduce-scatter gradients as int8 blocks through one all-to-all, summed in fp32 on the "
        "receiving rank (ZeRO++ qgZ); lossy, about 0.27x fp32's bytes.",
    )
    block_size: int = Field(
        256, strict=True, ge=16, le=2**20,
        description="Elements per quantization block (one fp32 scale each): smaller blocks err less and send more "
        "scales.",
    )
    gradient_bits: Literal[8, 4] = Field(
        8,
        description="With quantized_gradients: bits per value, 8 (int8) or 4 (int4, two values a byte: about 0.14x "
        "fp32's bytes, each value within max|x| / 14 of its block's absmax instead of / 254). 4 needs an even "
        "block_size.",
    )
    shard_size: Union[StrictInt, Literal["local"], None] = Field(
        None,
        description="Hierarchical sharding: shard over groups of this many consecutive ranks and replicate across "
        "groups ('local': torchrun's LOCAL_WORLD_SIZE, one machine). None: one group of every rank.",
    )

    hierarchy: Literal["hsdp", "hpz"] = Field(
        "hsdp",
        description="With shard_size: 'hsdp' shards everything within each group and replicates across groups; "
        "'hpz' (stage 3) shards over every rank and keeps a secondary copy of the parameters sharded within the "
        "group, from which backward gathers (ZeRO++ hpZ).",
    )

    gather_codec: Optional[StrictStr] = Field(
        None,
        description="A codec of your own for the all-gathers, by import path 'module:Class' (a zero.comm.codec.Codec "
        "subclass built with no arguments; see docs/communication.md). A lossy one (exact_gather=False) needs stage 3. "
        "Not with quantized_weights.",
    )
    reduce_codec: Optional[StrictStr] = Field(
        None,
        description="A codec of your own for the gradient reductions (reduce-scatters, and with shard_size the sum "
        "across the groups), by import path 'module:Class'. Stages 1-3. Not with quantized_gradients.",
    )

    @field_validator("gather_codec", "reduce_codec")
    @classmethod
    def _imports(cls, path: Optional[str], info: ValidationInfo) -> Optional[str]:
        if path is not None:
            codec_class(path, info.field_name or "codec")
        return path

    @model_validator(mode="after")
    def _one_codec_each(self) -> "Communication":
        for setting, flag in CODEC_SETTINGS:
            if getattr(self, setting) is not None and getattr(self, flag):
                raise ValueError(f"communication.{setting} and {flag} both choose the codec of the same collectives: "
                                 f"set one ({flag} is the built-in int8 codec)")
        hsdp = self.shard_size is not None and self.hierarchy == "hsdp"
        if hsdp and self.reduce_codec is not None and codec_class(self.reduce_codec, "reduce_codec").all_reduce is (
                Codec.all_reduce):
            raise ValueError(f"communication.reduce_codec={self.reduce_codec!r} does not implement all_reduce, with "
                             "which HSDP (shard_size) sums each gradient shard across the groups: implement "
                             "all_reduce and all_reduce_cost, or leave shard_size unset")
        return self

    @model_validator(mode="after")
    def _positive_shard_size(self) -> "Communication":
        if isinstance(self.shard_size, int) and self.shard_size < 1:
            raise ValueError(f"communication.shard_size must be at least 1 (got {self.shard_size})")
        if self.gradient_bits != 8 and not self.quantized_gradients:
            raise ValueError(f"communication.gradient_bits={self.gradient_bits} needs quantized_gradients=True")
        if self.gradient_bits == 4 and self.block_size % 2:
            raise ValueError(f"communication.gradient_bits=4 packs two values a byte: block_size must be even (got "
                             f"{self.block_size})")
        if self.hierarchy == "hpz" and self.shard_size is None:
            raise ValueError("communication.hierarchy='hpz' needs shard_size: the group that holds the secondary "
                             "copy of the parameters (e.g. 'local', the ranks of one machine)")
        return self

    @property
    def quantized(self) -> bool:
        return self.quantized_weights or self.quantized_gradients

    @property
    def exact_gathers(self) -> bool:
        """All-gathers give every rank the shards exactly: neither qwZ nor a lossy ``gather_codec``."""
        lossy = self.gather_codec is not None and not codec_class(self.gather_codec).exact_gather
        return not (self.quantized_weights or lossy)

    def check_stage(self, stage: int) -> None:
        """Refuse this policy at ``stage`` (a ``ValueError`` naming the setting; ``ZeroConfig`` applies it)."""
        if not self.exact_gathers and stage != 3:
            what = ("quantized_weights" if self.quantized_weights
                    else f"gather_codec={self.gather_codec!r} (lossy: exact_gather=False)")
            raise ValueError(
                f"communication.{what} needs stage 3 (got stage {stage}): below it every rank keeps whole parameters, "
                "which model.state_dict() and the forward read, so "
                f"{'int8' if self.quantized_weights else 'lossy'} copies of other ranks' chunks would be kept and "
                "saved as the weights. Use stage=3."
            )
        if self.hierarchy == "hpz" and stage != 3:
            raise ValueError(
                f"communication.hierarchy='hpz' needs stage 3 (got stage {stage}): its secondary copy is of "
                "the parameter shards that only stage 3 keeps. Use stage=3, or hierarchy='hsdp'."
            )
        settings = {"quantized_gradients": self.quantized_gradients, "reduce_codec": self.reduce_codec is not None,
                    "gather_codec": self.gather_codec is not None, "shard_size": self.shard_size is not None}
        what = next((name for name, on in settings.items() if on), None)
        if what is not None and stage == 0:
            raise ValueError(
                f"communication.{what} needs stage 1, 2 or 3 (got stage 0): stage 0 all-reduces whole gradients "
                "and shards nothing. Use stage 1 or higher."
            )

    def group_size(self, world_size: int) -> int:
        """The shard group's size in a world of ``world_size`` ranks (``world_size`` itself without hierarchy)."""
        size = self.shard_size
        if size is None:
            return world_size
        if size == "local":
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            if not local.isdigit() or int(local) < 1:
                raise ValueError(
                    "communication.shard_size='local' takes the ranks per machine from torchrun's LOCAL_WORLD_SIZE, "
                    "which is not set: launch with torchrun, or give the group size as a number"
                )
            size = int(local)
        if world_size % size:
            raise ValueError(
                f"communication.shard_size={size} does not divide the world of {world_size} ranks: hierarchical "
                "sharding needs groups of equal size (e.g. the same number of ranks on every machine)"
            )
        return size
