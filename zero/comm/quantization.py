"""Block-wise absmax int8 quantization: the wire format of ZeRO++'s quantized collectives (:mod:`zero.comm.codec`).

A chunk of ``n`` elements is cut into blocks of ``block`` elements (the last one padded with zeros). Each block
is sent as ``block`` int8 values ``q = round(x / s)`` and one fp32 scale ``s = max|x| / 127`` (absmax, symmetric),
so an element decodes to ``s * q``. One chunk's *packet* is its values then its scales, as bytes (``uint8``)::

    [ blocks * block int8 values | padding to 4 bytes | blocks fp32 scales ]

so that chunks from several ranks sit back to back in one buffer and move in one collective. Encoding and decoding
work through a slice of blocks at a time (:data:`SLICE` elements), so their fp32 scratch is about 1 MiB at most,
whatever the size of the tensor (``scratch_bytes``; a whole bucket's, in fp32, would be four times its int8 packets).

With ``bits=4`` (``Communication.gradient_bits``) each value is one of ``-7..7`` and two share a byte (offset by 8,
the first in the low nibble), with ``s = max|x| / 7``: half the values' bytes, and a bound of ``max|x| / 14``
instead of ``max|x| / 254`` (the same rounding allowance besides). The block size must then be even.

Bound: rounding to the nearest step of ``s`` errs by at most ``s / 2 = max|x| / 254``; the fp32 arithmetic of the
division and of ``s * q`` adds at most a few units in the last place of ``max|x|`` (:func:`error_bound` allows
``2**-21 * max|x|``), so every element decodes within ``max|x| * (1/254 + 2**-21)`` of its value, ``max|x|``
taken over its block. Decoding into a narrower dtype (bfloat16) rounds once more, in that dtype. A block holding
``inf`` or ``nan`` decodes to ``nan`` throughout (its scale is not finite), so an overflow is never hidden from the
loss scaler's check.
"""

from __future__ import annotations

from typing import Iterator

import torch

BITS = (8, 4)  # bits per value: int8, or int4 (two values per byte, low nibble first; the block size must be even)
SLICE = 2**18  # elements encoded or decoded at a time: 1 MiB of fp32 scratch, whatever the tensor
ROUNDING = 2.0**-21  # fp32 arithmetic in encoding and decoding, relative to the block's absmax (see the docstring)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def levels(bits: int) -> int:
    """The largest quantized magnitude: values are ``-levels..levels`` (127 for int8, 7 for int4)."""
    return 2 ** (bits - 1) - 1


