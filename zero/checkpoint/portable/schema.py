"""The schema of a portable checkpoint's ``metadata.json`` (formats ``zero.checkpoint/2``, ``/3`` and ``/4``), checked
with pydantic. Format 2 is one elementwise optimizer's (its state per piece); format 3 adds ``optimizers`` (each wrapped
optimizer's class, step path and number of param groups, :mod:`zero.checkpoint.optimizer_set`) and, for the
parameters stepped whole, their state in the parameter's own shape (``whole_state``,
:mod:`zero.checkpoint.portable.whole_state`). A save writes format 2 whenever it can, so a checkpoint of one elementwise
optimizer is the same as before format 3 existed. Format 4, a tensor-parallel model's, is format 3 with
``tensor_parallel`` (the tp degree: ``world_size`` is dp x tp) and, for each tensor, ``boxes`` of its global shape
instead of ``pieces`` (:mod:`zero.checkpoint.portable.boxes`), each box with pieces of its own row-major order, keys
carrying its offset (``v/NAME/OFFSET/START``); a parameter stepped whole keeps its state whole, in its global shape,
as in format 3 (every tp rank's owner steps, and holds the state of, the global tensor).

:class:`CheckpointMetadata` checks each field's type and range, and then that the fields agree with
one another, before anything is read from the parts or allocated:

* the files are exactly ``part-RRRRR-of-WWWWW.safetensors``, one per saving rank: a name can never
  lead outside the checkpoint directory;
* every entry holds ``numel × itemsize`` bytes of its dtype and lies inside its file's recorded size;
* every piece of a tensor names the entry of its own range by the key the save gives it
  (``v/NAME/START``, ``s/NAME/START/STATE``, ``w/NAME``), of the tensor's dtype and the piece's
  length; the pieces tile the tensor's elements exactly; optimizer state is 0-dim or of the piece's
  length; a whole parameter's state names entries ``o/NAME/...`` of one part, and only parameters of a
  whole-path optimizer have it (and those of a flat one only per piece); every entry is read by exactly
  one piece (or one tensor of ``extra`` or of a whole parameter's state), so what a load allocates is
  bounded by what the files hold;
* format 4: every box has the tensor's dimensions, holds elements and lies inside its shape, the boxes tile the
  tensor (no two meet), and the pieces tile each box;
* tied names point at stored tensors, and every tensor that ``state`` refers to is stored.

A :class:`pydantic.ValidationError` (a ``ValueError``) says which field is wrong;
:func:`zero.checkpoint.portable.reader.read_metadata` turns it into one line naming the file.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from zero.checkpoint.portable.boxes import Box, check_tiling
from zero.checkpoint.portable.tensorfile import DTYPES, Entry, numel_of

FORMAT = "zero.checkpoint/2"  # one elementwise optimizer: what every save wrote before several optimizers
OPTIMIZERS_FORMAT = "zero.checkpoint/3"  # several optimizers, or whole-parameter ones
BOXES_FORMAT = "zero.checkpoint/4"  # a tensor-parallel model's: each tensor as boxes of its global shape
FORMATS = (FORMAT, OPTIMIZERS_FORMAT, BOXES_FORMAT)  # what a load reads
MAX_COUNT = 2**63 - 1  # file offsets and sizes: what a seek takes


def part_name(rank: int, world_size: int) -> str:
    """The file rank ``rank`` of ``world_size`` writes."""
    return f"part-{rank:05d}-of-{world_size:05d}.safetensors"


def _known_dtype(code: str) -> str:
    if code not in DTYPES:
        raise ValueError(f"unknown dtype {code!r} (known: {sorted(DTYPES)})")
    return code


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
DtypeCode = Annotated[str, AfterValidator(_known_dtype)]
EntryRecord = tuple[DtypeCode, tuple[Count, ...], Count, Count, Annotated[int, Field(ge=0, lt=2**32)]]
PieceRecord = tuple[Count, Count, Count, str, dict[str, str]]  # file, start, numel, value key, {state: key}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FileRecord(_Strict):
    """One rank's part: its name, size in bytes, and entries ``[dtype, shape, offset, nbytes, CRC-32]``."""

    name: str
    bytes: Count
    entries: dict[str, EntryRecord]


