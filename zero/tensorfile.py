"""Tensor files in the safetensors layout, written and read one tensor (and one chunk) at a time.

A file is an 8-byte little-endian header length, a JSON header (``{key: {"dtype", "shape",
"data_offsets"}}``, plus ``"__metadata__"`` of strings), padded with spaces to a multiple of 8,
then the tensors' bytes back to back. That is the format Hugging Face loads, and any
safetensors reader reads what is written here. It holds no code: reading one never runs
anything (unlike a pickle).

Writing is streamed: the header is computed from the tensors' shapes and dtypes first, then
each tensor is copied to the file in chunks of at most :data:`CHUNK_BYTES` (device tensors
are copied to the host a chunk at a time), with a CRC-32 of each tensor's bytes computed on
the way (on a second thread, overlapping the writes). The caller gets, per key, the tensor's absolute byte offset in the file, its size and
its CRC, which is what reading a range and verifying need.
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable

import torch

CHUNK_BYTES = 64 * 2**20
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Spec:
    """A tensor to be written: its key, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Entry:
    """Where a written tensor lies in its file (absolute ``offset``, ``nbytes``) and the CRC-32 of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int

    def to_json(self) -> list:
        return [self.dtype, list(self.shape), self.offset, self.nbytes, self.crc32]

    @classmethod
    def from_json(cls, value: list) -> "Entry":
        dtype, shape, offset, nbytes, crc = value
        if dtype not in DTYPES:
            raise ValueError(f"unknown tensor dtype {dtype!r}")
        return cls(dtype, tuple(int(s) for s in shape), int(offset), int(nbytes), int(crc))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"tensors of dtype {dtype} cannot be written to a tensor file")
    return DTYPE_CODES[dtype]


def write(
    path: str | os.PathLike,
    specs: list[Spec],
    tensors: Iterable[torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Entry]:
    """Write ``tensors`` (one per spec, in order, produced lazily) to ``path``; fsync it; return the entries.
    ``on_bytes(n)`` is called as each chunk of ``n`` bytes is written (progress)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    start = 0
    for spec in specs:
        header[spec.key] = {"dtype": dtype_code(spec.dtype), "shape": list(spec.shape), "data_offsets": [start, start + spec.nbytes]}
        start += spec.nbytes
    if len(header) != len(specs) + 1:
        raise ValueError("tensor file keys must be unique")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    entries: dict[str, Entry] = {}
    with open(path, "wb") as f, ThreadPoolExecutor(1) as crcs:
        f.write(len(text).to_bytes(8, "little") + text)
        position = 0
        for spec, tensor in zip(specs, tensors, strict=True):
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{spec.key}: got {tensor.dtype} {tuple(tensor.shape)}, expected {spec.dtype} {spec.shape}")
            crc = _write_tensor(f, tensor, crcs, on_bytes)
            entries[spec.key] = Entry(dtype_code(spec.dtype), spec.shape, base + position, spec.nbytes, crc)
            position += spec.nbytes
        f.flush()
        os.fsync(f.fileno())
    return entries


def _write_tensor(f: BinaryIO, tensor: torch.Tensor, crcs: ThreadPoolExecutor, on_bytes: Callable[[int], None] | None) -> int:
    """Stream one tensor's bytes to ``f`` chunk by chunk; return their CRC-32. Each chunk's CRC is computed on
    another thread while the chunk is written (both release the GIL)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, CHUNK_BYTES // max(1, flat.element_size()))
    crc: Future | None = None
    for lo in range(0, flat.numel(), step):
        chunk = flat[lo : lo + step].to("cpu").contiguous().view(torch.uint8).numpy()
        crc = crcs.submit(zlib.crc32, chunk.data, crc.result() if crc is not None else 0)
        f.write(chunk.data)
        if on_bytes is not None:
            on_bytes(chunk.nbytes)
    return crc.result() if crc is not None else 0


def read_bytes(f: BinaryIO, offset: int, nbytes: int, what: str) -> torch.Tensor:
    """``nbytes`` bytes of ``f`` at ``offset`` as a new uint8 tensor; a short read names ``what``."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(offset)
    got = f.readinto(memoryview(out.numpy()))
    if got != nbytes:
        raise ValueError(f"{what} is truncated: wanted {nbytes} bytes at offset {offset}, the file holds {got}")
    return out


def read_into(f: BinaryIO, entry: Entry, start: int, out: torch.Tensor, what: str, *, crc: bool = False) -> int | None:
    """Copy elements ``[start, start + out.numel())`` of the flattened tensor ``entry`` into ``out`` (1D, any
    dtype or device). Read straight into ``out`` when it is a contiguous CPU tensor of the entry's dtype, else
    through a host buffer. With ``crc``, returns the CRC-32 of the bytes read when they are the whole entry."""
    dtype = entry.torch_dtype
    offset, nbytes = entry.offset + start * dtype.itemsize, out.numel() * dtype.itemsize
    direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    if direct:
        raw = out.view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
        f.seek(offset)
        got = f.readinto(memoryview(raw.numpy()))
        if got != nbytes:
            raise ValueError(f"{what} is truncated: wanted {nbytes} bytes at offset {offset}, the file holds {got}")
    else:
        raw = read_bytes(f, offset, nbytes, what)
        out.copy_(raw.view(dtype))
    return zlib.crc32(raw.numpy().data) if crc and nbytes == entry.nbytes else None


def crc32_of(mapped: mmap.mmap, entry: Entry) -> int:
    """The CRC-32 of an entry's bytes, read in place from the memory-mapped file (no copy)."""
    with memoryview(mapped) as view:
        return zlib.crc32(view[entry.offset : entry.offset + entry.nbytes])
