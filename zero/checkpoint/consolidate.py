"""Export a portable checkpoint to one model: safetensors (Hugging Face layout) or a plain ``state_dict`` file.

Streaming: each tensor is assembled from its saved pieces and written before the next one is read,
so the memory held is about one tensor (the largest), never the model. The checkpoint is opened
with every check of :class:`zero.checkpoint.portable.reader.Checkpoint` (metadata checksum and schema, part
sizes and headers) and the CRC of every piece is checked as it is read. Outputs appear under their
final names only once complete (written to a temporary file of a name no one else uses, fsynced,
renamed).

* ``OUT`` a directory: ``model.safetensors``, or above ``max_shard_size``
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``weight_map``),
  as ``transformers``' ``save_pretrained`` writes them. Tied parameters are written once, under their
  first name, as ``save_pretrained`` does (``from_pretrained`` ties them again); their other names
  are recorded in each file's metadata (``zero.aliases``), and :func:`load_consolidated` restores them.
  A previous export of the other layout in ``OUT`` that zero wrote is removed once the new one is
  complete (``from_pretrained`` would read a stale ``model.safetensors`` before the index).
* ``OUT`` ending in ``.safetensors``: one file, whatever its size (same rules).
* ``OUT`` ending in ``.pt``, ``.pth`` or ``.bin``: ``torch.save`` of a plain ``state_dict`` with every
  name (tied names share one tensor), loadable with ``torch.load(weights_only=True)``. It is written
  from a temporary safetensors file that is memory-mapped, so it too holds the model only in the
  page cache, not in the process's own memory.

Every safetensors file written carries the CRC-32 of each tensor and the SHA-256 of its header
(:mod:`zero.checkpoint.portable.tensorfile`), and the index records each shard's SHA-256: :func:`load_consolidated`
returns exactly the tensors written or raises a ValueError naming the damaged file.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zero.checkpoint.portable import tensorfile
from zero.checkpoint.portable.reader import Checkpoint
from zero.checkpoint.portable.schema import summary
from zero.checkpoint.portable.tensorfile import Spec
from zero.checkpoint.progress import ByteMeter, ProgressArg
from zero.precision import DTYPES
from zero.sizes import parse_size

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DIGESTS = "zero.sha256"  # the index's metadata key: each shard's header SHA-256


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
    A damaged or missing checkpoint raises a ValueError (or FileNotFoundError) naming the file.
    """
    out = Path(out)
    cast = _dtype(dtype)
    limit = shard_size_bytes(max_shard_size)
    with Checkpoint(checkpoint) as ckpt:
        aliases = ckpt.meta.aliases

        def spec(name: str) -> Spec:
            saved = tensorfile.DTYPES[ckpt.tensors[name].dtype]
            target = cast if cast is not None and saved.is_floating_point else saved
            return Spec(name, target, tuple(ckpt.tensors[name].shape))

        specs = [spec(name) for name in ckpt.tensors]
        meter = ByteMeter(f"exporting {ckpt.path} to {out}", sum(s.nbytes for s in specs), progress)
        if out.suffix in TORCH_SUFFIXES:
            written = [_write_torch(ckpt, specs, aliases, out, meter)]
        elif out.suffix == ".safetensors":
            written = [_write_file(ckpt, specs, aliases, out, meter)[0]]
        else:
            written = _write_directory(ckpt, specs, aliases, out, limit, meter)
        tensor_files = [f for f in written if f.name != INDEX]
        meter.finish(f"exported {len(tensor_files)} file{'s' if len(tensor_files) > 1 else ''} to {out}")
        return written


