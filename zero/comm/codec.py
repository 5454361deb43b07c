"""Collective codecs: how an all-gather or a reduce-scatter encodes what it moves.

Every all-gather and reduce-scatter of :class:`~zero.comm.communicator.Communicator` passes through its ``codec``. The
communicator checks devices and sizes, takes the world-of-one fast path (nothing sent, no codec involved),
counts the collective and wraps what the codec returns in a :class:`~zero.comm.handles.Handle` (timeout, abort,
time waited); the codec decides everything in between: the wire format (dtype, packing, scales) and, for a
reduction, the algorithm. It never calls ``torch.distributed``: the communicator hands it a
:class:`Transport`, the raw collectives over its group, and the codec composes them.

:class:`IdentityCodec`, the default, sends the tensors themselves, in one collective each. The others are ZeRO++'s
(Wang et al., 2023), over the block-wise int8 format of :mod:`zero.comm.quantization`, chosen by
``ZeroConfig.communication`` (:mod:`zero.comm.hierarchy` builds them; :class:`PerCollective` pairs one for each kind):

* **qwZ**, block-quantized weights (:class:`QuantizedWeights`): :meth:`Codec.all_gather` quantizes this rank's
  shard to int8 with one scale per block (e.g. 256 elements), all-gathers the int8 blocks and their scales, and on
  ``wait()`` dequantizes every other rank's chunk into ``output`` in the compute dtype. (All-gathers move
  parameters: stage 3's gathers, the only ones ``ZeroConfig`` lets it quantize; see ``zero.comm.policy``.)
* **qgZ**, quantized gradient reduction (:class:`QuantizedGradients`): :meth:`Codec.reduce_scatter` quantizes each
  destination's chunk of the gradients, exchanges them with one :meth:`Transport.all_to_all` (chunk ``r`` goes to
  rank ``r``) and, on ``wait()``, dequantizes the ``world_size`` chunks it received and sums them in fp32 into
  ``output``: one quantization per gradient, not one per hop as a quantized ring all-reduce would compound.
  (Reduce-scatters move gradients.)

Contract of a codec (``n`` is the chunk size; every rank calls it with the same sizes, in the same order):

* ``all_gather(output, input, transport)``: ``input`` (``n``) may be this rank's chunk of ``output``
  (``world_size * n``). When the returned work has been waited for, chunk ``r`` of ``output`` holds the codec's
  decoding of rank ``r``'s ``input``, and this rank's own chunk holds ``input`` exactly (left untouched when it
  aliases it: at stages 1-2 it is the shard the optimizer steps, the master weights without mixed precision).
* ``reduce_scatter(output, input, transport)``: ``output`` (``n``, possibly this rank's chunk of ``input``)
  receives this rank's chunk of the sum over ranks of ``input`` (``world_size * n``); ``input``'s other chunks
  are scratch afterwards.
* A lossy codec states its error bound; ``output`` keeps its dtype whatever the wire's is.
* Everything the codec sends goes through ``transport``, so that it is counted (see below). What it issues
  before returning goes out in launch order, as every collective; a second phase issued from :class:`Works`'
  ``then`` goes out when the handle is waited for, so it relies on every rank waiting for its handles in the
  same order too.

Counters: a collective's ``calls`` and ``numel`` in ``Communicator.stats`` are the ZeRO paper's payload (an
all-gather's output, a reduce-scatter's input, in elements: what the algorithm moves, whatever the codec), and
its ``bytes`` are the bytes on the wire, the sum of what its transport calls moved (an all-gather's output, a
reduce-scatter's and an all-to-all's input). With the identity codec ``bytes`` is ``numel`` times the element
size, as it always was; a codec that shrinks the payload shows it as ``bytes`` below that.

Price: a codec states what each of its collectives costs, as a function of the chunk ``n``, the group's size and
the payload's dtype (:meth:`Codec.gather_cost`, :meth:`Codec.reduce_scatter_cost`, :meth:`Codec.all_reduce_cost`,
each a :class:`Cost`): the bytes on the wire (what the counters count) and what it holds on the device beside the
tensors it is given. The estimator (``zero.estimator.traffic``, ``zero.estimator.codec_memory``) asks the codec that
``zero.comm.hierarchy.codec_of`` builds for the policy, so a new codec is priced without touching the estimator;
``ZeroConfig.communication`` names one by import path (``gather_codec``, ``reduce_codec``; ``zero.comm.policy``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Protocol, Union

import torch

import zero.comm.quantization as quantization


class Work(Protocol):
    """An in-flight operation: ``torch.distributed``'s async work, or a :class:`Works`."""

    def wait(self, timeout: datetime.timedelta) -> object: ...