class WholeState(_Strict):
    """The optimizer state of a parameter stepped whole: a JSON tree whose tensor ``i`` is entry ``keys[i]`` of
    part ``file``, and the layout of those kept other than row-major (:mod:`zero.checkpoint.portable.whole_state`)."""

    file: Count
    keys: list[str]
    tree: Any
    layouts: dict[str, list[Annotated[int, Field(ge=0, le=64)]]] = {}


class BoxRecord(_Strict):
    """Format 4: a box of a tensor's global shape (DCP's chunk: its offsets and sizes), and its elements as pieces,
    1D ranges of the box's row-major order."""

    offset: tuple[Count, ...]
    size: tuple[Count, ...]
    pieces: list[PieceRecord]


class TensorRecord(_Strict):
    """One tensor of the model's ``state_dict``, stored once (tied names are ``aliases``): as pieces of the whole
    tensor (formats 2 and 3) or as boxes of it (format 4)."""

    kind: Literal["param", "buffer"]
    shape: tuple[Count, ...]
    dtype: DtypeCode
    trainable: bool
    group: Annotated[int, Field(ge=-1)]
    pieces: list[PieceRecord] | None = None  # formats 2 and 3
    boxes: list[BoxRecord] | None = None  # format 4
    whole_state: WholeState | None = None  # format 3, a parameter of a whole-path optimizer that has state


class OptimizerRecord(_Strict):
    """One wrapped optimizer (format 3): its class, step path and number of param groups, in order."""

    model_config = ConfigDict(populate_by_name=True)
    class_: str = Field(alias="class")
    path: Literal["flat", "whole"]
    groups: Count

    def record(self) -> dict[str, Any]:
        """As :func:`zero.checkpoint.optimizer_set.records` gives it."""
        return {"class": self.class_, "path": self.path, "groups": self.groups}


class SavedState(_Strict):
    """The trees :func:`zero.checkpoint.portable.tree.encode` wrote (tensors stand for ``x/INDEX`` entries of
    part 0)."""

    param_groups: list[dict[str, Any]]
    scheduler: Any
    extra: Any
    loss_scale: Any


