"""Test codecs for the collective codec seam (``zero.comm.codec``): lossy in a known, bounded way, counting, and
recording what they held, so that a test compares it with the price each states (``Codec.gather_cost``, ...).
Both are also named by import path in a ``ZeroConfig.communication`` (``"tests.codecs:Fp8Gather"`` as
``gather_codec``, ``"tests.codecs:Bf16WireCodec"`` as ``reduce_codec``): one class each, run by the runtime and priced
by the estimator with no change to either.

:class:`Bf16WireCodec` sends every element as bfloat16 and decodes it back to the output's dtype, with the shape
of ZeRO++'s codecs (issue 27): the all-gather moves this rank's shard in the wire dtype and decodes the other
ranks' chunks on ``wait()``; the reduce-scatter is qgZ's algorithm, one all-to-all of the wire chunks (chunk ``r``
to rank ``r``) and the ``world_size`` received chunks summed in fp32 on the receiver.

Its bound, for fp32 outputs and finite values within bfloat16's range (``bfloat16`` keeps 8 significant bits and
fp32's exponent range; rounding to nearest errs by at most half a unit in the last place):

* all-gather: each element of another rank's chunk within ``REL * |x|`` (+ ``TINY``) of its exact value ``x``;
  this rank's own chunk exact (the codec contract);
* reduce-scatter: each element within ``(REL + world_size * FP32_REL) * sum_r |x_r|`` (+ ``TINY``) of the exact
  sum ``sum_r x_r`` (one rounding per term, then fp32 additions).

:class:`Fp8Gather` is the all-gather a new codec would be (issue 43): each rank's chunk crosses the wire as float8
(e4m3) scaled by its absmax, one fp32 scale per chunk; see :func:`fp8_bound` for its bound.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from zero.comm.codec import Codec, Cost, Transport, Work, Works

WIRE = torch.bfloat16
REL = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits
FP32_REL = 2.0**-23  # a little over fp32's unit roundoff (2**-24) per addition, covering the rounded terms' growth
TINY = 2.0**-133  # half of bfloat16's smallest subnormal: the absolute error near zero
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: a chunk's absmax maps to it
FP8_REL = 2.0**-4  # e4m3's unit roundoff: 4 significant bits
FP8_TINY = 2.0**-10  # half of e4m3's smallest subnormal (2**-9), in units of the chunk's scale


class Bf16WireCodec(Codec):
    """Every element crosses the wire as bfloat16 (see the module's docstring for the bound). ``calls`` and
    ``numel`` count, per kind (``"all_gather"``, ``"reduce_scatter"``), the collectives it encoded and their
    payload (an all-gather's output, a reduce-scatter's input, as ``Communicator.stats``); :meth:`reset` clears
    them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.numel: Counter[str] = Counter()
        self.held: set[tuple] = set()  # reduce-scatters: (n, group, dtype, bytes held in flight, bytes decoding)

    def reset(self) -> None:
        self.calls.clear()
        self.numel.clear()

    def counts(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": self.calls[kind], "numel": self.numel[kind]} for kind in sorted(self.calls)}

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        self.calls["all_gather"] += 1
        self.numel["all_gather"] += output.numel()
        world, rank, n = transport.world_size, transport.rank, input.numel()
        mine = output.narrow(0, rank * n, n)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)  # this rank's chunk exact, whatever crosses the wire
        wire = torch.empty(world * n, dtype=WIRE, device=output.device)
        work = transport.all_gather(wire, input.to(WIRE))

        def decode() -> None:
            for r in range(world):
                if r != rank:
                    output.narrow(0, r * n, n).copy_(wire.narrow(0, r * n, n))

        return Works([work], decode)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        self.calls["reduce_scatter"] += 1
        self.numel["reduce_scatter"] += input.numel()
        send = input.to(WIRE)  # a copy unless input is bfloat16 already: output may alias a chunk of input
        received = torch.empty_like(send)
        work = transport.all_to_all(received, send)
        world, n = transport.world_size, output.numel()
        held = received.nbytes + (send.nbytes if send.data_ptr() != input.data_ptr() else 0)

        def decode() -> None:
            chunks = received.view(world, n).to(torch.float32)
            summed = chunks.sum(0)
            self.held.add((n, world, str(input.dtype), held, chunks.nbytes + summed.nbytes))
            output.copy_(summed)

        return Works([work], decode, holds=(send,))

    def reduce_scatter_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """What :meth:`reduce_scatter` sends (bfloat16) and holds: a bfloat16 copy of the input unless it is one, and
        as much received; at the wait the received chunks in fp32 and their sum."""
        wire = group * n * WIRE.itemsize
        send = 0 if dtype == WIRE else wire
        return Cost(wire, WIRE, encoding=send, held=send + wire, decoding=4 * (group + 1) * n)


def fp8_packet(n: int) -> int:
    """Bytes of :class:`Fp8Gather`'s packet of ``n`` elements: one byte each, padded to 4, then the fp32 scale."""
    return -(-n // 4) * 4 + 4


class Fp8Gather(Codec):
    """All-gathers as float8 (e4m3): each rank sends its chunk of ``n`` elements divided by its scale (absmax / 448)
    as one byte each, then the scale (:func:`fp8_packet`); on ``wait()`` the other ranks' chunks are decoded into the
    output's dtype. Lossy (:func:`fp8_bound`), hence stage 3 only, as qwZ. It records, per all-gather, ``(n, group,
    dtype, bytes held in flight, bytes decoding)`` in ``held``."""

    exact_gather = False

    def __init__(self) -> None:
        self.held: set[tuple] = set()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        world, rank, n = transport.world_size, transport.rank, input.numel()
        size = fp8_packet(n)
        send = torch.zeros(size, dtype=torch.uint8, device=input.device)  # (the padding zero: deterministic)
        low, high = torch.aminmax(input)
        scale = torch.maximum(high, low.neg()).to(torch.float32).div_(FP8_MAX)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        send[size - 4 :].view(torch.float32).copy_(scale.view(1))
        send[:n].view(FP8).copy_(input.to(torch.float32, copy=True).div_(scale))  # (the fp32 copy: its scratch)
        mine = output.narrow(0, rank * n, n)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        received = torch.empty(world * size, dtype=torch.uint8, device=input.device)
        work = transport.all_gather(received, send)

        def decode() -> None:
            decoded = 0
            for r, packet in enumerate(received.view(world, size)):
                if r != rank:
                    values = packet[:n].view(FP8).to(torch.float32).mul_(packet[size - 4 :].view(torch.float32))
                    output.narrow(0, r * n, n).copy_(values)
                    decoded = values.nbytes
            self.held.add((n, world, str(input.dtype), send.nbytes + received.nbytes, decoded))

        return Works([work], decode, holds=(send,))

    def gather_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """Its packet and the group's from the start to the wait; one fp32 copy of the chunk to encode through, and
        one decoded chunk at a time."""
        packet = fp8_packet(n)
        return Cost(group * packet, "fp8", encoding=packet, scratch=4 * n, held=(1 + group) * packet, decoding=4 * n)


def fp8_bound(chunk: torch.Tensor) -> torch.Tensor:
    """The largest error :class:`Fp8Gather` may make on each element of another rank's ``chunk`` (fp32 output):
    ``FP8_REL`` of it (normal values), or ``FP8_TINY`` scales (subnormal ones), and fp32's roundings of the scale's
    division and product."""
    scale = chunk.double().abs().max() / FP8_MAX
    return FP8_REL * chunk.double().abs() + FP8_TINY * scale + 4 * FP32_REL * chunk.double().abs()


def gather_bound(exact: torch.Tensor) -> torch.Tensor:
    """The largest error the double's all-gather may make on each element of another rank's chunk."""
    return REL * exact.double().abs() + TINY


def reduce_bound(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest error the double's reduce-scatter may make on each element of the sum of ``inputs`` (one
    tensor per rank, the chunk reduced)."""
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    return (REL + len(inputs) * FP32_REL) * magnitude + TINY
