"""What the collective codecs (:mod:`zero.comm.codec`) hold on the device beside the buffers they fill, per bucket, for
the schedule (:mod:`zero.estimator.schedule`), as the codec itself states it: :class:`CodecMemory` holds the codec that
``zero.comm.hierarchy.codec_of`` builds for the policy (the one the runtime runs) and asks it for each bucket's
:class:`zero.comm.codec.Cost` (``gather_cost``, ``reduce_scatter_cost``, ``all_reduce_cost``), so that a new codec is
priced with no change here. With ``C`` one rank's chunk of a bucket and ``g`` the ranks it is sharded over:

* each all-gather of a bucket (stage 3's): the codec's ``held`` for ``(C, g)`` from its start until it is waited for,
  and its ``decoding`` besides at the wait. hpZ's gathers from the secondary copies are exact: nothing. (Stages
  1-2's gathers after the step are not priced: only an exact codec runs there, and the identity holds nothing);
* each reduction of a bucket: its ``encoding`` (with its ``scratch`` besides) when it starts, then its ``held`` until
  it is waited for, and its ``decoding`` besides at the wait;
* with HSDP, each bucket's sum across the ``r`` groups (the codec's all-reduce of the shard, ``(C, r)``) from its
  start (when the next bucket launches, ``zero.comm.handles.Chain.advance``, or at the wait) to its wait, in the same
  four moments. (The reduction inside the group is over by then: its packets went with its wait.)

A collective over a group of one runs no codec (nothing is sent): nothing. The identity codec holds nothing; ZeRO++'s
(qwZ, qgZ) state theirs from ``zero.comm.quantization``'s ``packet_bytes``, ``scratch_bytes`` and ``decode_bytes``,
measured against the allocator on a parameter-bound GPT in ``tests/distributed/test_estimate_world.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.comm.codec import Codec, Cost, IdentityCodec
from zero.comm.hierarchy import codec_of
from zero.comm.policy import Communication
from zero.estimator.traffic import Wire


@dataclass(frozen=True)
class CodecMemory:
    """The codec of one ``communication`` policy, with the parameters sharded over groups of ``group`` ranks and, with
    HSDP, ``replicas`` groups (each bucket's shard summed across them)."""

    codec: Codec = IdentityCodec()
    group: int = 1
    replicas: int = 1

    @classmethod
    def of(cls, policy: Communication, group: int, world_size: int) -> "CodecMemory":
        """The codec of ``policy`` with the parameters sharded over ``group`` of ``world_size`` ranks."""
        return cls(codec_of(policy), group, world_size // group)

    @property
    def gradients(self) -> bool:
        """Reductions run through the codec (over more than one rank): the schedule follows what they hold."""
        return self.group > 1

    def _gather(self, wire: Wire | None) -> Cost | None:
        if not wire or wire.padded <= wire.chunk:  # (a group of one)
            return None
        return self.codec.gather_cost(wire.chunk, wire.padded // wire.chunk, wire.params)

    def _reduce(self, wire: Wire | None) -> Cost | None:
        if not (wire and wire.trainable) or wire.padded <= wire.chunk:
            return None
        return self.codec.reduce_scatter_cost(wire.chunk, wire.padded // wire.chunk, wire.reduce)

    def gathering(self, wire: Wire | None) -> int:
        """Held while an all-gather of the bucket is in flight."""
        cost = self._gather(wire)
        return cost.held if cost else 0

    def gather_decode(self, wire: Wire | None) -> int:
        """Held besides while the gathered bucket is decoded."""
        cost = self._gather(wire)
        return cost.decoding if cost else 0

    def sending(self, wire: Wire | None) -> tuple[int, int]:
        """What a reduction holds while it encodes (what it will send) and the scratch it encodes through (bytes)."""
        cost = self._reduce(wire)
        return (cost.encoding, cost.scratch) if cost else (0, 0)

    def reducing(self, wire: Wire | None) -> int:
        """Held while a reduction of the bucket is in flight inside the group (what it sent and receives)."""
        cost = self._reduce(wire)
        return cost.held if cost else 0

    def reduce_decode(self, wire: Wire | None) -> int:
        """Held besides while the received reduction is decoded and summed."""
        cost = self._reduce(wire)
        return cost.decoding if cost else 0

    def across(self, wire: Wire | None) -> tuple[int, int, int, int]:
        """HSDP's sum of the bucket's shard across the groups (the codec's all-reduce), from its start (when the next
        bucket launches, or at the wait) to its wait: what it holds while it encodes, the scratch it encodes
        through, what it holds once launched, and what it holds besides at its wait. Zeros without it."""
        if not (self.replicas > 1 and wire and wire.trainable):
            return 0, 0, 0, 0
        cost = self.codec.all_reduce_cost(wire.chunk, self.replicas, wire.reduce)
        return cost.encoding, cost.scratch, cost.held, cost.decoding