class CheckpointMetadata(_Strict):
    """``metadata.json``: the run that saved the checkpoint and where every tensor lies."""

    format: Literal["zero.checkpoint/2", "zero.checkpoint/3", "zero.checkpoint/4"]
    zero_version: str
    torch_version: str
    world_size: Annotated[int, Field(ge=1, le=2**20)]
    tensor_parallel: Annotated[int, Field(ge=2, le=2**20)] | None = None  # format 4: the tp degree (world: dp x tp)
    stage: Annotated[int, Field(ge=0, le=3)]
    config: dict[str, Any]
    optimizer_class: str
    step: Count
    tensors: dict[str, TensorRecord]
    aliases: dict[str, str]
    state: SavedState
    files: list[FileRecord]
    optimizers: list[OptimizerRecord] | None = None  # format 3 (format 2: one flat optimizer_class)

    def optimizer_records(self) -> list[dict[str, Any]]:
        """The wrapped optimizers, as :func:`zero.checkpoint.optimizer_set.records` gives them (format 2: the
        one elementwise ``optimizer_class``, over every param group)."""
        if self.optimizers is None:
            return [{"class": self.optimizer_class, "path": "flat", "groups": len(self.state.param_groups)}]
        return [o.record() for o in self.optimizers]

    @model_validator(mode="after")
    def _consistent(self) -> "CheckpointMetadata":
        names = [f.name for f in self.files]
        expected = [part_name(r, self.world_size) for r in range(self.world_size)]
        if names != expected:
            raise ValueError(f"the files must be {_cut(expected)} (one per saving rank), not {_cut(names)}")
        read: set[tuple[int, str]] = set()
        for file in self.files:
            for key, (code, shape, offset, nbytes, _) in file.entries.items():
                size = numel_of(shape) * DTYPES[code].itemsize
                if nbytes != size:
                    raise ValueError(f"entry {key!r} of {file.name} is {code} of shape {tuple(shape)}, {size} bytes, "
                                     f"but {nbytes} are recorded")
                if offset < 8 or offset + nbytes > file.bytes:
                    raise ValueError(f"entry {key!r} of {file.name} lies at bytes [{offset}, {offset + nbytes}), "
                                     f"outside the file's {file.bytes}")
        paths = self._check_optimizers()
        self._check_layout()
        for name, tensor in self.tensors.items():
            if tensor.boxes is None:
                self._check_pieces(name, tensor, tensor.pieces, None, read)
            else:
                check_tiling(name, tuple(tensor.shape), [Box(tuple(b.offset), tuple(b.size)) for b in tensor.boxes])
                for box in tensor.boxes:
                    self._check_pieces(name, tensor, box.pieces, box, read)
            self._check_whole_state(name, tensor, paths, read)
        for alias, name in self.aliases.items():
            if name not in self.tensors or alias in self.tensors:
                raise ValueError(f"alias {alias!r} -> {name!r} must name a stored tensor "
                                 "under a name not stored itself")
        _check_tree(self.state.model_dump(), _extra_tensor(self.files[0].entries, read))
        unread = [(self.files[f].name, key) for f in range(len(self.files)) for key in self.files[f].entries
                  if (f, key) not in read]
        if unread:
            raise ValueError(f"entries {_cut(unread)} are not read by any tensor's piece")
        return self

    def _check_optimizers(self) -> list[str]:
        """Format 3 lists the optimizers (their groups: every param group), format 2 has neither them nor whole
        state; returns each param group's step path."""
        if self.format == FORMAT:
            if self.optimizers is not None or any(t.whole_state is not None for t in self.tensors.values()):
                raise ValueError(f"format {FORMAT!r} holds one elementwise optimizer's state: no 'optimizers' and no "
                                 f"whole-parameter state (format {OPTIMIZERS_FORMAT!r} has them)")
            return ["flat"] * len(self.state.param_groups)
        if not self.optimizers:
            raise ValueError(f"format {self.format!r} lists the optimizers it was saved with in 'optimizers'")
        paths = [o.path for o in self.optimizers for _ in range(o.groups)]
        if len(paths) != len(self.state.param_groups):
            raise ValueError(f"the optimizers have {len(paths)} param groups in all, but state.param_groups holds "
                             f"{len(self.state.param_groups)}")
        classes = " + ".join(o.class_ for o in self.optimizers)
        if self.optimizer_class != classes:
            raise ValueError(f"optimizer_class is {self.optimizer_class!r}, not the optimizers' {classes!r}")
        return paths

    def _check_layout(self) -> None:
        """Format 4 records its tp degree, which divides the world (dp x tp), and every tensor's boxes; formats 2 and 3
        every tensor's pieces."""
        boxed = self.format == BOXES_FORMAT
        if boxed != (self.tensor_parallel is not None) or (boxed and self.world_size % self.tensor_parallel):
            raise ValueError(f"format {BOXES_FORMAT!r}, and only it, records tensor_parallel: its tp degree, which "
                             f"divides world_size ({self.world_size}), not {self.tensor_parallel}")
        for name, tensor in self.tensors.items():
            if (tensor.boxes is not None) != boxed or (tensor.pieces is not None) == boxed:
                raise ValueError(f"{name!r} must record {'boxes' if boxed else 'pieces'}, and only them, in format "
                                 f"{self.format!r} (boxes of the global shape in {BOXES_FORMAT!r}, else pieces)")

    def _check_whole_state(self, name: str, tensor: TensorRecord, paths: list[str],
                           read: set[tuple[int, str]]) -> None:
        """Only a parameter of a whole-path optimizer has whole state, and only one of a flat one state per piece;
        whole state names entries ``o/NAME/...`` of its part, each once, and its tree refers to each of them once."""
        path = paths[tensor.group] if tensor.trainable and 0 <= tensor.group < len(paths) else None
        pieces = tensor.pieces if tensor.boxes is None else [p for box in tensor.boxes for p in box.pieces]
        if path != "flat" and any(state for *_, state in pieces):
            raise ValueError(f"{name!r} has optimizer state per piece but is not a parameter of an elementwise "
                             "optimizer")
        state = tensor.whole_state
        if state is None:
            return
        if path != "whole":
            raise ValueError(f"{name!r} has whole-parameter optimizer state but is not a parameter of an optimizer "
                             "stepped on whole parameters")
        if state.file >= len(self.files):
            raise ValueError(f"the optimizer state of {name!r} is in file {state.file}, but there are "
                             f"{len(self.files)}")
        entries = self.files[state.file].entries
        for key in state.keys:
            if not key.startswith(f"o/{name}/") or key not in entries or (state.file, key) in read:
                raise ValueError(f"the optimizer state of {name!r} names {key!r}, which is not one entry o/{name}/... "
                                 f"of {self.files[state.file].name} of its own")
            read.add((state.file, key))
        for key, order in state.layouts.items():
            if key not in state.keys or sorted(order) != list(range(len(entries[key][1]))):
                raise ValueError(f"the optimizer state of {name!r} lays out {key!r} as {order}, which is not an "
                                 "order of the dimensions of one of its tensors")
        if not isinstance(state.tree, dict) or {"__tensor__", "__tuple__"} & state.tree.keys():
            raise ValueError(f"the optimizer state of {name!r} is not a dict")
        used: set[int] = set()

        def reference(index: Any, path: str) -> None:
            if type(index) is not int or not 0 <= index < len(state.keys) or index in used:
                raise ValueError(f"the optimizer state of {name!r} refers to tensor {index!r}, which is not one of "
                                 f"its {len(state.keys)} keys")
            if state.keys[index] != f"o/{name}/{path}":
                raise ValueError(f"the optimizer state of {name!r} holds entry {state.keys[index]!r} at {path!r}, "
                                 f"not its own (o/{name}/{path})")
            used.add(index)

        _check_tree(state.tree, reference)
        if len(used) != len(state.keys):
            raise ValueError(f"the optimizer state of {name!r} does not refer to each of its {len(state.keys)} keys")

    def _check_pieces(self, name: str, tensor: TensorRecord, pieces: list[PieceRecord], box: BoxRecord | None,
                      read: set[tuple[int, str]]) -> None:
        """Each piece of the tensor (or of its ``box``) names its own entries, of the right dtype and length; together
        they tile the tensor (the box)."""
        shape = tuple(tensor.shape if box is None else box.size)
        numel = numel_of(shape)
        at = "" if box is None else f"{','.join(map(str, box.offset))}/"  # format 4: the box's offset in every key
        element = (lambda start: start) if box is None else (lambda start: f"{start} of box {tuple(box.offset)}")
        for file, start, length, value, state in pieces:
            if file >= len(self.files):
                raise ValueError(f"a piece of {name!r} is in file {file}, but there are {len(self.files)}")
            whole = value.startswith("w/")
            key = (f"w/{name}" if box is None else f"w/{name}/{at[:-1]}") if whole else f"v/{name}/{at}{start}"
            keys = [(value, key)] + [(state[s], f"s/{name}/{at}{start}/{s}") for s in state]
            wrong = [k for k, expected in keys if k != expected]
            if wrong or (whole and (start, length, state) != (0, numel, {})):
                if box is not None:
                    raise ValueError(f"the piece of {name!r} at element {element(start)} names entries "
                                     f"{_cut(wrong or [value])}, not its own (v/NAME/OFFSET/START, "
                                     "s/NAME/OFFSET/START/STATE, or w/NAME/OFFSET for a whole box)")
                raise ValueError(f"the piece of {name!r} at element {start} names entries {_cut(wrong or [value])}, "
                                 "not its own (v/NAME/START, s/NAME/START/STATE, or w/NAME for a whole tensor)")
            entries = self.files[file].entries
            for key, _ in keys:
                if key not in entries:
                    raise ValueError(f"{self.files[file].name} has no entry {key!r}, which a piece of {name!r} names")
                if (file, key) in read:
                    raise ValueError(f"entry {key!r} of {self.files[file].name} is read by more than one piece")
                read.add((file, key))
            code, saved = entries[value][:2]
            if code != tensor.dtype or numel_of(saved) != length or (whole and tuple(saved) != shape):
                raise ValueError(f"the piece of {name!r} at element {element(start)} is {length} elements of "
                                 f"{tensor.dtype}, but its entry {value!r} is {code} of shape {tuple(saved)}")
            for s in state:
                saved = tuple(entries[state[s]][1])
                if saved not in ((), (length,)):
                    raise ValueError(f"optimizer state {s!r} of {name!r} at element {element(start)} has shape "
                                     f"{saved}, neither () nor ({length},)")
        position = 0
        for _, start, length, _, _ in sorted(pieces, key=lambda p: p[1]):
            if start != position:
                break
            position = start + length
        if position != numel or sum(p[2] for p in pieces) != numel:
            what = repr(name) if box is None else f"{name!r} in box {tuple(box.offset)}"
            raise ValueError(f"the pieces of {what} do not cover its {numel} elements exactly (shape "
                             f"{shape}): a gap or an overlap")


