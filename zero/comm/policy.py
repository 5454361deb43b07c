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

Quantization is lossy and off by default; its bounds are stated in :mod:`zero.comm.quantization` and tested.
"""

from __future__ import annotations

import os
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


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
