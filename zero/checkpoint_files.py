"""The portable checkpoint on disk: one directory, read back at any world size and stage.

Layout (``zero.checkpoint/1``)::

    CHECKPOINT/
      metadata.json                          what is where, the run that saved it, checksums
      part-00000-of-00003.safetensors        what rank 0 wrote (safetensors layout, ``zero.tensorfile``)
      part-00001-of-00003.safetensors
      ...

Each tensor of the model's ``state_dict`` is recorded by name with its shape and saved dtype, and as
a list of *pieces*, 1D ranges of the flattened tensor: ``[file, start, numel, value key, {optimizer
state name: key}]``. A piece is what one rank owned when it saved (a chunk of a bucket at stages
1-3, a whole bucket's parameter at stage 0, a whole frozen parameter or buffer); its optimizer state
(``exp_avg``, ``step``, ...) lies beside it, 1D of the piece's length or 0-dim. Loading reads, for
each range a rank owns now, the intersecting ranges of the saved pieces: any world size, any stage.
Tied parameters are stored once, under their first name, with their other names in ``aliases``.

``metadata.json`` also holds each file's size and each entry's CRC-32, which :class:`Checkpoint`
checks before anything is loaded, and it is written last: a directory without it is an unfinished
save and is refused.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zero import tensorfile
from zero.tensorfile import Entry

FORMAT = "zero.checkpoint/1"
METADATA = "metadata.json"
PARTIAL_SUFFIX = ".partial"  # a save in progress (or one that died)
REPLACED_SUFFIX = ".replaced"  # the previous checkpoint, while a save over it renames the new one in


def part_name(rank: int, world_size: int) -> str:
    return f"part-{rank:05d}-of-{world_size:05d}.safetensors"


@dataclass(frozen=True)
class SavedPiece:
    file: int
    start: int
    numel: int
    value: str  # key of its values
    state: dict[str, str]  # optimizer state name -> key

    @property
    def end(self) -> int:
        return self.start + self.numel


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read: ``path``, or the previous checkpoint a save over ``path`` set aside
    before dying (``PATH.replaced``); a clear error for a missing or unfinished one."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    replaced = path.with_name(path.name + REPLACED_SUFFIX)
    if not path.exists() and (replaced / METADATA).is_file():
        print(f"zero: {path} is missing but {replaced} holds the checkpoint a save over it set aside; loading that")
        return replaced
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if path.name.endswith(PARTIAL_SUFFIX) or (not path.exists() and partial.exists()):
        raise ValueError(
            f"{path}: this checkpoint was never finished (a save was interrupted: {METADATA} is written last and is "
            "missing); load the previous checkpoint instead"
        )
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    raise ValueError(f"{path} is not a zero checkpoint: it has no {METADATA} (an unfinished save, or another format)")


class Checkpoint:
    """An opened checkpoint directory: its metadata checked, its files present and of the recorded sizes."""

    def __init__(self, path: str | os.PathLike):
        self.path = resolve(path)
        self.meta = _read_metadata(self.path / METADATA)
        self.files = [self.path / f["name"] for f in self.meta["files"]]
        self.entries = [{k: Entry.from_json(v) for k, v in f["entries"].items()} for f in self.meta["files"]]
        for file, record in zip(self.files, self.meta["files"]):
            if not file.is_file():
                raise ValueError(f"{file} is missing: this checkpoint lacks a rank's part (saved by {len(self.files)} ranks)")
            size = file.stat().st_size
            if size != record["bytes"]:
                raise ValueError(f"{file} has {size} bytes but {record['bytes']} were written: it is truncated or damaged")
        self.tensors: dict[str, dict[str, Any]] = self.meta["tensors"]
        self.pieces = {name: [SavedPiece(*p) for p in t["pieces"]] for name, t in self.tensors.items()}
        self._handles: dict[int, BinaryIO] = {}
        self._maps: dict[int, mmap.mmap] = {}

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        for handle in self._handles.values():
            handle.close()
        self._maps.clear()
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- reading ---------------------------------------------------------------------------------------

    def overlapping(self, name: str, start: int, numel: int) -> list[SavedPiece]:
        """The saved pieces of ``name`` that intersect elements ``[start, start + numel)``."""
        return [p for p in self.pieces[name] if p.start < start + numel and start < p.end]

    def read(self, name: str, start: int, numel: int, out: torch.Tensor, *, check: bool = False) -> None:
        """Copy elements ``[start, start + numel)`` of saved tensor ``name`` into ``out`` (1D, any device/dtype).
        With ``check``, the CRC of each saved piece read whole is compared with the recorded one (for readers
        that did not :meth:`verify` first)."""
        for piece in self.overlapping(name, start, numel):
            lo, hi = max(start, piece.start), min(start + numel, piece.end)
            crc = self._read_into(piece.file, piece.value, lo - piece.start, out.narrow(0, lo - start, hi - lo), crc=check)
            recorded = self.entries[piece.file][piece.value].crc32
            if check and crc is not None and crc != recorded:
                raise ValueError(self._corrupted(piece.file, piece.value, crc, recorded))

    def numel(self, name: str) -> int:
        return _numel(self.tensors[name]["shape"])

    def read_whole(self, name: str, *, check: bool = True) -> torch.Tensor:
        """Saved tensor ``name`` whole, in its saved dtype and shape (a new CPU tensor; CRCs checked)."""
        record = self.tensors[name]
        out = torch.empty(_numel(record["shape"]), dtype=tensorfile.DTYPES[record["dtype"]])
        self.read(name, 0, out.numel(), out, check=check)
        return out.view(record["shape"])

    def read_state(self, name: str, start: int, numel: int) -> dict[str, torch.Tensor]:
        """The optimizer state of elements ``[start, start + numel)`` of ``name``: each state tensor cut to that
        range (0-dim ones, such as ``step``, from the first piece). Empty when it was saved without state."""
        pieces = self.overlapping(name, start, numel)
        names = {tuple(sorted(p.state)) for p in pieces}
        if len(names) != 1:
            raise ValueError(f"{self.path}: the pieces of {name!r} carry different optimizer state ({sorted(names)}); it is damaged")
        state: dict[str, torch.Tensor] = {}
        for key in pieces[0].state:
            first = self.entries[pieces[0].file][pieces[0].state[key]]
            if first.shape == ():
                state[key] = self._read(pieces[0].file, pieces[0].state[key], 0, 1).reshape(())
                continue
            out = torch.empty(numel, dtype=first.torch_dtype)
            for piece in pieces:
                lo, hi = max(start, piece.start), min(start + numel, piece.end)
                self._read_into(piece.file, piece.state[key], lo - piece.start, out.narrow(0, lo - start, hi - lo))
            state[key] = out
        return state

    def extra_keys(self) -> set[tuple[int, str]]:
        """The ``(file, key)`` entries of the tensors set aside by :func:`zero.tree.encode`."""
        return {(0, key) for key in self.entries[0] if key.startswith("x/")}

    def extra_tensor(self, index: int) -> torch.Tensor:
        """The ``index``-th tensor set aside by :func:`zero.tree.encode` (in rank 0's file)."""
        entry = self.entries[0][f"x/{index}"]
        return self._read(0, f"x/{index}", 0, _numel(entry.shape)).reshape(entry.shape).clone()

    # ----- verifying -------------------------------------------------------------------------------------

    def keys_of(self, name: str, start: int, numel: int, state: bool) -> set[tuple[int, str]]:
        """The ``(file, key)`` entries that reading this range (and its state) touches."""
        keys = set()
        for piece in self.overlapping(name, start, numel):
            keys.add((piece.file, piece.value))
            if state:
                keys.update((piece.file, key) for key in piece.state.values())
        return keys

    def verify(self, keys: set[tuple[int, str]], on_bytes=None) -> None:
        """Check the CRC-32 of every entry in ``keys``; raise a ValueError naming the file and entry on a mismatch."""
        for file, key in sorted(keys):
            entry = self.entries[file][key]
            got = tensorfile.crc32_of(self._mapped(file), entry)
            if got != entry.crc32:
                raise ValueError(self._corrupted(file, key, got, entry.crc32))
            if on_bytes is not None:
                on_bytes(entry.nbytes)

    def _read(self, file: int, key: str, start: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=self.entries[file][key].torch_dtype if key in self.entries[file] else torch.uint8)
        self._read_into(file, key, start, out)
        return out

    def _read_into(self, file: int, key: str, start: int, out: torch.Tensor, crc: bool = False) -> int | None:
        entry = self._entry(file, key, start, out.numel())
        return tensorfile.read_into(self._handle(file), entry, start, out, str(self.files[file]), crc=crc)

    def _entry(self, file: int, key: str, start: int, numel: int) -> Entry:
        entry = self.entries[file].get(key)
        if entry is None:
            raise ValueError(f"{self.files[file]} has no entry {key!r} though {METADATA} lists it; the checkpoint is damaged")
        if start < 0 or start + numel > _numel(entry.shape):
            raise ValueError(f"{self.files[file]}: {key!r} holds {_numel(entry.shape)} elements, not {start + numel}; damaged")
        return entry

    def _corrupted(self, file: int, key: str, got: int, recorded: int) -> str:
        return (f"{self.files[file]} is corrupted: the bytes of {key!r} have CRC-32 {got:#010x} but {recorded:#010x} "
                "was recorded when it was saved; restore the file or load an earlier checkpoint")

    def _mapped(self, file: int) -> mmap.mmap:
        if file not in self._maps:
            self._maps[file] = mmap.mmap(self._handle(file).fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[file]

    def _handle(self, file: int) -> BinaryIO:
        if file not in self._handles:
            self._handles[file] = open(self.files[file], "rb")
        return self._handles[file]


def _numel(shape) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel


def _read_metadata(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the checkpoint is damaged") from err
    tag = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(tag, str) or not tag.startswith("zero.checkpoint/"):
        raise ValueError(f"{path} is not a zero checkpoint's metadata (no 'format': {FORMAT!r})")
    if tag != FORMAT:
        raise ValueError(
            f"{path} is in format {tag!r}, which this version of zero cannot read (it reads {FORMAT!r}); "
            "load it with the zero version that saved it"
        )
    missing = [k for k in ("world_size", "stage", "files", "tensors", "aliases") if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}; the checkpoint is damaged")
    return meta


def check_coverage(name: str, numel: int, pieces: list[SavedPiece], where: Path) -> None:
    """The pieces of ``name`` tile ``[0, numel)`` exactly."""
    position = 0
    for piece in sorted(pieces, key=lambda p: p.start):
        if piece.start != position:
            break
        position = piece.end
    if position != numel or sum(p.numel for p in pieces) != numel:
        raise ValueError(f"{where}: the saved pieces of {name!r} do not cover its {numel} elements exactly; it is damaged")