def _write_file(ckpt: Checkpoint, specs: list[Spec], aliases: dict[str, str], path: Path,
                meter: ByteMeter) -> tuple[Path, str]:
    """One safetensors file of ``specs``, each tensor read from the checkpoint just before it is written; returns
    it and its header's SHA-256."""
    mine = {s.key for s in specs}
    metadata = {"format": "pt", "zero.aliases": json.dumps({a: n for a, n in aliases.items() if n in mine})}
    tensors = (ckpt.read_whole(s.key).to(s.dtype) for s in specs)
    with _Temporary(path) as tmp:
        header = tensorfile.write(tmp, specs, tensors, metadata=metadata, on_bytes=meter.advance)
        os.rename(tmp, path)
    return path, header.sha256


def _write_directory(ckpt, specs, aliases, out: Path, limit: int, meter: ByteMeter) -> list[Path]:
    """``model.safetensors``, or shards plus the index above ``limit`` bytes (greedy, in state_dict order)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    stale = out / (INDEX if len(shards) == 1 else SINGLE)
    if stale.exists() and not _written_by_zero(stale):
        raise ValueError(f"{stale} exists and zero did not write it; an export of the other layout next to it would be "
                         "ambiguous (from_pretrained reads model.safetensors first): export to another directory")
    out.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        written = [_write_file(ckpt, specs, aliases, out / SINGLE, meter)[0]]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        digests = {name: _write_file(ckpt, shard, aliases, out / name, meter)[1] for shard, name in zip(shards, files)}
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs), DIGESTS: digests},
            "weight_map": {s.key: name for shard, name in zip(shards, files) for s in shard},
        }
        with _Temporary(out / INDEX) as tmp:
            tmp.write_text(json.dumps(index, indent=2))
            os.rename(tmp, out / INDEX)
        written = [out / name for name in files] + [out / INDEX]
    if stale.exists():
        stale.unlink()  # zero's own previous export of the other layout (checked above)
    return written


def _written_by_zero(path: Path) -> bool:
    """Whether ``path`` is an export entry point zero wrote: a safetensors file with zero's checksums, or an index
    recording the shards' SHA-256s."""
    try:
        if path.name == INDEX:
            return DIGESTS in json.loads(path.read_text()).get("metadata", {})
        with open(path, "rb") as f:
            tensorfile.read_header(f, str(path))
        return True
    except (OSError, ValueError, AttributeError):
        return False


class _Temporary:
    """A new file beside ``path`` under a name no one else uses; removed on exit unless renamed."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        os.close(fd)
        self.path = Path(name)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: Any) -> None:
        self.path.unlink(missing_ok=True)


def _write_torch(ckpt, specs, aliases, out: Path, meter: ByteMeter) -> Path:
    """``torch.save`` of every name, the tensors memory-mapped from a temporary safetensors file."""
    with _Temporary(out.with_suffix(".safetensors")) as staging, _Temporary(out) as tmp:
        tensors = (ckpt.read_whole(s.key).to(s.dtype) for s in specs)
        header = tensorfile.write(staging, specs, tensors, on_bytes=meter.advance)
        with open(staging, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            state = {s.key: _mapped(mapped, header.entries[s.key]) for s in specs}
            state.update({alias: state[name] for alias, name in aliases.items()})
            torch.save(state, tmp)
            del state
        os.rename(tmp, out)
    return out


def _mapped(mapped: mmap.mmap, entry: tensorfile.Entry) -> torch.Tensor:
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.torch_dtype)
    return torch.frombuffer(mapped, dtype=entry.torch_dtype, count=entry.numel, offset=entry.offset).view(entry.shape)


# ----- reading an export back --------------------------------------------------------------------------------


class _IndexMetadata(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    total_size: int = Field(ge=0)
    digests: dict[str, str] = Field(alias=DIGESTS)


class _Index(BaseModel):
    """``model.safetensors.index.json`` as :func:`consolidate` writes it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    metadata: _IndexMetadata
    weight_map: dict[str, str]


