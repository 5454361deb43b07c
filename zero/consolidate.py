"""Export a portable checkpoint to one model: safetensors (Hugging Face layout) or a plain ``state_dict`` file.

Streaming: each tensor is assembled from its saved pieces and written before the next one is read,
so the memory held is about one tensor (the largest), never the model. The CRC of every piece is
checked as it is read. Outputs appear under their final names only once complete.

* ``OUT`` a directory: ``model.safetensors``, or above ``max_shard_size``
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``weight_map``),
  as ``transformers``' ``save_pretrained`` writes them. Tied parameters are written once, under their
  first name, as ``save_pretrained`` does (``from_pretrained`` ties them again); their other names
  are recorded in each file's metadata (``zero.aliases``), and :func:`load_consolidated` restores them.
* ``OUT`` ending in ``.safetensors``: one file, whatever its size (same rules).
* ``OUT`` ending in ``.pt``, ``.pth`` or ``.bin``: ``torch.save`` of a plain ``state_dict`` with every
  name (tied names share one tensor), loadable with ``torch.load(weights_only=True)``. It is written
  from a temporary safetensors file that is memory-mapped, so it too holds the model only in the
  page cache, not in the process's own memory.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from zero import tensorfile
from zero.checkpoint_files import Checkpoint
from zero.precision import DTYPES
from zero.progress import Progress, ProgressArg
from zero.tensorfile import Spec

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
INDEX = "model.safetensors.index.json"


def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    progress: ProgressArg = True,
) -> list[Path]:
    """Write the model of ``checkpoint`` (saved by :func:`zero.save_checkpoint`) to ``out``; return the files.

    One process, no ``torch.distributed``. ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype)
    casts floating-point tensors; by default each keeps its saved dtype (fp32 master weights under mixed
    precision). Frozen parameters and buffers are included. See the module docstring for the layouts.
    """
    out = Path(out)
    cast = _dtype(dtype)
    limit = parse_size(max_shard_size)
    with Checkpoint(checkpoint) as ckpt:
        names = list(ckpt.tensors)
        aliases = ckpt.meta["aliases"]

        def spec(name: str) -> Spec:
            saved = tensorfile.DTYPES[ckpt.tensors[name]["dtype"]]
            target = cast if cast is not None and saved.is_floating_point else saved
            return Spec(name, target, tuple(ckpt.tensors[name]["shape"]))

        specs = [spec(name) for name in names]
        meter = Progress(f"exporting {ckpt.path} to {out}", sum(s.nbytes for s in specs), progress)
        if out.suffix in TORCH_SUFFIXES:
            written = [_write_torch(ckpt, specs, aliases, out, meter)]
        elif out.suffix == ".safetensors":
            written = [_write_file(ckpt, specs, aliases, out, meter)]
        else:
            written = _write_directory(ckpt, specs, aliases, out, limit, meter)
        tensor_files = [f for f in written if f.name != INDEX]
        meter.finish(f"exported {len(tensor_files)} file{'s' if len(tensor_files) > 1 else ''} to {out}")
        return written


def _write_file(ckpt: Checkpoint, specs: list[Spec], aliases: dict[str, str], path: Path, meter: Progress) -> Path:
    """One safetensors file of ``specs``, each tensor read from the checkpoint just before it is written."""
    mine = {s.key for s in specs}
    metadata = {"format": "pt", "zero.aliases": json.dumps({a: n for a, n in aliases.items() if n in mine})}
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tensors = (ckpt.read_whole(s.key).to(s.dtype) for s in specs)
        tensorfile.write(tmp, specs, tensors, metadata=metadata, on_bytes=meter.advance)
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_directory(ckpt, specs, aliases, out: Path, limit: int, meter: Progress) -> list[Path]:
    """``model.safetensors``, or shards plus the index above ``limit`` bytes (greedy, in state_dict order)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    out.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        return [_write_file(ckpt, specs, aliases, out / "model.safetensors", meter)]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = [_write_file(ckpt, shard, aliases, out / name, meter) for shard, name in zip(shards, files)]
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.key: name for shard, name in zip(shards, files) for s in shard},
    }
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return written + [out / INDEX]


def _write_torch(ckpt, specs, aliases, out: Path, meter: Progress) -> Path:
    """``torch.save`` of every name, the tensors memory-mapped from a temporary safetensors file."""
    staging = out.with_name(out.name + ".staging.safetensors")
    tmp = out.with_name(out.name + ".partial")
    try:
        _write_file(ckpt, specs, aliases, staging, meter)
        with open(staging, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            header = read_header_of(f)
            state = {name: _mapped(mapped, header, name) for name in (s.key for s in specs)}
            state.update({alias: state[name] for alias, name in aliases.items()})
            torch.save(state, tmp)
            del state
        tmp.rename(out)
    finally:
        staging.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def _mapped(mapped: mmap.mmap, header: tuple[int, dict[str, Any]], name: str) -> torch.Tensor:
    base, entries = header
    entry = entries[name]
    begin, end = entry["data_offsets"]
    dtype = tensorfile.DTYPES[entry["dtype"]]
    if end == begin:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=base + begin).view(entry["shape"])


def read_header_of(f) -> tuple[int, dict[str, Any]]:
    """``(first data byte, header)`` of an open safetensors file."""
    f.seek(0)
    length = int.from_bytes(f.read(8), "little")
    return 8 + length, json.loads(f.read(length))


def load_consolidated(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``state_dict`` that :func:`consolidate` wrote to ``path`` (a ``.safetensors`` file or a directory
    with ``model.safetensors`` or its index), with tied names restored: ``model.load_state_dict(sd, strict=True)``."""
    path = Path(path)
    if path.is_dir():
        index = path / INDEX
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
            else [path / "model.safetensors"]
    else:
        files = [path]
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for file in files:
        with open(file, "rb") as f:
            base, header = read_header_of(f)
            aliases.update(json.loads(header.get("__metadata__", {}).get("zero.aliases", "{}")))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = tensorfile.DTYPES[entry["dtype"]]
                begin, end = entry["data_offsets"]
                out = torch.empty(entry["shape"], dtype=dtype)
                if end > begin:
                    f.seek(base + begin)
                    f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
                state[name] = out
    state.update({alias: state[name] for alias, name in aliases.items()})
    return state


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or an int (Hugging Face's spelling: GB = 10^9)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size {size!r}: give bytes (an int) or a size such as '5GB' or '500MB'")
    number, unit = float(match.group(1)), match.group(2).upper()
    scale = 1024 if "I" in unit else 1000
    return max(1, int(number * scale ** "KMGT".index(unit[0]) * scale))


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]