class Works:
    """Several works waited on as one; ``then`` runs once they have completed (a codec decodes there).

    ``then`` may return another work (a codec's second phase, see the module's contract), waited for too.
    ``holds``: buffers the collectives read, kept until the works are waited for, as NCCL's works keep their inputs
    (so a codec holds the same memory on every backend, the memory the estimator prices).
    """

    def __init__(self, works: list[Work], then: Callable[[], Work | None] | None = None,
                 holds: tuple[torch.Tensor, ...] = ()):
        self.works = works
        self.then = then
        self.holds = holds

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self.works:
            work.wait(timeout=timeout)
        if self.then is not None:
            more = self.then()
            if more is not None:
                more.wait(timeout=timeout)


class Transport(Protocol):
    """The raw collectives over one communicator's group, for a codec to compose (:mod:`zero.comm.communicator`
    implements it).

    Each call starts one asynchronous collective and adds its payload's bytes to the current collective's
    ``bytes`` (bytes on the wire). Tensors are 1D, contiguous, on ``device``; sizes are checked, dtypes are the
    caller's (any dtype the backend moves: gloo and NCCL move int8 and bfloat16).
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``world_size`` times larger); ``input`` may alias
        this rank's chunk of ``output``. Counts ``output``."""
        ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Sum ``input`` over ranks into ``output`` (this rank's chunk; it may alias that chunk of ``input``);
        afterwards the rest of ``input`` is unspecified. Counts ``input``."""
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Chunk ``r`` of ``input`` goes to rank ``r``; chunk ``r`` of ``output`` (same size as ``input``, not
        aliasing it) comes from rank ``r``. Counts ``input``."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        """Sum ``tensor`` over ranks, in place. Counts ``tensor``."""
        ...


@dataclass(frozen=True)
class Cost:
    """What one collective through a codec costs the rank that issues it, in bytes (see the module's docstring).

    Memory is what the codec allocates beside the tensors it is given, on their device, in four moments: while it
    encodes before launching (``encoding``, what it will send, and besides it the ``scratch`` it encodes through),
    from the launch until the work is waited for (``held``: what it sends and receives), and besides that at the
    wait while it decodes (``decoding``). The estimator prices every moment of a reduction's, and an all-gather's
    ``held`` from its start and ``decoding`` at its wait."""

    wire: int  # bytes its transport calls move: Communicator.stats' "bytes" of the collective
    dtype: Union[str, torch.dtype]  # on the wire, as the estimate's traffic names it: "int8", or the payload's dtype
    encoding: int = 0
    scratch: int = 0
    held: int = 0
    decoding: int = 0


class Codec:
    """How the all-gathers and reduce-scatters of a :class:`~zero.comm.communicator.Communicator` encode what they
    move (see the module's docstring for the contract). A subclass overrides the collectives it runs (each returns
    the work whose ``wait()`` completes it) and the price of each (``*_cost``; the estimator asks for it)."""

    exact_gather = True  # False: all-gathers are lossy (values gathered for training are not the shards')

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        raise NotImplementedError(f"{type(self).__name__} does not run all-gathers: implement all_gather")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        raise NotImplementedError(f"{type(self).__name__} does not run reduce-scatters: implement reduce_scatter")

    def all_reduce(self, tensor: torch.Tensor, transport: Transport) -> Work:
        """Sum gradients over ranks in place, every rank ending with the same values (hierarchical sharding's
        reduction of each shard across the groups)."""
        raise NotImplementedError(f"{type(self).__name__} does not run all-reduces (HSDP's sum across the groups): "
                                  "implement all_reduce, or leave shard_size unset")

    def gather_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """An all-gather of chunks of ``n`` elements of ``dtype`` over ``group`` ranks."""
        raise NotImplementedError(f"{type(self).__name__} does not price its all-gathers: implement gather_cost")

    def reduce_scatter_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """A reduce-scatter of ``group * n`` elements of ``dtype`` over ``group`` ranks (``n`` to each)."""
        raise NotImplementedError(f"{type(self).__name__} does not price its reduce-scatters: implement "
                                  "reduce_scatter_cost")

    def all_reduce_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """An all-reduce of ``n`` elements of ``dtype`` over ``group`` ranks."""
        raise NotImplementedError(f"{type(self).__name__} does not price its all-reduces: implement all_reduce_cost")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class IdentityCodec(Codec):
    """The tensors as they are, one collective each: exact, and the bytes on the wire are the payload's; it holds
    nothing besides."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        return transport.all_gather(output, input)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        return transport.reduce_scatter(output, input)

    def all_reduce(self, tensor: torch.Tensor, transport: Transport) -> Work:
        return transport.all_reduce(tensor)

    def gather_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return Cost(group * n * dtype.itemsize, dtype)

    def reduce_scatter_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return Cost(group * n * dtype.itemsize, dtype)

    def all_reduce_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return Cost(n * dtype.itemsize, dtype)


class BlockQuantized(IdentityCodec):
    """A codec over :mod:`zero.comm.quantization`'s blocks of ``block`` elements, ``bits`` per value (8, or 4), what the
    identity does otherwise."""

    def __init__(self, block: int, bits: int = 8):
        self.block, self.bits = block, bits

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block}, bits={self.bits})"

    @property
    def wire_dtype(self) -> str:
        return f"int{self.bits}"  # (blocks of int8 or int4 values, each with one fp32 scale)

    def _packet(self, n: int) -> int:
        return quantization.packet_bytes(n, self.block, self.bits)

    def _summing(self, n: int) -> int:
        """Decoding and summing packets of ``n`` elements (:meth:`_sum_into`): the fp32 sum's slice and one decoded
        slice."""
        return quantization.scratch_bytes(1, n, self.block) + quantization.decode_bytes(n, self.block, self.bits)

    def _sum_into(self, output: torch.Tensor, received: torch.Tensor, own: torch.Tensor, rank: int) -> None:
        """``output`` (``n`` elements, any dtype) := the fp32 sum, in rank order, of the packets ``received`` (one per
        rank, of chunks of ``n``), with this rank's chunk ``own`` (exact; ``output`` may alias it) in place of its
        packet. A slice at a time (:func:`zero.comm.quantization.slices`): the scratch stays small."""
        n = output.numel()
        packets = received.view(-1, quantization.packet_bytes(n, self.block, self.bits))
        for start, stop in quantization.slices(n, self.block):  # (no slice outlives its iteration)
            output[start:stop].copy_(self._slice_sum(packets, own, rank, n, start, stop))

    def _slice_sum(self, packets: torch.Tensor, own: torch.Tensor, rank: int, n: int, start: int,
                   stop: int) -> torch.Tensor:
        total = torch.zeros(stop - start, dtype=torch.float32, device=own.device)
        for r, packet in enumerate(packets):
            total += own[start:stop] if r == rank else quantization.decode(packet, n, self.block, start, stop,
                                                                           self.bits)
        return total