def load_consolidated(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``state_dict`` that :func:`consolidate` wrote to ``path`` (a ``.safetensors`` file or a directory
    with ``model.safetensors`` or its index), with tied names restored: ``model.load_state_dict(sd, strict=True)``.

    Every file's header is checked (the safetensors rules, sizes within the file, its SHA-256; a shard's against
    the index), and every tensor's bytes against their CRC-32, before it is returned: a damaged export raises a
    ValueError naming the file. Shard names in the index must be plain file names inside ``path``."""
    path = Path(path)
    shards = _shards(path)
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for file, (names, digest) in shards.items():
        with open(file, "rb") as f:
            header = tensorfile.read_header(f, str(file))
            if digest is not None and (header.sha256 != digest or set(header.entries) != names):
                raise ValueError(f"{file} is not the shard that {path / INDEX} lists (its header's SHA-256 or tensor "
                                 "names differ): a shard of another export, or damaged")
            for name, entry in header.entries.items():
                if name in state:
                    raise ValueError(f"{file} holds {name!r}, which another shard holds too; the export is damaged")
                out = torch.empty(entry.numel, dtype=entry.torch_dtype)
                crc = tensorfile.read_into(f, entry, 0, out, str(file), crc=True)
                if crc != entry.crc32:
                    raise ValueError(f"{file} is corrupted: the bytes of {name!r} have CRC-32 {crc:#010x} but "
                                     f"{entry.crc32:#010x} was recorded when it was written")
                state[name] = out.view(entry.shape)
            aliases.update(_aliases(header.metadata, file))
    for alias, name in aliases.items():
        if name not in state or alias in state:
            raise ValueError(f"{path}: the tied name {alias!r} -> {name!r} must name an exported tensor under a name "
                             "not exported itself; the export is damaged")
        state[alias] = state[name]
    return state


def _shards(path: Path) -> dict[Path, tuple[set[str] | None, str | None]]:
    """The files of the export at ``path``: ``{file: (its tensor names, its header's SHA-256)}``, both None
    unless an index lists them."""
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"no export at {path}")
        return {path: (None, None)}
    index, single = path / INDEX, path / SINGLE
    if index.exists() and single.exists():
        raise ValueError(f"{path} holds both {SINGLE} and {INDEX}: two exports, one of them stale; remove one")
    if not index.exists():
        if not single.is_file():
            raise FileNotFoundError(f"no export in {path}: it has neither {SINGLE} nor {INDEX}")
        return {single: (None, None)}
    try:
        parsed = _Index.model_validate_json(index.read_bytes())
    except ValidationError as err:
        raise ValueError(f"{index} is damaged: {summary(err)}") from None
    names: dict[str, set[str]] = {}
    for tensor, name in parsed.weight_map.items():
        if name in ("", ".", "..") or Path(name).name != name:
            raise ValueError(f"{index} maps {tensor!r} to {name!r}, which is not a file name inside {path}")
        names.setdefault(name, set()).add(tensor)
    digests = parsed.metadata.digests
    if set(digests) != set(names):
        raise ValueError(f"{index} is damaged: its weight_map names the files {sorted(names)} but its {DIGESTS} "
                         f"{sorted(digests)}")
    return {path / name: (names[name], digests[name]) for name in sorted(names)}


def _aliases(metadata: dict[str, str], file: Path) -> dict[str, str]:
    try:
        aliases = json.loads(metadata.get("zero.aliases", "{}"))
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{file} is damaged: its zero.aliases are not valid JSON ({err})") from err
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise ValueError(f"{file} is damaged: its zero.aliases are not a map of names")
    return aliases


# ----- arguments -------------------------------------------------------------------------------------------


def shard_size_bytes(size: int | str) -> int:
    """Bytes of ``max_shard_size``: an int, or a size read by :func:`zero.sizes.parse_size` (``5GB`` is
    Hugging Face's 5 × 10⁹ bytes, ``2GiB`` binary)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    try:
        value = parse_size(size) if isinstance(size, str) else 0
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"max_shard_size {size!r}: give bytes (an int) or a size such as '5GB' or '500MB'")
    return value


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]

