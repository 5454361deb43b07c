"""The per-rank optimizer checkpoint format: its header, and the checks before loading one.

A shard is ``{**header(...), "optimizer": inner.state_dict()}`` for one elementwise optimizer. Besides the run
(stage, world size, rank) and the model's layout, the header records the wrapped optimizer's class and this rank's
*pieces* (the 1D tensors the wrapped optimizer steps) per param group, in the optimizer's order: ``(parameter name,
first element within the parameter, numel)``. With several optimizers, or one stepped on whole parameters (Muon,
Adafactor, ...), it is ``{**header(...), "optimizers": [state_dict, ...]}``, one per wrapped optimizer in order, and
the header's ``"inners"`` records each one's class, step path and number of param groups
(:mod:`zero.checkpoint.optimizer_set`) and the tensors it steps here: its pieces (flat), or the whole parameters
this rank owns, each as ``(name, 0, numel)`` (whole; their state keeps the parameter's shape).
:func:`check_loadable` compares all of it with the run loading the shard and vets the state against those tensors,
so that a mismatched or edited shard is refused before anything is loaded into the optimizer.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zero.checkpoint import optimizer_set
from zero.checkpoint.optimizer_set import class_name
from zero.runtime.buffers.bucket import LocalPiece, ParamSlot
from zero.runtime.buffers.partition import Partition
from zero.runtime.step.inner import Inner

FORMAT = "zero.shard/2"
FULL_PRECISION = {"param_dtype": None, "reduce_dtype": None}
PieceRecord = tuple[str, int, int]  # (parameter name, start within the flattened parameter, numel)


def header(
    *,
    stage: int,
    world_size: int,
    rank: int,
    partition: Partition,
    optimizer: torch.optim.Optimizer | None = None,
    precision: dict[str, Any] | None = None,
    inners: Sequence[Inner] | None = None,
    owned: Sequence[tuple[ParamSlot, torch.Tensor]] = (),
) -> dict[str, Any]:
    """What a shard must match to be loaded: format, stage, world size, rank, precision (``param_dtype``,
    ``reduce_dtype``; ``None`` fields: full precision), layout and the wrapped optimizer (``optimizer``:
    the inner optimizer rebuilt over this rank's pieces, ``ZeroOptimizer.inner``), or with several or a whole one
    ``inners`` (``runtime.inners``) and the whole parameters this rank owns (``owned``:
    ``runtime.whole_parameter_step.owned()``)."""
    described = ({"inner": {"class": class_name(optimizer), "pieces": optimizer_pieces(partition, optimizer)}}
                 if inners is None else {"inners": inners_record(partition, inners, owned)})
    return {
        "format": FORMAT,
        "stage": stage,
        "world_size": world_size,
        "rank": rank,
        "precision": dict(precision or FULL_PRECISION),
        "layout": {
            "params": [(s.name, tuple(s.shape), str(s.param.dtype)) for s in partition.slots],
            "buckets": [(b.layout.padded_numel, len(b.slots)) for b in partition.buckets],
        },
        **described,
    }


def inners_record(partition: Partition, inners: Sequence[Inner],
                  owned: Sequence[tuple[ParamSlot, torch.Tensor]]) -> list[dict[str, Any]]:
    """Each wrapped optimizer's class, path and groups, and per param group the tensors it steps here."""
    slot_of = {id(stand_in): slot for slot, stand_in in owned}
    described = []
    for inner, record in zip(inners, optimizer_set.records(inners)):
        if inner.whole:
            pieces = [[_whole_record(slot_of, t, inner.optimizer, gi) for t in group["params"]]
                      for gi, group in enumerate(inner.optimizer.param_groups)]
        else:
            pieces = optimizer_pieces(partition, inner.optimizer)
        described.append({**record, "pieces": pieces})
    return described


def optimizer_pieces(partition: Partition, optimizer: torch.optim.Optimizer) -> list[list[PieceRecord]]:
    """Per param group of ``optimizer``, its tensors in order, each described by the piece it is."""
    piece_of = {id(p.tensor): p for bucket in partition.buckets for p in bucket.pieces}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        stray = [t for t in group["params"] if id(t) not in piece_of]
        if stray:
            raise ValueError(
                f"param group {gi} of the {class_name(optimizer)} holds a tensor of shape {tuple(stray[0].shape)} "
                "that is not one of this rank's pieces; pass the rebuilt optimizer (ZeroOptimizer.inner), "
                "not the one it wraps"
            )
        groups.append([_record(piece_of[id(t)]) for t in group["params"]])
    return groups


def check_loadable(saved: Any, here: dict[str, Any]) -> None:
    """Raise a ValueError naming the mismatch if shard ``saved`` cannot be loaded where ``here`` describes."""
    _check_format(saved)
    _compare_run(saved, here)
    _compare_precision(saved, here)
    _compare_layouts(saved["layout"], here["layout"])
    if "inner" in saved and "inner" in here:
        _compare_inner(saved["inner"], here["inner"])
        _check_state(saved["optimizer"], here["inner"]["pieces"])
        return
    saved_inners, states = _inners_of(saved)
    optimizer_set.check_same(saved_inners, _inners_of(here)[0], "this shard")
    if len(states) != len(here["inners"]):
        raise ValueError(f"this shard holds {len(states)} optimizer states for {len(saved_inners)} optimizers; "
                         "the checkpoint is damaged or was edited")
    for i, (a, b, state) in enumerate(zip(saved_inners, here["inners"], states)):
        _compare_pieces([[tuple(p) for p in group] for group in a["pieces"]], b["pieces"], f" of optimizer #{i}")
        _check_state(state, b["pieces"], whole=b["path"] == "whole")


# ----- header checks -----------------------------------------------------------------------------------


def _check_format(saved: Any) -> None:
    """The format tag (a clear refusal for older formats), and every key of this format."""
    tag = saved.get("format") if isinstance(saved, dict) else None
    if not isinstance(tag, str) or not tag.startswith("zero.shard/"):
        raise ValueError(
            f"not a ZeroOptimizer state dict (missing format tag {FORMAT!r}); save it with ZeroOptimizer.state_dict()"
        )
    if tag == "zero.shard/1":
        raise ValueError(
            "this shard is in the old format 'zero.shard/1', which does not record the wrapped optimizer's class "
            "or the sizes of its state, so it cannot be checked before loading; load it with the zero version "
            "that saved it, or resume from the model weights with a fresh optimizer"
        )
    if tag != FORMAT:
        raise ValueError(f"this shard is in format {tag!r}, which this version of zero cannot read ({FORMAT!r})")
    optimizers = ("inners", "optimizers") if "inners" in saved else ("inner", "optimizer")
    missing = [k for k in ("stage", "world_size", "rank", "layout", *optimizers) if k not in saved]
    if missing:
        raise ValueError(f"this {FORMAT} shard lacks {missing}; it is damaged: save it again with state_dict()")


def _compare_run(saved: dict[str, Any], here: dict[str, Any]) -> None:
    """Same world size, stage and rank."""
    if saved["world_size"] != here["world_size"]:
        raise ValueError(
            f"this checkpoint was saved at world size {saved['world_size']} but this run has world size "
            f"{here['world_size']}. This per-rank shard loads only at the world size that saved it: resume on "
            f"{saved['world_size']} ranks, or save with zero.save_checkpoint(), which loads at any world size."
        )
    for key in ("stage", "rank"):
        if saved[key] != here[key]:
            raise ValueError(
                f"this shard was saved with {key}={saved[key]} but is being loaded with {key}={here[key]}; "
                "each rank must load its own shard, saved with the same ZeRO stage"
            )


def _compare_precision(saved: dict[str, Any], here: dict[str, Any]) -> None:
    """The same mixed-precision policy, and the master weights and loss scale it implies (a shard saved
    before precision was recorded is full precision)."""
    was = saved.get("precision", FULL_PRECISION)
    if was != here["precision"]:
        raise ValueError(
            f"this shard was saved with precision {was} but this run uses {here['precision']}; resume with the "
            "same ZeroConfig.precision"
        )
    param_dtype = here["precision"]["param_dtype"]
    needed = {"master": param_dtype is not None, "loss_scale": param_dtype == "fp16"}
    missing = [key for key, needs in needed.items() if needs and key not in saved]
    if missing:
        raise ValueError(f"this {FORMAT} shard lacks {missing}; it is damaged: save it again with state_dict()")


def _compare_layouts(saved: dict[str, Any], here: dict[str, Any]) -> None:
    for i, (a, b) in enumerate(zip(saved["params"], here["params"])):
        if (a[0], tuple(a[1]), a[2]) != (b[0], tuple(b[1]), b[2]):
            raise ValueError(
                f"this checkpoint does not match the model: parameter #{i} was {a[0]} {tuple(a[1])} {a[2]} "
                f"when saved but is {b[0]} {tuple(b[1])} {b[2]} now"
            )
    if len(saved["params"]) != len(here["params"]):
        raise ValueError(
            f"this checkpoint has {len(saved['params'])} trainable parameters; the model has {len(here['params'])}"
        )
    if [tuple(x) for x in saved["buckets"]] != [tuple(x) for x in here["buckets"]]:
        raise ValueError(
            "this checkpoint was saved with a different bucket layout (bucket_size_mb); "
            "resume with the same ZeroConfig.bucket_size_mb"
        )


def _compare_inner(saved: dict[str, Any], here: dict[str, Any]) -> None:
    """Same wrapped optimizer class, and the same pieces in the same param groups."""
    if not isinstance(saved, dict) or not {"class", "pieces"} <= saved.keys():
        raise ValueError("this shard's 'inner' entry lacks the optimizer class or pieces; it is damaged")
    if saved["class"] != here["class"]:
        raise ValueError(
            f"this shard holds the state of a {saved['class']} but this ZeroOptimizer wraps a {here['class']}; "
            f"wrap a {saved['class']} to resume from it (optimizer state does not carry over between classes)"
        )
    saved_groups = [[tuple(p) for p in group] for group in saved["pieces"]]
    if len(saved_groups) != len(here["pieces"]):
        raise ValueError(
            f"this shard was saved with {len(saved_groups)} param groups but the wrapped optimizer has "
            f"{len(here['pieces'])}; build the optimizer with the same param groups as when it was saved"
        )
    _compare_pieces(saved_groups, here["pieces"], "")


def _compare_pieces(saved: list[list[PieceRecord]], here: list[list[PieceRecord]], of: str) -> None:
    """The same tensors in each param group (``of``: which optimizer, in the message)."""
    for gi, (a, b) in enumerate(zip(saved, here)):
        if a != b:
            raise ValueError(
                f"param group {gi}{of} held the pieces {_pieces_text(a)} when this shard was saved but holds "
                f"{_pieces_text(b)} now; build the optimizer with the same param groups as when it was saved"
            )


def _inners_of(shard: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The optimizers a shard or header describes (one flat ``inner``, or ``inners``) and their states."""
    if "inner" in shard:
        inner = shard["inner"]
        if not isinstance(inner, dict) or not {"class", "pieces"} <= inner.keys():
            raise ValueError("this shard's 'inner' entry lacks the optimizer class or pieces; it is damaged")
        return [{**inner, "path": "flat", "groups": len(inner["pieces"])}], [shard.get("optimizer")]
    inners = shard["inners"]
    keys = {"class", "path", "groups", "pieces"}
    if (not isinstance(inners, list) or not inners or not all(isinstance(i, dict) and keys <= i.keys() for i in inners)
            or not all(i["path"] in optimizer_set.PATHS for i in inners)):
        raise ValueError("this shard's 'inners' entry is not a list of {class, path, groups, pieces}; it is damaged")
    states = shard.get("optimizers")
    return inners, states if isinstance(states, list) else []


# ----- state checks --------------------------------------------------------------------------------------


def _check_state(inner: Any, pieces: list[list[PieceRecord]], whole: bool = False) -> None:
    """Every state entry belongs to a piece, and every state tensor is 0-dim or exactly its piece's size (with
    ``whole``, the pieces are whole parameters, whose state the optimizer shapes as it likes)."""
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict):
        raise ValueError("this shard's 'optimizer' entry is not a torch.optim state dict (no 'state' mapping)")
    piece_at = _piece_indices(inner.get("param_groups"), pieces)
    for index, entry in inner["state"].items():
        if index not in piece_at:
            raise ValueError(
                f"this shard has optimizer state for tensor index {index!r}, which no param group lists "
                f"(this rank's optimizer steps {len(piece_at)} tensors); the checkpoint is damaged or was edited"
            )
        if not isinstance(entry, dict):
            raise ValueError(f"the optimizer state of tensor index {index} is a {type(entry).__name__}, not a dict")
        for name, value in [] if whole else entry.items():
            _check_state_value(name, value, index, piece_at[index])


def _piece_indices(groups: Any, pieces: list[list[PieceRecord]]) -> dict[int, PieceRecord]:
    """Map the saved state dict's tensor indices to this rank's pieces, group by group (as torch loads them)."""
    if not isinstance(groups, list) or len(groups) != len(pieces):
        found = len(groups) if isinstance(groups, list) else "no"
        raise ValueError(
            f"this shard's optimizer state has {found} param groups but the wrapped optimizer has {len(pieces)}; "
            "the checkpoint is damaged or was edited"
        )
    piece_at: dict[int, PieceRecord] = {}
    for gi, (group, records) in enumerate(zip(groups, pieces)):
        indices = group.get("params") if isinstance(group, dict) else None
        if not isinstance(indices, list) or len(indices) != len(records):
            found = len(indices) if isinstance(indices, list) else "no"
            raise ValueError(
                f"param group {gi} of this shard's optimizer state lists {found} tensors but this rank's optimizer "
                f"steps {len(records)} in it ({_pieces_text(records)}); the checkpoint is damaged or was edited"
            )
        for index, record in zip(indices, records):
            if type(index) is not int or index in piece_at:
                raise ValueError(
                    f"param group {gi} of this shard's optimizer state lists a bad or repeated tensor index "
                    f"{index!r}; the checkpoint is damaged or was edited"
                )
            piece_at[index] = record
    return piece_at


def _check_state_value(name: Any, value: Any, index: int, piece: PieceRecord) -> None:
    """Tensors must be 0-dim (``step``) or 1D of the piece's numel; other values are the optimizer's own."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return
    param, start, numel = piece
    if tuple(value.shape) != (numel,):
        raise ValueError(
            f"optimizer state {name!r} of parameter {param!r} (elements {start}:{start + numel}, tensor index "
            f"{index}) has shape {tuple(value.shape)} in this shard but that piece has {numel} elements "
            f"(expected shape ({numel},)); the checkpoint is damaged or was edited"
        )


# ----- text ---------------------------------------------------------------------------------------------


def _whole_record(slot_of: dict[int, ParamSlot], tensor: torch.Tensor, optimizer: torch.optim.Optimizer,
                  gi: int) -> PieceRecord:
    """``(parameter name, 0, numel)`` of the owned whole parameter whose stand-in is ``tensor``."""
    if id(tensor) not in slot_of:
        raise ValueError(
            f"param group {gi} of the {class_name(optimizer)} holds a tensor of shape {tuple(tensor.shape)} "
            "that is not one of this rank's whole parameters; pass the rebuilt optimizers (ZeroOptimizer.optimizers)"
        )
    slot = slot_of[id(tensor)]
    return (slot.name, 0, slot.span.numel)


def _record(local_piece: LocalPiece) -> PieceRecord:
    """``(parameter name, start, numel)`` of a :class:`~zero.runtime.buffers.bucket.LocalPiece`."""
    return (local_piece.slot.name, local_piece.piece.param_start, local_piece.piece.numel)


def _pieces_text(records: list[PieceRecord], shown: int = 4) -> str:
    text = ", ".join(f"{name}[{start}:{start + numel}]" for name, start, numel in records[:shown])
    more = f", ... ({len(records)} pieces)" if len(records) > shown else ""
    return f"[{text}{more}]"