class QuantizedWeights(BlockQuantized):
    """ZeRO++'s qwZ: all-gathers move block-quantized int8 (:mod:`zero.comm.quantization`, a scale per ``block``
    elements), decoded into the output's dtype; reduce-scatters are the identity's.

    Bytes on the wire per element: ``1 + 4 / block`` instead of the dtype's size (about 0.27 of fp32's and 0.52 of
    bfloat16's at ``block = 256``). Bound: every element of another rank's chunk decodes within
    ``quantization.error_bound`` (``max|x| / 254`` and a little, over its block), then rounds once into the output's
    dtype; this rank's own chunk is exact (the codec contract)."""

    exact_gather = False

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        world, rank, n = transport.world_size, transport.rank, input.numel()
        size = quantization.packet_bytes(n, self.block)
        send = torch.empty(1, size, dtype=torch.uint8, device=input.device)
        quantization.encode(input.view(1, n), self.block, send)
        mine = output.narrow(0, rank * n, n)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        received = torch.empty(world * size, dtype=torch.uint8, device=input.device)
        work = transport.all_gather(received, send.view(-1))

        def decode() -> None:
            for r, packet in enumerate(received.view(world, size)):
                for start, stop in quantization.slices(n, self.block) if r != rank else ():
                    output[r * n + start : r * n + stop].copy_(quantization.decode(packet, n, self.block, start, stop))

        return Works([work], decode, holds=(send,))

    def gather_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """Its packet and the group's, from the start to the wait; one fp32 slice to encode, one to decode."""
        packet = self._packet(n)
        return Cost(group * packet, self.wire_dtype, encoding=packet,
                    scratch=quantization.scratch_bytes(1, n, self.block), held=(1 + group) * packet,
                    decoding=quantization.decode_bytes(n, self.block))


