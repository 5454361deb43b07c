"""Tensor files in the safetensors layout, written and read one tensor (and one chunk) at a time.

A file is an 8-byte little-endian header length, a JSON header (``{key: {"dtype", "shape",
"data_offsets"}}``, plus ``"__metadata__"`` of strings), padded with spaces to a multiple of 8,
then the tensors' bytes back to back. That is the format Hugging Face loads, and any
safetensors reader reads what is written here. It holds no code: reading one never runs
anything (unlike a pickle).

Writing is streamed: the header is computed from the tensors' shapes and dtypes first, then
each tensor is copied to the file in chunks of at most :data:`CHUNK_BYTES` (device tensors
are copied to the host a chunk at a time), with a CRC-32 of each tensor's bytes computed on
the way (on a second thread, overlapping the writes). The caller gets, per key, the tensor's
absolute byte offset in the file, its size and its CRC, which is what reading a range and
verifying need.

**Checksums in the file.** Every file written here carries, in its header's ``__metadata__``,
``"zero.checksums"``: the CRC-32 of each tensor's bytes and the SHA-256 of the header's
description (each tensor's key, dtype, shape, offsets and CRC, and the other metadata). They are
written as fixed-width placeholders first and filled in once the bytes are written (same length,
so nothing moves). :func:`read_header` checks the header against the safetensors rules (known
dtypes, ``numel × itemsize`` bytes per tensor, the tensors tiling the rest of the file exactly)
and against that SHA-256, so a damaged header is refused before anything is allocated, and each
tensor's bytes can be checked against their CRC as they are read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable

import torch

CHUNK_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
CHECKSUMS = "zero.checksums"  # the __metadata__ key of the CRC-32s and the header's SHA-256
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_CRC_PLACEHOLDER = "0" * 8
_SHA_PLACEHOLDER = "0" * 64


def numel_of(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of ``shape`` (1 for ``()``)."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel


@dataclass(frozen=True)
class Spec:
    """A tensor to be written: its key, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel_of(self.shape) * self.dtype.itemsize


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

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return numel_of(self.shape)