def _check_tree(value: Any, reference: Callable[[Any, str], None], path: str = "") -> None:
    """Every node of an encoded tree is well formed; ``reference(index, path)`` checks each tensor it refers to
    (``path``: where it is in the tree, as :func:`zero.checkpoint.portable.tree.encode` names it)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_tree(item, reference, f"{path}[{i}]")
        return
    if not isinstance(value, dict):
        return
    if "__tensor__" in value:
        if set(value) != {"__tensor__"}:
            raise ValueError("state holds a malformed tensor reference")
        reference(value["__tensor__"], path)
    elif "__tuple__" in value:
        if set(value) != {"__tuple__"} or not isinstance(value["__tuple__"], list):
            raise ValueError("state holds a malformed tuple")
        _check_tree(value["__tuple__"], reference, path)
    elif "__items__" in value:
        items = value["__items__"]
        if (set(value) != {"__items__"} or not isinstance(items, list)
                or not all(isinstance(i, list) and len(i) == 2 and not isinstance(i[0], (list, dict)) for i in items)):
            raise ValueError("state holds a malformed dict")
        for key, item in items:
            _check_tree(item, reference, f"{path}[{key!r}]")
    else:
        for key, item in value.items():
            _check_tree(item, reference, f"{path}.{key}" if path else key)


def _extra_tensor(entries: dict[str, Any], read: set[tuple[int, str]]) -> Callable[[Any, str], None]:
    """The check of a tensor the saved trees (``state``) refer to: an ``x/INDEX`` entry of part 0, read once."""

    def reference(index: Any, path: str) -> None:
        key = f"x/{index}"
        if type(index) is not int or key not in entries or (0, key) in read:
            raise ValueError(f"state refers to tensor {index!r}, which is not one stored entry x/INDEX of part 0")
        read.add((0, key))

    return reference


def entries_of(file: FileRecord) -> dict[str, Entry]:
    """A file's entries as :class:`zero.checkpoint.portable.tensorfile.Entry`."""
    return {key: Entry(code, tuple(shape), offset, nbytes, crc)
            for key, (code, shape, offset, nbytes, crc) in file.entries.items()}


def summary(err: ValidationError, shown: int = 3) -> str:
    """One line of a ValidationError: each field's location and message, the first ``shown`` of them."""
    parts = []
    for e in err.errors()[:shown]:
        where = ".".join(str(x) for x in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    more = f" (and {err.error_count() - shown} more)" if err.error_count() > shown else ""
    return "; ".join(parts) + more


def _cut(items: list, shown: int = 4) -> str:
    text = ", ".join(repr(i) for i in items[:shown])
    return f"[{text}, ... {len(items)} in all]" if len(items) > shown else f"[{text}]"
