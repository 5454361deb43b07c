"""Block-wise absmax int8 quantization: the wire format of ZeRO++'s quantized collectives (:mod:`zero.codec`).

A chunk of ``n`` elements is cut into blocks of ``block`` elements (the last one padded with zeros). Each block
is sent as ``block`` int8 values ``q = round(x / s)`` and one fp32 scale ``s = max|x| / 127`` (absmax, symmetric),
so an element decodes to ``s * q``. One chunk's *packet* is its values then its scales, as bytes (``uint8``)::

    [ blocks * block int8 values | padding to 4 bytes | blocks fp32 scales ]

so that chunks from several ranks sit back to back in one buffer and move in one collective.

Bound: rounding to the nearest step of ``s`` errs by at most ``s / 2 = max|x| / 254``; the fp32 arithmetic of the
division and of ``s * q`` adds at most a few units in the last place of ``max|x|`` (:func:`error_bound` allows
``2**-21 * max|x|``), so every element decodes within ``max|x| * (1/254 + 2**-21)`` of its value, ``max|x|``
taken over its block. Decoding into a narrower dtype (bfloat16) rounds once more, in that dtype. A block holding
``inf`` or ``nan`` decodes to ``nan`` throughout (its scale is not finite), so an overflow is never hidden from the
loss scaler's check.
"""

from __future__ import annotations

import torch

LEVELS = 127  # int8, symmetric: -127..127
ROUNDING = 2.0**-21  # fp32 arithmetic in encoding and decoding, relative to the block's absmax (see the docstring)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _values_bytes(n: int, block: int) -> int:
    return -(-num_blocks(n, block) * block // 4) * 4  # (the scales start 4-byte aligned)


def packet_bytes(n: int, block: int) -> int:
    """Bytes of the packet of a chunk of ``n`` elements."""
    return _values_bytes(n, block) + 4 * num_blocks(n, block)


def encode(chunks: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """Quantize each row of ``chunks`` (``rows x n``, any floating dtype) into its packet, the same row of ``out``
    (``rows x packet_bytes(n, block)``, ``uint8``)."""
    rows, n = chunks.shape
    blocks = num_blocks(n, block)
    if n % block:
        padded = torch.zeros(rows, blocks * block, dtype=torch.float32, device=chunks.device)
        padded[:, :n] = chunks
    else:
        padded = chunks.to(torch.float32, copy=True)  # (scratch: scaled and rounded in place below)
    padded = padded.view(rows, blocks, block)
    scales = padded.abs().amax(dim=2) / LEVELS  # rows x blocks: absmax / 127
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero block: q = 0, any scale
    padded.div_(safe.unsqueeze(2)).round_().clamp_(-LEVELS, LEVELS)
    out[:, : blocks * block].view(torch.int8).unflatten(1, (blocks, block)).copy_(padded)  # (integers: exact)
    out[:, _values_bytes(n, block):].view(torch.float32).copy_(scales)


def decode(packets: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The fp32 values (``rows x n``) of the packets (``rows x packet_bytes(n, block)``, ``uint8``)."""
    rows = packets.shape[0]
    blocks = num_blocks(n, block)
    decoded = packets[:, : blocks * block].view(torch.int8).reshape(rows, blocks, block).to(torch.float32)
    scales = packets[:, _values_bytes(n, block):].view(torch.float32)
    decoded.mul_(scales.unsqueeze(2)).masked_fill_(~scales.isfinite().unsqueeze(2), float("nan"))
    return decoded.view(rows, blocks * block)[:, :n]


def error_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """The largest error :func:`decode` may make on each element of ``x`` (1D) after :func:`encode` (fp32
    decoding): ``max|x| * (1/254 + 2**-21)``, ``max|x|`` over the element's block."""
    n = x.numel()
    padded = torch.zeros(num_blocks(n, block) * block, dtype=torch.float64)
    padded[:n] = x.double().abs()
    absmax = padded.view(-1, block).amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)[:n]
    return absmax * (1 / (2 * LEVELS) + ROUNDING)