@dataclass(frozen=True)
class Header:
    """A file's header: the entries (CRCs included), the ``__metadata__`` strings other than the checksums, and
    the SHA-256 of their description, which the header records (an index of several files can name it)."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    sha256: str


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
) -> Header:
    """Write ``tensors`` (one per spec, in order, produced lazily) to ``path``; fsync it; return its header.
    ``on_bytes(n)`` is called as each chunk of ``n`` bytes is written (progress)."""
    metadata = dict(metadata or {})
    if CHECKSUMS in metadata:
        raise ValueError(f"the metadata key {CHECKSUMS!r} is zero's own")
    if len({spec.key for spec in specs}) != len(specs) or "__metadata__" in {spec.key for spec in specs}:
        raise ValueError("tensor file keys must be unique and not '__metadata__'")
    offsets, start = {}, 0
    for spec in specs:
        offsets[spec.key] = (start, start + spec.nbytes)
        start += spec.nbytes
    placeholder = _header_text(metadata, specs, offsets, {s.key: _CRC_PLACEHOLDER for s in specs}, _SHA_PLACEHOLDER)
    base = 8 + len(placeholder)
    entries: dict[str, Entry] = {}
    with open(path, "wb") as f, ThreadPoolExecutor(1) as crcs:
        f.write(len(placeholder).to_bytes(8, "little") + placeholder)
        for spec, tensor in zip(specs, tensors, strict=True):
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{spec.key}: got {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"expected {spec.dtype} {spec.shape}")
            crc = _write_tensor(f, tensor, crcs, on_bytes)
            entries[spec.key] = Entry(dtype_code(spec.dtype), spec.shape, base + offsets[spec.key][0], spec.nbytes, crc)
        digest = _digest(metadata, entries)
        text = _header_text(metadata, specs, offsets, {k: f"{e.crc32:08x}" for k, e in entries.items()}, digest)
        assert len(text) == len(placeholder), "the checksums must fill their placeholders exactly"
        f.seek(8)
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return Header(entries, metadata, digest)


def _header_text(metadata: dict[str, str], specs: list[Spec], offsets: dict[str, tuple[int, int]],
                 crcs: dict[str, str], sha256: str) -> bytes:
    checksums = json.dumps({"crc32": crcs, "sha256": sha256}, separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": {**metadata, CHECKSUMS: checksums}}
    for spec in specs:
        header[spec.key] = {"dtype": dtype_code(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": list(offsets[spec.key])}
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _digest(metadata: dict[str, str], entries: dict[str, Entry]) -> str:
    """The SHA-256 of a header's description: the metadata (less the checksums) and every entry, CRC included."""
    described = {"metadata": metadata, "tensors": {k: e.to_json() for k, e in entries.items()}}
    return hashlib.sha256(json.dumps(described, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_tensor(f: BinaryIO, tensor: torch.Tensor, crcs: ThreadPoolExecutor,
                  on_bytes: Callable[[int], None] | None) -> int:
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


# ----- reading ---------------------------------------------------------------------------------------------


def read_header(f: BinaryIO, what: str) -> Header:
    """The checked header of the open file ``f`` (``what`` names it in errors): the safetensors rules, sizes
    bounded by the file's size, and the SHA-256 and CRC-32s that :func:`write` recorded. Raises a ValueError
    naming ``what`` and the cause; nothing is allocated beyond the header's own bytes."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise ValueError(f"{what} is truncated: it has {size} bytes, fewer than the 8 of a safetensors header's length")
    f.seek(0)
    length = int.from_bytes(f.read(8), "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"{what} is truncated or damaged: its header claims {length} bytes but the file holds "
                         f"{size - 8} after the length (and a header may have at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{what} is damaged: its header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{what} is damaged: its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{what} is damaged: its header's __metadata__ is not a map of strings")
    base = 8 + length
    ranges = {key: _checked_record(key, record, what) for key, record in header.items()}
    position = 0
    for key, (begin, end, _, _) in sorted(ranges.items(), key=lambda item: item[1][:2]):
        if begin != position:
            raise ValueError(f"{what} is damaged: tensor {key!r} starts at data byte {begin}, not {position} "
                             "(the tensors must tile the data without gaps or overlaps)")
        position = end
    if base + position != size:
        raise ValueError(f"{what} has {size} bytes but its header describes {base + position}: "
                         "it is truncated or damaged")
    crcs = _checksums(metadata.pop(CHECKSUMS, None), set(ranges), what)
    entries = {key: Entry(code, shape, base + begin, end - begin, crcs[key])
               for key, (begin, end, code, shape) in ranges.items()}
    if _digest(metadata, entries) != crcs["__sha256__"]:
        raise ValueError(f"{what} is damaged: its header does not match the SHA-256 recorded in it")
    return Header(entries, metadata, crcs["__sha256__"])


def _checked_record(key: str, record: Any, what: str) -> tuple[int, int, str, tuple[int, ...]]:
    """``(begin, end, dtype code, shape)`` of one header record, every field checked."""
    if not isinstance(record, dict) or set(record) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{what} is damaged: the header record of {key!r} is not {{dtype, shape, data_offsets}}")
    code, shape, offsets = record["dtype"], record["shape"], record["data_offsets"]
    if code not in DTYPES:
        raise ValueError(f"{what} is damaged: tensor {key!r} has unknown dtype {code!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise ValueError(f"{what} is damaged: tensor {key!r} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ValueError(f"{what} is damaged: tensor {key!r} has data_offsets {offsets!r}, "
                         "not two non-negative integers")
    begin, end = offsets
    nbytes = numel_of(shape) * DTYPES[code].itemsize
    if end - begin != nbytes:
        raise ValueError(f"{what} is damaged: tensor {key!r} is {code} of shape {tuple(shape)}, {nbytes} bytes, "
                         f"but its data_offsets [{begin}, {end}] hold {end - begin}")
    return begin, end, code, tuple(shape)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _checksums(text: str | None, keys: set[str], what: str) -> dict[str, Any]:
    """``{key: CRC-32, "__sha256__": header digest}`` from the ``zero.checksums`` metadata."""
    if text is None:
        raise ValueError(f"{what} carries no {CHECKSUMS} in its header: zero did not write it (or an older zero "
                         "did), so its bytes cannot be verified; read it with the safetensors library instead")
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{what} is damaged: its {CHECKSUMS} are not valid JSON ({err})") from err
    crcs = value.get("crc32") if isinstance(value, dict) else None
    sha = value.get("sha256") if isinstance(value, dict) else None
    hex8, hex64 = re.compile(r"[0-9a-f]{8}"), re.compile(r"[0-9a-f]{64}")
    if (not isinstance(crcs, dict) or set(crcs) != keys
            or not all(isinstance(c, str) and hex8.fullmatch(c) for c in crcs.values())
            or not isinstance(sha, str) or not hex64.fullmatch(sha)):
        raise ValueError(f"{what} is damaged: its {CHECKSUMS} are not a CRC-32 per tensor and a SHA-256")
    return {**{k: int(c, 16) for k, c in crcs.items()}, "__sha256__": sha}


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