class QuantizedGradients(BlockQuantized):
    """ZeRO++'s qgZ: a reduce-scatter is one all-to-all of block-quantized int8 chunks (chunk ``r`` of every rank
    goes to rank ``r``, :mod:`zero.comm.quantization`), decoded and summed in fp32 on the receiver in rank order, with
    this rank's own chunk exact: each gradient is quantized once, not once per hop as a quantized ring all-reduce
    would compound. All-gathers are the identity's.

    With ``bits=4`` (``Communication.gradient_bits``) two values share a byte: about half the bytes, and a bound
    of ``max|x_r| / 14`` in place of ``/ 254``.

    Bound: each element of the result is within the sum, over the other ranks, of ``quantization.error_bound`` of
    their chunk (``max|x_r| / 254`` and a little, over the element's block), plus fp32 rounding of ``world_size``
    additions, then one rounding into the output's dtype."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        world, rank, n = transport.world_size, transport.rank, output.numel()
        size = quantization.packet_bytes(n, self.block, self.bits)
        send = torch.empty(world, size, dtype=torch.uint8, device=input.device)
        quantization.encode(input.view(world, n), self.block, send, self.bits)
        received = torch.empty(world * size, dtype=torch.uint8, device=input.device)
        work = transport.all_to_all(received, send.view(-1))

        def decode() -> None:  # (input stays as it is until the work is waited for, as every collective's)
            self._sum_into(output, received, input.narrow(0, rank * n, n), rank)

        return Works([work], decode, holds=(send,))

    def all_reduce(self, tensor: torch.Tensor, transport: Transport) -> Work:
        """qgZ's reduction, then its result shared quantized too: rank ``r`` sums chunk ``r`` (:meth:`reduce_scatter`
        of the tensor padded to ``world_size`` chunks), quantizes the sum, and every rank (``r`` included) decodes
        every chunk's packet, so that every rank holds the same values. Bound: the reduce-scatter's, plus one
        quantization of the sum (``quantization.error_bound`` of it)."""
        world, n = transport.world_size, tensor.numel()
        chunk = -(-n // world)
        padded = torch.zeros(world * chunk, dtype=torch.float32, device=tensor.device)
        padded[:n] = tensor
        summed = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
        reduced = self.reduce_scatter(summed, padded, transport)
        size = quantization.packet_bytes(chunk, self.block, self.bits)

        def share_sum() -> Work:
            mine = torch.empty(1, size, dtype=torch.uint8, device=tensor.device)
            quantization.encode(summed.view(1, chunk), self.block, mine, self.bits)
            gathered = torch.empty(world * size, dtype=torch.uint8, device=tensor.device)

            def decode() -> None:
                for r, packet in enumerate(gathered.view(world, size)):
                    for start, stop in quantization.slices(max(0, min(chunk, n - r * chunk)), self.block):
                        part = tensor[r * chunk + start : r * chunk + stop]
                        part.copy_(quantization.decode(packet, chunk, self.block, start, stop, self.bits))

            return Works([transport.all_gather(gathered, mine.view(-1))], decode, holds=(mine,))

        return Works([reduced], share_sum)

    def reduce_scatter_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """The ``group`` packets it sends, encoded through one fp32 slice of ``group`` rows, then also the ``group``
        it receives; at the wait, the sum's fp32 slice and one decoded slice."""
        packets = group * self._packet(n)
        return Cost(packets, self.wire_dtype, encoding=packets,
                    scratch=quantization.scratch_bytes(group, n, self.block, self.bits), held=2 * packets,
                    decoding=self._summing(n))

    def all_reduce_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        """The padded fp32 copy and this rank's chunk of the sum (``piece = ceil(n / group)`` elements), with the
        reduce-scatter's packets; at the wait the most of decoding the sum, encoding this rank's chunk of it, and
        sharing and decoding every chunk's (:meth:`all_reduce`)."""
        piece = -(-n // group)
        packet = self._packet(piece)
        copies = 4 * (group + 1) * piece
        wait = max(self._summing(piece), packet + quantization.scratch_bytes(1, piece, self.block, self.bits),
                   (1 + group) * packet + quantization.decode_bytes(piece, self.block, self.bits))
        return Cost(2 * group * packet, self.wire_dtype, encoding=copies + group * packet,
                    scratch=quantization.scratch_bytes(group, piece, self.block, self.bits),
                    held=copies + 2 * group * packet, decoding=wait)


class PerCollective(Codec):
    """All-gathers through ``gather``, reduce-scatters through ``reduce`` (e.g. qwZ and qgZ together)."""

    def __init__(self, gather: Codec, reduce: Codec):
        self.gather, self.reduce = gather, reduce
        self.exact_gather = gather.exact_gather

    def __repr__(self) -> str:
        return f"{type(self).__name__}(gather={self.gather!r}, reduce={self.reduce!r})"

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        return self.gather.all_gather(output, input, transport)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, transport: Transport) -> Work:
        return self.reduce.reduce_scatter(output, input, transport)

    def all_reduce(self, tensor: torch.Tensor, transport: Transport) -> Work:
        return self.reduce.all_reduce(tensor, transport)

    def gather_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return self.gather.gather_cost(n, group, dtype)

    def reduce_scatter_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return self.reduce.reduce_scatter_cost(n, group, dtype)

    def all_reduce_cost(self, n: int, group: int, dtype: torch.dtype) -> Cost:
        return self.reduce.all_reduce_cost(n, group, dtype)
