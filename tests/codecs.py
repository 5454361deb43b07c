"""A test double for the collective codec seam (``zero.comm.codec``): lossy in a known, bounded way, and counting.

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
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from zero.comm.codec import Codec, Transport, Work, Works

WIRE = torch.bfloat16
REL = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits
FP32_REL = 2.0**-23  # a little over fp32's unit roundoff (2**-24) per addition, covering the rounded terms' growth
TINY = 2.0**-133  # half of bfloat16's smallest subnormal: the absolute error near zero


class Bf16WireCodec(Codec):
    """Every element crosses the wire as bfloat16 (see the module's docstring for the bound). ``calls`` and
    ``numel`` count, per kind (``"all_gather"``, ``"reduce_scatter"``), the collectives it encoded and their
    payload (an all-gather's output, a reduce-scatter's input, as ``Communicator.stats``); :meth:`reset` clears
    them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.numel: Counter[str] = Counter()

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

        def decode() -> None:
            chunks = received.view(transport.world_size, output.numel()).to(torch.float32)
            output.copy_(chunks.sum(0))

        return Works([work], decode)


def gather_bound(exact: torch.Tensor) -> torch.Tensor:
    """The largest error the double's all-gather may make on each element of another rank's chunk."""
    return REL * exact.double().abs() + TINY


def reduce_bound(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest error the double's reduce-scatter may make on each element of the sum of ``inputs`` (one
    tensor per rank, the chunk reduced)."""
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    return (REL + len(inputs) * FP32_REL) * magnitude + TINY