def _values_bytes(n: int, block: int, bits: int = 8) -> int:
    return -(-num_blocks(n, block) * block * bits // 32) * 4  # (the scales start 4-byte aligned)


def packet_bytes(n: int, block: int, bits: int = 8) -> int:
    """Bytes of the packet of a chunk of ``n`` elements."""
    return _values_bytes(n, block, bits) + 4 * num_blocks(n, block)


def _spans(rows: int, blocks: int, block: int) -> Iterator[tuple[int, int]]:
    """Ranges of blocks, each at most about :data:`SLICE` elements over ``rows`` rows (at least one block)."""
    step = max(1, SLICE // (rows * block))
    return ((b, min(blocks, b + step)) for b in range(0, blocks, step))


def encode(chunks: torch.Tensor, block: int, out: torch.Tensor, bits: int = 8) -> None:
    """Quantize each row of ``chunks`` (``rows x n``, any floating dtype) into its packet, the same row of ``out``
    (``rows x packet_bytes(n, block, bits)``, ``uint8``). A slice of blocks at a time: the fp32 scratch stays under
    about :data:`SLICE` elements (``scratch_bytes``), whatever the size."""
    rows, n = chunks.shape
    blocks, per = num_blocks(n, block), block * bits // 8  # (bytes of values per block)
    scales = out[:, _values_bytes(n, block, bits):].view(torch.float32)
    out[:, blocks * per : _values_bytes(n, block, bits)].zero_()  # (the padding: packets are deterministic)
    for first, last in _spans(rows, blocks, block):  # (a function per slice: no slice outlives its iteration)
        values = out[:, first * per : last * per]
        _encode_blocks(chunks, block, bits, first, last, values, scales[:, first:last])


def _encode_blocks(chunks: torch.Tensor, block: int, bits: int, first: int, last: int, values: torch.Tensor,
                   scales: torch.Tensor) -> None:
    """Blocks ``first:last`` of every row of ``chunks`` into their ``values`` (bytes) and ``scales`` (fp32)."""
    rows, n = chunks.shape
    start, stop = first * block, min(n, last * block)
    if stop - start < (last - first) * block:  # the last block, padded with zeros
        piece = torch.zeros(rows, (last - first) * block, dtype=torch.float32, device=chunks.device)
        piece[:, : stop - start] = chunks[:, start:stop]
    else:
        piece = chunks[:, start:stop].to(torch.float32, copy=True)  # (scaled and rounded in place below)
    piece = piece.view(rows, last - first, block)
    low, high = torch.aminmax(piece, dim=2)
    top = levels(bits)
    scale = torch.maximum(high, low.neg()).div_(top)  # rows x blocks: absmax / 127 (int4: / 7)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block: q = 0, any scale
    piece.div_(safe.unsqueeze(2)).round_().clamp_(-top, top)
    if bits == 8:
        values.view(torch.int8).copy_(piece.view(rows, -1))  # (integers: exact)
    else:  # two values a byte, each offset by 8 into 1..15, the first in the low nibble
        q = piece.view(rows, -1).add_(8).to(torch.uint8)
        values.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
    scales.copy_(scale)


def slices(n: int, block: int) -> Iterator[tuple[int, int]]:
    """A chunk of ``n`` elements as ranges ``(start, stop)`` of whole blocks, each at most about :data:`SLICE`
    elements: what :func:`decode` takes at a time."""
    return ((first * block, min(n, last * block)) for first, last in _spans(1, num_blocks(n, block), block))


def decode(packet: torch.Tensor, n: int, block: int, start: int, stop: int, bits: int = 8) -> torch.Tensor:
    """The fp32 values of elements ``start:stop`` (a range of :func:`slices`) of one packet (``packet_bytes(n,
    block, bits)`` bytes, ``uint8``)."""
    first, last = start // block, num_blocks(stop, block)
    per = block * bits // 8
    scales = packet[_values_bytes(n, block, bits):].view(torch.float32)[first:last].unsqueeze(1)
    raw = packet[first * per : last * per]
    if bits == 8:
        values = raw.view(torch.int8).to(torch.float32)
    else:
        values = torch.stack((raw & 15, raw >> 4), dim=1).view(-1).to(torch.float32).sub_(8)
    values = values.view(last - first, block).mul_(scales).masked_fill_(~scales.isfinite(), float("nan"))
    return values.view(-1)[: stop - start]


def _slice_elements(rows: int, n: int, block: int) -> int:
    return rows * block * min(num_blocks(n, block), max(1, SLICE // (rows * block)))


def scratch_bytes(rows: int, n: int, block: int, bits: int = 8) -> int:
    """The most :func:`encode` holds besides its output for ``rows x n`` (what the estimator prices): its largest
    fp32 slice, and with int4 that slice's values as bytes while they are packed (2 bytes an element more)."""
    return (4 + 2 * (bits == 4)) * _slice_elements(rows, n, block)


def decode_bytes(n: int, block: int, bits: int = 8) -> int:
    """The most :func:`decode` holds for a packet of ``n`` elements: its largest slice of fp32 values, and with int4
    the slice's unpacked bytes (1 byte an element more)."""
    return (4 + (bits == 4)) * _slice_elements(1, n, block)


def error_bound(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """The largest error :func:`decode` may make on each element of ``x`` (1D) after :func:`encode` (fp32
    decoding): ``max|x| * (1/254 + 2**-21)`` (int4: ``1/14``), ``max|x|`` over the element's block."""
    n = x.numel()
    padded = torch.zeros(num_blocks(n, block) * block, dtype=torch.float64)
    padded[:n] = x.double().abs()
    absmax = padded.view(-1, block).amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)[:n]
    return absmax * (1 / (2 * levels(bits)) + ROUNDING)
