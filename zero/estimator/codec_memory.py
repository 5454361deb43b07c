"""What the collective codecs (:mod:`zero.comm.codec`) hold on the device beside the buffers they fill, per bucket, for
the schedule (:mod:`zero.estimator.schedule`). With ``C`` one rank's chunk of a bucket, ``g`` the ranks it is
sharded over and ``packet = zero.comm.quantization.packet_bytes(C, block_size, bits)``:

* the identity codec (exact communication): nothing;
* quantized weights (ZeRO++ qwZ), each all-gather of a bucket: its own packet and the group's (``(1 + g)
  packets``) from its start until it is waited for; decoding holds one fp32 slice besides
  (``zero.comm.quantization.decode_bytes``). hpZ's gathers from the secondary copies are exact: nothing;
* quantized gradients (ZeRO++ qgZ, int8 or int4), each reduction of a bucket: its ``g`` packets while it encodes
  them (through one fp32 slice of ``g`` rows, ``scratch_bytes``), then also the ``g`` it receives until it is
  waited for; decoding holds the sum's fp32 slice and one decoded slice besides;
* with HSDP, each bucket's sum across the ``r`` groups (qgZ's all-reduce of the shard) from its start (when the next
  bucket launches, ``zero.comm.handles.Chain.advance``, or at the wait) to its wait: a padded fp32 copy of the shard,
  this rank's chunk of the sum and its packets, and at the wait the slices that decode, encode, share and decode
  the sum. (The reduction inside the group is over by then: its packets went with its wait.)

Measured against the allocator on a parameter-bound GPT in ``tests/distributed/test_estimate_world.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero.comm.policy import Communication
from zero.comm.quantization import decode_bytes, packet_bytes, scratch_bytes
from zero.estimator.traffic import Wire


@dataclass(frozen=True)
class CodecMemory:
    """The codecs of one ``communication`` policy: ``block`` elements per scale. A collective over a group of one
    runs no codec (nothing is sent), so each flag means the codec runs: qwZ's and qgZ's over the shard group,
    qgZ's sum across HSDP's ``replicas`` groups."""

    block: int = 256
    weights: bool = False  # qwZ's all-gathers
    gradients: bool = False  # qgZ's reduce-scatters
    replicas: int = 1  # > 1: qgZ's all-reduce across HSDP's groups
    bits: int = 8  # qgZ's bits per value (qwZ's are 8)

    @classmethod
    def of(cls, policy: Communication, group: int, world_size: int) -> "CodecMemory":
        """The codecs of ``policy`` with the parameters sharded over ``group`` of ``world_size`` ranks."""
        return cls(policy.block_size, policy.quantized_weights and group > 1,
                   policy.quantized_gradients and group > 1,
                   world_size // group if policy.quantized_gradients else 1, policy.gradient_bits)

    def gathering(self, wire: Wire | None) -> int:
        """Held while an all-gather of the bucket is in flight (its packets)."""
        if not (self.weights and wire):
            return 0
        return (1 + wire.padded // wire.chunk) * packet_bytes(wire.chunk, self.block)

    def gather_decode(self, wire: Wire | None) -> int:
        """Held besides while the gathered packets are decoded."""
        return decode_bytes(wire.chunk, self.block) if self.weights and wire else 0

    def sending(self, wire: Wire | None) -> tuple[int, int]:
        """A reduction's packets to send and the fp32 slice it encodes them through (bytes)."""
        if not (self.gradients and wire and wire.trainable):
            return 0, 0
        group = wire.padded // wire.chunk
        return (group * packet_bytes(wire.chunk, self.block, self.bits),
                scratch_bytes(group, wire.chunk, self.block, self.bits))

    def reducing(self, wire: Wire | None) -> int:
        """Held while a reduction of the bucket is in flight inside the group: the packets sent and received."""
        return 2 * self.sending(wire)[0]

    def reduce_decode(self, wire: Wire | None) -> int:
        """Held besides while the received packets are decoded and summed."""
        if not (self.gradients and wire and wire.trainable):
            return 0
        return self._summing(wire.chunk)

    def _summing(self, n: int) -> int:
        """Decoding and summing packets of ``n`` elements: the fp32 sum's slice and one decoded slice."""
        return scratch_bytes(1, n, self.block) + decode_bytes(n, self.block, self.bits)

    def across(self, wire: Wire | None) -> tuple[int, int, int, int]:
        """HSDP's sum of the bucket's shard across the groups (qgZ's all-reduce, ``zero.comm.codec``), from its start
        (when the next bucket launches, or at the wait) to its wait: what it holds while it encodes its packets, the
        slice it encodes them through, what it holds once they are sent, and what it holds besides at its wait
        (decoding the sum, then encoding, sharing and decoding it). Zeros without it."""
        if not (self.replicas > 1 and wire and wire.trainable):
            return 0, 0, 0, 0
        replicas, piece = self.replicas, -(-wire.chunk // self.replicas)
        packet = packet_bytes(piece, self.block, self.bits)
        copies = 4 * (replicas + 1) * piece  # the padded fp32 shard and this rank's chunk of the sum
        wait = max(self._summing(piece), packet + scratch_bytes(1, piece, self.block, self.bits),
                   (1 + replicas) * packet + decode_bytes(piece, self.block, self.bits))
        encoding = scratch_bytes(replicas, piece, self.block, self.bits)
        return copies + replicas * packet, encoding, copies + 2 * replicas * packet, wait
