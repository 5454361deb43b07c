"""Saving a portable checkpoint (:mod:`zero.checkpoint.portable`: the format, and what makes it atomic): each
rank writes what it alone owns (with several optimizers or whole-parameter ones, the whole state of the parameters
it owns too), then rank 0 writes ``metadata.json`` and renames the directory into place. Every rank of a pipeline
writes into one checkpoint of the whole model (:mod:`zero.checkpoint.portable.pipeline`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

import zero.checkpoint.portable.directory as checkpoint_directory
import zero.checkpoint.portable.tensorfile as tensorfile
import zero.checkpoint.portable.tree as tree
import zero.checkpoint.portable.whole_state as whole_state
from zero.checkpoint import optimizer_set
from zero.checkpoint.portable.boxes import Box, label, local_tensor, replicated
from zero.checkpoint.portable.model_tensors import (
    Checkpointable,
    Grid,
    Model,
    ModelTensor,
    checked,
    describe,
    parts_of,
    slot_names,
)
from zero.checkpoint.portable.pipeline import pipeline_view
from zero.checkpoint.portable.schema import BOXES_FORMAT, FORMAT, OPTIMIZERS_FORMAT, CheckpointMetadata, part_name
from zero.checkpoint.portable.tensorfile import Spec
from zero.checkpoint.progress import ByteMeter, ProgressArg
from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket
from zero.version import __version__


def save_checkpoint(
    path: str | os.PathLike,
    model: Model,
    optimizer: Checkpointable,
    *,
    scheduler: Any = None,
    extra: Any = None,
    progress: ProgressArg = True,
) -> Path:
    """Save ``model`` and ``optimizer`` (and an LR ``scheduler``'s state, and ``extra``) to directory ``path``.

    Call it on every rank. It loads at any world size and stage (:func:`load_checkpoint`), and
    exports to one file with :func:`zero.consolidate`. ``extra`` is any tree of dicts, lists,
    tuples, strings, numbers and tensors (a data loader's position, an RNG state): it is stored as
    JSON plus tensors, never pickled. An existing checkpoint at ``path`` is replaced atomically;
    anything else there is refused, and so is a ``PATH.partial`` or ``PATH.replaced`` that an
    interrupted save of ``path`` did not leave. A symlink at ``path`` is replaced by the new
    checkpoint; the directory it pointed to is left as it was. ``progress``: print progress on
    rank 0 (``True``), nothing (``False``) or a callable ``(bytes done, bytes total)``, called on
    every rank. Returns ``path``. With hierarchical sharding the first shard group writes the shards, which every
    group holds alike, and the other groups wait for it (the checkpoint is a ``shard_size``-rank world's).

    A pipeline's part (its pipeline known to the optimizer: a ``zero.pipelining.PipelineStage`` over it, or
    ``mesh=`` with a ``"pp"`` dimension) saves into one checkpoint of the whole model with every rank of the
    pipeline, under the parts' names; ``model`` is the part, or this rank's parts as a list or as the
    ``nn.ModuleList`` the optimizer wraps (each part's names, without the list's index).
    """
    opt = checked(model, optimizer)
    replicas = opt.comm.replicas
    if replicas is None:
        return _save(path, model, opt, scheduler, extra, progress)

    def write() -> str | None:
        return str(_save(path, model, opt, scheduler, extra, progress)) if replicas.rank == 0 else None

    return Path(replicas.everywhere(write, "saving the checkpoint in the first shard group", share=True)[0])


def _save(path: str | os.PathLike, model: Model, opt: Checkpointable, scheduler: Any, extra: Any,
          progress: ProgressArg) -> Path:
    grid = Grid.of(opt)
    final = Path(path)
    partial, _ = checkpoint_directory.siblings(final)
    opt.prepare_for_checkpoint()
    optimizers = optimizer_set.records(opt.runtime.inners)
    one_flat = len(optimizers) == 1 and optimizers[0]["path"] == "flat"  # format 2, as before format 3
    boxed = grid.tp is not None  # format 4: a tensor-parallel model's tensors as boxes of their global shapes

    def describe_model() -> tuple:
        state = {"param_groups": _hyperparameters(opt), "scheduler": _state_of(scheduler), "extra": extra,
                 "loss_scale": opt.loss_scaler.state_dict() if opt.loss_scaler is not None else None}
        tensors: list[torch.Tensor] = []
        encoded = tree.encode(state, tensors)  # on every rank: a bad ``extra`` fails everywhere, before any write
        return (*describe(parts_of(model, opt), opt), encoded, tensors)

    model_tensors, aliases, encoded, tensors = grid.everywhere(describe_model, "describing the model")
    pipeline = pipeline_view(grid, opt, model_tensors, aliases, boxed, encoded["param_groups"], optimizers)

    def prepare() -> tuple:
        writes, placed = _my_writes(opt, grid, model_tensors, pipeline.elsewhere)
        if grid.rank == 0:
            writes += [(Spec(f"x/{i}", t.dtype, tuple(t.shape)), lambda t=t: t) for i, t in enumerate(tensors)]
            checkpoint_directory.prepare(final)
        return writes, placed

    writes, placed = grid.everywhere(prepare, "preparing the save")
    report = progress if grid.rank == 0 or callable(progress) else False
    meter = ByteMeter(f"saving {final}", sum(spec.nbytes for spec, _ in writes), report)
    manifests = grid.everywhere(lambda: _write_part(partial, grid, writes, placed, meter), "writing its part",
                                share=True)
    meta = {
        "format": BOXES_FORMAT if boxed else FORMAT if one_flat else OPTIMIZERS_FORMAT, "zero_version": __version__,
        "torch_version": torch.__version__, "world_size": grid.world_size,
        **({"tensor_parallel": grid.tp_size} if boxed else {}), "stage": opt.config.stage,
        "config": opt.config.model_dump(mode="json"), "optimizer_class": " + ".join(o["class"] for o in optimizers),
        "step": max(m["step"] for m in manifests),
        "tensors": pipeline.records, "aliases": pipeline.aliases, "state": encoded,
        "files": [{"name": part_name(r, grid.world_size), "bytes": m["bytes"], "entries": m["entries"]}
                  for r, m in enumerate(manifests)],
        **({} if one_flat and not boxed else {"optimizers": optimizers}),
    }
    boxes: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for rank, manifest in enumerate(manifests):
        for name, records in manifest["pieces"].items():
            pieces = [[rank, *record] for record in records]
            if not boxed:
                meta["tensors"][name]["pieces"].extend(pieces)
                continue
            offset, size = manifest["boxes"][name]
            if (name, tuple(offset)) not in boxes:
                boxes[name, tuple(offset)] = {"offset": offset, "size": size, "pieces": []}
                meta["tensors"][name]["boxes"].append(boxes[name, tuple(offset)])
            boxes[name, tuple(offset)]["pieces"].extend(pieces)
        for name, record in manifest["whole"].items():
            meta["tensors"][name]["whole_state"] = {"file": rank, **record}
    note = grid.everywhere(lambda: _publish(partial, final, meta) if grid.rank == 0 else None,
                           "publishing the checkpoint")
    parts = f"{grid.world_size} part{'s' if grid.world_size > 1 else ''}"
    meter.finish(f"saved {final} ({parts}{'; ' + note if note else ''})")
    return final


Write = tuple[Spec, Callable[[], torch.Tensor]]


def _my_writes(opt: Checkpointable, grid: Grid, model_tensors: list[ModelTensor],
               elsewhere: set[str]) -> tuple[list[Write], dict]:
    """What this rank writes: its chunk of each bucket it writes (values and the flat optimizer state, piece by
    piece), its share of the tensors kept whole, and the optimizer state of the whole parameters it writes; and
    where they go in the metadata: ``{"pieces": {tensor name: [[start, numel, value key, {state name: key}], ...]},
    "whole": {parameter name: {"keys", "tree"}}}``. A tensor-parallel model's (format 4): pieces of each tensor's
    local box, keys with the box's offset (``v/NAME/OFFSET/START``), ``"boxes": {tensor name: [offset, size]}``; a
    replicated tensor (plain, or ``Replicate()``) and the whole-parameter state (each tp rank's owner steps the global
    tensor) are written by tp rank 0 alone. Nothing of the tensors another pp rank writes (``elsewhere``)."""
    comm, boxed = opt.comm, grid.tp is not None
    writes: list[Write] = []
    pieces: dict[str, list] = {}
    boxes: dict[str, list] = {}
    names = slot_names(model_tensors)
    mine = {h.name for h in model_tensors if h.name not in elsewhere
            and (not boxed or grid.tp_rank == 0 or not replicated(h.tensor))}
    for h in model_tensors:
        if boxed and h.name in mine:
            box = h.box or Box.whole(h.tensor.shape)
            boxes[h.name] = [list(box.offset), list(box.size)]
    flat_state = [inner.optimizer.state for inner in opt.runtime.inners if not inner.whole]
    for bucket in opt.buckets:
        if _writer(bucket, comm) != comm.rank:
            continue
        source = bucket.master if bucket.trainable else bucket.shard
        slot_of = {s.span.param_index: s for s in bucket.slots}
        local = {(id(p.slot), p.piece.param_start): p.tensor for p in bucket.pieces}
        for piece in bucket.layout.pieces(bucket.shard_index):
            slot = slot_of[piece.param_index]
            name = names[id(slot)]
            if name not in mine:
                continue
            key = f"{name}/{_box_key(boxes, name)}{piece.param_start}"
            values = source.narrow(0, piece.chunk_start, piece.numel)
            writes.append((Spec(f"v/{key}", values.dtype, (piece.numel,)), lambda v=values: v))
            tensor = local.get((id(slot), piece.param_start))
            state = next((s[tensor] for s in flat_state if tensor in s), {}) if tensor is not None else {}
            for state_name, value in state.items():
                if not isinstance(value, torch.Tensor) or value.dim() not in (0, 1):
                    raise ValueError(f"optimizer state {state_name!r} of {name!r} is not a tensor of the "
                                     "piece's size or a scalar tensor; this optimizer cannot be checkpointed")
                writes.append((Spec(f"s/{key}/{state_name}", value.dtype, tuple(value.shape)), lambda v=value: v))
            record = [piece.param_start, piece.numel, f"v/{key}", {n: f"s/{key}/{n}" for n in state}]
            pieces.setdefault(name, []).append(record)
    whole = [h for h in model_tensors if h.slot is None]
    for i, h in enumerate(whole):
        values = local_tensor(h.tensor).detach()
        if i % comm.world_size == comm.rank and h.name in mine and (values.numel() or not boxed):
            key = f"w/{h.name}" + (f"/{_box_key(boxes, h.name)[:-1]}" if boxed else "")
            writes.append((Spec(key, values.dtype, tuple(values.shape)), lambda t=values: t))
            pieces[h.name] = [[0, values.numel(), key, {}]]
    whole = {}
    for name, state, optimizer in _whole_states(opt, names) if grid.tp_rank == 0 else []:  # the same on each tp rank
        if name in elsewhere:
            continue
        record, tensors = whole_state.encode(state, name, optimizer_set.class_name(optimizer))
        writes += [(Spec(key, t.dtype, tuple(t.shape)), lambda t=t: t) for key, t in zip(record["keys"], tensors)]
        whole[name] = record
    return writes, {"pieces": pieces, "whole": whole, **({"boxes": boxes} if boxed else {})}


def _box_key(boxes: dict[str, list], name: str) -> str:
    """Format 4: the offset of ``name``'s box in its entry keys (``16,0/``); else nothing."""
    return f"{label(boxes[name][0])}/" if name in boxes else ""


def _whole_states(opt: Checkpointable, names: dict[int, str]) -> list[tuple[str, dict, torch.optim.Optimizer]]:
    """``(parameter name, optimizer state, optimizer)`` of each parameter stepped whole that this rank writes and
    that has state: its owner writes it, or with one shard (stage 0), where every rank owns every such parameter,
    rank ``i mod N`` the ``i``-th of them in model order."""
    owners = opt.runtime.whole_parameter_step
    one_shard = owners.exchange.num_shards == 1
    order = {key: i for i, key in enumerate(owners.slot_of)}
    writer = {id(stand_in): (order[key] % opt.comm.world_size if one_shard else opt.comm.rank)
              for key, stand_in in owners.stand_ins.items()}
    slot_of = {id(stand_in): slot for slot, stand_in in owners.owned()}
    found = []
    for inner in opt.runtime.inners:
        if not inner.whole:
            continue
        for group in inner.optimizer.param_groups:
            for stand_in in group["params"]:
                state = inner.optimizer.state.get(stand_in)
                if state and writer[id(stand_in)] == opt.comm.rank:
                    found.append((names[id(slot_of[id(stand_in)])], state, inner.optimizer))
    return found


def _writer(bucket: Bucket, comm: Communicator) -> int:
    """The rank that writes ``bucket``'s chunk: its owner, or at stage 0 (one shard) rank ``index mod N``."""
    return bucket.shard_index if bucket.layout.num_shards > 1 else bucket.index % comm.world_size


def _write_part(partial: Path, grid: Grid, writes: list[Write], placed: dict[str, Any],
                meter: ByteMeter) -> dict[str, Any]:
    """Write this rank's file; return its manifest (entries, pieces by tensor name, whole-parameter state by
    parameter name, boxes by tensor name in format 4, size, largest ``step``)."""
    file = partial / part_name(grid.rank, grid.world_size)
    specs = [spec for spec, _ in writes]
    entries = tensorfile.write(file, specs, (make() for _, make in writes), on_bytes=meter.advance).entries
    steps = [float(make()) for spec, make in writes if spec.key.startswith("s/") and spec.key.endswith("/step")]
    steps += [float(make()) for spec, make in writes if spec.key.startswith(whole_state.PREFIX)
              and spec.key.endswith("/step") and spec.shape == ()]
    return {"entries": {k: e.to_json() for k, e in entries.items()}, **placed,
            "bytes": file.stat().st_size, "step": int(max(steps, default=0))}


def _publish(partial: Path, final: Path, meta: dict[str, Any]) -> str | None:
    """Write the metadata last, then rename the directory into place (the old checkpoint set aside meanwhile).
    What is written must pass the schema a load checks (an internal invariant: a save that succeeds loads)."""
    for record in meta["tensors"].values():
        for box in record.get("boxes", [record]):
            box["pieces"].sort(key=lambda p: p[1])
        if "boxes" in record:
            record["boxes"].sort(key=lambda b: b["offset"])
    text = json.dumps(meta).encode()
    CheckpointMetadata.model_validate_json(text, strict=True)
    return checkpoint_directory.publish(partial, final, text)


def _hyperparameters(opt: Checkpointable) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _state_of(scheduler: Any) -> Any:
    return scheduler.state_dict() if scheduler is not None else None
