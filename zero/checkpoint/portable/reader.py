"""The portable checkpoint's reader (:class:`Checkpoint`): one directory, read back at any world size and stage.

Layout (``zero.checkpoint/2``, ``/3`` with several optimizers or whole-parameter ones, ``/4`` for a tensor-parallel
model)::

    CHECKPOINT/
      metadata.json                          what is where, the run that saved it, checksums
      metadata.json.sha256                   the SHA-256 of metadata.json (``sha256sum -c`` format)
      part-00000-of-00003.safetensors        what rank 0 wrote (safetensors layout: ``portable.tensorfile``)
      part-00001-of-00003.safetensors
      ...

Each tensor of the model's ``state_dict`` is recorded by name with its shape and saved dtype, and as
a list of *pieces*, 1D ranges of the flattened tensor: ``[file, start, numel, value key, {optimizer
state name: key}]``. A piece is what one rank owned when it saved (a chunk of a bucket at stages
1-3, a whole bucket's parameter at stage 0, a whole frozen parameter or buffer); its optimizer state
(``exp_avg``, ``step``, ...) lies beside it, 1D of the piece's length or 0-dim. Loading reads, for
each range a rank owns now, the intersecting ranges of the saved pieces: any world size, any stage.
Tied parameters are stored once, under their first name, with their other names in ``aliases``.
Format 4 (a tensor-parallel model) records *boxes* of each tensor's global shape instead (DCP's chunks: an offset
and a size, what one tp rank holds; :mod:`zero.checkpoint.portable.boxes`), each with its pieces, 1D ranges of the
box's row-major order; a load reads each range of its own box from the saved boxes it meets (:meth:`Checkpoint.read`
with ``box``). Formats 2 and 3 are read as one box, the whole tensor.
A parameter stepped whole (Muon, Adafactor, ...) keeps its values in pieces like any other, and its
optimizer state whole, as its owner wrote it (``whole_state``: :mod:`zero.checkpoint.portable.whole_state`),
read back by whichever rank owns it at load.

**What opening one verifies** (:class:`Checkpoint`, before anything is allocated or loaded): the
SHA-256 of ``metadata.json`` against ``metadata.json.sha256`` (another file: no single edit can
change the metadata and its checksum together); the metadata against its schema
(:mod:`zero.checkpoint.portable.schema`: types, ranges, and every entry, piece and name consistent with
the others); each part's size against the recorded one; and each part's own safetensors header
(itself checked against the SHA-256 written in it) against the metadata's entries, CRCs included.
The bytes a load reads are then checked against their CRC-32s (:meth:`Checkpoint.verify`, or
``read(check=True)``). ``metadata.json`` is written last: a directory without it is an
unfinished save (see :mod:`zero.checkpoint.portable.directory`).

File names come only from the schema's ``part-RRRRR-of-WWWWW.safetensors``, so nothing outside the
directory is ever named. A part that is a symlink is followed: whoever can make links in the
directory can write its files too, and every byte read through it is checked all the same.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch
from pydantic import ValidationError

import zero.checkpoint.portable.tensorfile as tensorfile
import zero.checkpoint.portable.tree as tree
import zero.checkpoint.portable.whole_state as whole_state
from zero.checkpoint.portable.boxes import Box, Move, moves
from zero.checkpoint.portable.directory import CHECKSUM, METADATA, resolve
from zero.checkpoint.portable.schema import FORMATS, CheckpointMetadata, TensorRecord, entries_of, summary
from zero.checkpoint.portable.tensorfile import numel_of

StateTarget = Callable[[str, torch.dtype], Optional[torch.Tensor]]  # (key, dtype) -> where to read it


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


@dataclass(frozen=True)
class SavedBox:
    """A box of a saved tensor's global shape and its pieces, 1D ranges of the box's row-major order (formats 2 and
    3: the whole tensor, one box)."""

    box: Box
    pieces: list[SavedPiece]

    def overlapping(self, start: int, numel: int) -> list[SavedPiece]:
        """The pieces that intersect elements ``[start, start + numel)`` of the box."""
        return [p for p in self.pieces if p.start < start + numel and start < p.end]


class Checkpoint:
    """An opened checkpoint directory, every check of the module docstring passed (the tensors' CRCs are
    checked as they are read or verified)."""

    def __init__(self, path: str | os.PathLike):
        self.path = resolve(path)
        self.meta = read_metadata(self.path)
        self.files = [self.path / f.name for f in self.meta.files]
        self.entries = [entries_of(f) for f in self.meta.files]
        self.tensors: dict[str, TensorRecord] = self.meta.tensors
        self.boxes = {name: _boxes_of(t) for name, t in self.tensors.items()}
        self._handles: dict[int, BinaryIO] = {}
        self._maps: dict[int, mmap.mmap] = {}
        try:
            for index, (file, record) in enumerate(zip(self.files, self.meta.files)):
                self._check_part(index, file, record.bytes)
        except BaseException:
            self.close()
            raise

    def _check_part(self, index: int, file: Path, recorded: int) -> None:
        """The part is there, of the recorded size, and its own header describes the entries the metadata lists."""
        if not file.is_file():
            raise ValueError(f"{file} is missing: this checkpoint lacks a rank's part "
                             f"(saved by {len(self.files)} ranks)")
        size = file.stat().st_size
        if size != recorded:
            raise ValueError(f"{file} has {size} bytes but {recorded} were written: it is truncated or damaged")
        entries = tensorfile.read_header(self._handle(index), str(file)).entries
        if entries != self.entries[index]:
            differ = sorted(set(entries) ^ set(self.entries[index])) or \
                sorted(k for k in entries if entries[k] != self.entries[index][k])
            raise ValueError(f"{file} does not match {self.path / METADATA}: entries {differ[:3]} differ "
                             "(dtype, shape, offset, size or CRC-32); the checkpoint is damaged")

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

    def moves(self, name: str, start: int, numel: int, box: Box | None = None) -> list[tuple[SavedBox, Move]]:
        """How elements ``[start, start + numel)`` of box ``box`` of saved tensor ``name`` (None: the whole tensor; the
        box's row-major order) are read: each saved box they meet, and the range of it that holds them."""
        saved = self.boxes[name]
        target = box if box is not None else Box.whole(self.tensors[name].shape)
        return [(saved[m.saved], m) for m in moves([b.box for b in saved], target, start, numel)]

    def read(self, name: str, start: int, numel: int, out: torch.Tensor, *, box: Box | None = None,
             check: bool = False) -> None:
        """Copy elements ``[start, start + numel)`` of box ``box`` of saved tensor ``name`` (None: the whole tensor;
        in the box's row-major order) into ``out`` (1D, any device/dtype). With ``check``, the CRC of each saved piece
        read whole is compared with the recorded one (for readers that did not :meth:`verify` first)."""
        self._copy(name, start, numel, out, box, None, check)

    def _copy(self, name: str, start: int, numel: int, out: torch.Tensor, box: Box | None, state: str | None,
              check: bool = False) -> None:
        """:meth:`read` of the values (``state`` None) or of the optimizer state ``state``."""
        for saved, move in self.moves(name, start, numel, box):
            pieces = saved.overlapping(move.start, move.numel)
            keys = [piece.value if state is None else piece.state[state] for piece in pieces]
            target = move.target(out)
            span = target if move.direct else torch.empty(move.numel, dtype=self.entries[pieces[0].file][keys[0]]
                                                          .torch_dtype)
            for piece, key in zip(pieces, keys):
                lo, hi = max(move.start, piece.start), min(move.start + move.numel, piece.end)
                crc = self._read_into(piece.file, key, lo - piece.start, span.narrow(0, lo - move.start, hi - lo),
                                      crc=check)
                recorded = self.entries[piece.file][key].crc32
                if check and crc is not None and crc != recorded:
                    raise ValueError(self._corrupted(piece.file, key, crc, recorded))
            if not move.direct:
                target.copy_(move.source(span, saved.box))

    def numel(self, name: str) -> int:
        return numel_of(self.tensors[name].shape)

    def read_whole(self, name: str, *, check: bool = True) -> torch.Tensor:
        """Saved tensor ``name`` whole, in its saved dtype and shape (a new CPU tensor; CRCs checked)."""
        record = self.tensors[name]
        out = torch.empty(self.numel(name), dtype=tensorfile.DTYPES[record.dtype])
        self.read(name, 0, out.numel(), out, check=check)
        return out.view(record.shape)

    def read_state(
        self, name: str, start: int, numel: int, into: StateTarget | None = None, box: Box | None = None
    ) -> dict[str, torch.Tensor]:
        """The optimizer state of elements ``[start, start + numel)`` of box ``box`` of ``name`` (None: the whole
        tensor): each state tensor cut to that range (0-dim ones, such as ``step``, from the first piece). Empty when
        it was saved without state. ``into(key, dtype)`` may give the tensor to read a state key into (offload to
        disk: its region of the file)."""
        pieces = [p for saved, move in self.moves(name, start, numel, box) for p in saved.overlapping(move.start,
                                                                                                       move.numel)]
        names = {tuple(sorted(p.state)) for p in pieces}
        if len(names) != 1:
            raise ValueError(f"{self.path}: the pieces of {name!r} carry different optimizer state "
                             f"({sorted(names)}); it is damaged")
        state: dict[str, torch.Tensor] = {}
        for key in pieces[0].state:
            first = self.entries[pieces[0].file][pieces[0].state[key]]
            if first.shape == ():
                state[key] = self._read(pieces[0].file, pieces[0].state[key], 0, 1).reshape(())
                continue
            out = into(key, first.torch_dtype) if into is not None else None
            out = torch.empty(numel, dtype=first.torch_dtype) if out is None else out
            self._copy(name, start, numel, out, box, key)
            state[key] = out
        return state

    def whole_state(self, name: str) -> dict[str, Any] | None:
        """The optimizer state that the owner of whole parameter ``name`` saved, as it was (tensors in their saved
        shape and dtype, on the CPU), or ``None`` when it had none. Verify :meth:`whole_state_keys` first."""
        record = self.tensors[name].whole_state
        if record is None:
            return None
        def tensor(i: int) -> torch.Tensor:
            key = record.keys[i]
            entry = self.entries[record.file][key]
            values = self._read(record.file, key, 0, entry.numel).reshape(entry.shape)
            return whole_state.laid_out(values, record.layouts.get(key))

        return tree.decode(record.tree, tensor)

    def whole_state_keys(self, name: str) -> set[tuple[int, str]]:
        """The ``(file, key)`` entries of :meth:`whole_state`."""
        record = self.tensors[name].whole_state
        return set() if record is None else {(record.file, key) for key in record.keys}

    def extra_keys(self) -> set[tuple[int, str]]:
        """The ``(file, key)`` entries of the tensors set aside by :func:`zero.checkpoint.portable.tree.encode`."""
        return {(0, key) for key in self.entries[0] if key.startswith("x/")}

    def extra_tensor(self, index: int) -> torch.Tensor:
        """The ``index``-th tensor set aside by :func:`zero.checkpoint.portable.tree.encode` (in rank 0's file)."""
        entry = self.entries[0][f"x/{index}"]
        return self._read(0, f"x/{index}", 0, entry.numel).reshape(entry.shape).clone()

    # ----- verifying -------------------------------------------------------------------------------------

    def keys_of(self, name: str, start: int, numel: int, state: bool, box: Box | None = None) -> set[tuple[int, str]]:
        """The ``(file, key)`` entries that reading this range of ``box`` (and its state) touches."""
        keys = set()
        for saved, move in self.moves(name, start, numel, box):
            for piece in saved.overlapping(move.start, move.numel):
                keys.add((piece.file, piece.value))
                if state:
                    keys.update((piece.file, key) for key in piece.state.values())
        return keys

    def verify(self, keys: set[tuple[int, str]], on_bytes: Callable[[int], None] | None = None) -> None:
        """Check the CRC-32 of every entry in ``keys``; raise a ValueError naming the file and entry on a mismatch."""
        for file, key in sorted(keys):
            entry = self.entries[file][key]
            got = tensorfile.crc32_of(self._mapped(file), entry)
            if got != entry.crc32:
                raise ValueError(self._corrupted(file, key, got, entry.crc32))
            if on_bytes is not None:
                on_bytes(entry.nbytes)

    def _read(self, file: int, key: str, start: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=self.entries[file][key].torch_dtype)
        self._read_into(file, key, start, out)
        return out

    def _read_into(self, file: int, key: str, start: int, out: torch.Tensor, crc: bool = False) -> int | None:
        entry = self.entries[file][key]
        assert 0 <= start and start + out.numel() <= entry.numel, "the schema keeps every piece inside its entry"
        return tensorfile.read_into(self._handle(file), entry, start, out, str(self.files[file]), crc=crc)

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


def _boxes_of(record: TensorRecord) -> list[SavedBox]:
    """A saved tensor's boxes: as recorded (format 4), or the whole tensor in one box (formats 2 and 3)."""
    if record.boxes is None:
        return [SavedBox(Box.whole(record.shape), [SavedPiece(*p) for p in record.pieces])]
    return [SavedBox(Box(tuple(b.offset), tuple(b.size)), [SavedPiece(*p) for p in b.pieces]) for b in record.boxes]


def read_metadata(directory: Path) -> CheckpointMetadata:
    """``directory``'s metadata: its SHA-256 checked against ``metadata.json.sha256``, then its schema. Every
    refusal is a ValueError naming the file and the cause."""
    path, checksum = directory / METADATA, directory / CHECKSUM
    raw = path.read_bytes()
    if not checksum.is_file():
        _check_format(path, raw)
        raise ValueError(f"{checksum} is missing: without it {path} cannot be verified; the checkpoint is damaged "
                         "(restore the file, or load an earlier checkpoint)")
    with open(checksum, "rb") as f:
        line = f.read(1024)
    match = re.fullmatch(rb"([0-9a-f]{64})  " + re.escape(METADATA.encode()) + rb"\n?", line)
    if match is None:
        raise ValueError(f"{checksum} is damaged: it is not one line '<SHA-256 in hex>  {METADATA}'")
    if hashlib.sha256(raw).hexdigest() != match.group(1).decode():
        raise ValueError(f"{path} does not match the SHA-256 recorded in {checksum}: "
                         "one of them was damaged or edited; restore it, or load an earlier checkpoint")
    try:
        return CheckpointMetadata.model_validate_json(raw, strict=True)
    except ValidationError as err:
        problem = summary(err)
    _check_format(path, raw)
    raise ValueError(f"{path} is damaged or was edited: {problem}")


def _check_format(path: Path, raw: bytes) -> None:
    """A clear error when ``raw`` is not JSON or not this format; returns when it claims to be this format."""
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the checkpoint is damaged") from err
    tag = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(tag, str) or not tag.startswith("zero.checkpoint/"):
        raise ValueError(f"{path} is not a zero checkpoint's metadata (no 'format': {FORMATS[-1]!r})")
    if tag == "zero.checkpoint/1":
        raise ValueError(f"{path} is in format 'zero.checkpoint/1', saved by an earlier zero without a checksum of "
                         f"its metadata, which this version requires ({FORMATS[0]!r}); load it with the zero version "
                         f"that saved it (zero {meta.get('zero_version')}, an earlier commit) and save it again with "
                         "this one")
    if tag not in FORMATS:
        raise ValueError(f"{path} is in format {tag!r}, which this version of zero cannot read (it reads "
                         f"{' and '.join(map(repr, FORMATS))}); load it with the zero version that saved it")
