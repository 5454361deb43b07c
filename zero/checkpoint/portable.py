"""Portable checkpoints: :func:`save_checkpoint` on N ranks, :func:`load_checkpoint` on M, at any stage.

Every rank calls both. Saving, each rank writes what it alone owns (its chunk of every bucket:
master weights or parameters, and the optimizer state beside them; at stage 0, where every
rank owns everything, bucket ``b`` is written by rank ``b mod N``), plus its share of the
tensors kept whole (frozen parameters at stages 0-2, buffers). Rank 0 then writes
``metadata.json`` (see :mod:`zero.checkpoint.files`) and renames the directory into place.
Loading, each rank reads the ranges it owns now from whichever files hold them.

Notes:

* **Atomic.** A save goes to ``PATH.partial``; only when every rank has written and fsynced its
  part and rank 0 has written the metadata (with each entry's CRC-32, and its own SHA-256 beside it)
  is it renamed to ``PATH``. Saving over an existing checkpoint renames the old one to
  ``PATH.replaced`` for the moment between the two renames. A crash at any point leaves a loadable
  checkpoint, and the next save finishes or clears what it left; nothing that this library did not
  write is ever deleted (:mod:`zero.checkpoint.directory`: each step, and what a crash leaves).
* **Checked before anything changes.** A load checks the metadata (checksum, schema, the parts'
  headers: :mod:`zero.checkpoint.files`) and against the model and optimizer, and verifies the CRC
  of every byte this rank will read, on every rank, and the ranks agree, before the first value is
  written. A refused load leaves the running model and optimizer untouched.
* **Never hangs on one rank's error.** Each phase ends with ``Communicator.everywhere``: a small
  all-gather of every rank's outcome (with the timeout), so an error on one rank is raised on all of them.
* **Why not torch.distributed.checkpoint.** DCP reshards on load too, but its metadata is a pickle
  (loading one runs code), it has no checksums, and it writes into the target directory in place.
  Our pieces are plain 1D ranges of flattened parameters, so the resharding is one intersection
  (:meth:`Checkpoint.read`), and the files are safetensors that any tool reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from zero.checkpoint import directory as checkpoint_directory
from zero.checkpoint import tensorfile, tree
from zero.checkpoint.files import Checkpoint
from zero.checkpoint.progress import Progress, ProgressArg
from zero.checkpoint.schema import FORMAT, CheckpointMetadata, part_name
from zero.checkpoint.shard_header import class_name
from zero.checkpoint.tensorfile import Spec
from zero.comm import Communicator
from zero.optimizer import ZeroOptimizer
from zero.runtime.bucket import Bucket, ParamSlot


@dataclass
class Held:
    """One tensor of the model's ``state_dict``: managed in a bucket (``slot``) or kept whole."""

    name: str
    tensor: torch.Tensor
    kind: str  # "param" or "buffer"
    slot: ParamSlot | None = None

    @property
    def saved_dtype(self) -> torch.dtype:
        if self.slot is None:
            return self.tensor.dtype
        bucket = self.slot.bucket
        return bucket.master.dtype if bucket.trainable else bucket.shard.dtype

    def record(self) -> dict[str, Any]:
        """Its ``tensors`` entry in the metadata (:class:`zero.checkpoint.schema.TensorRecord`), pieces to come."""
        trainable = self.slot is not None and self.slot.bucket.trainable
        return {
            "kind": self.kind, "shape": list(self.tensor.shape), "dtype": tensorfile.dtype_code(self.saved_dtype),
            "trainable": trainable, "group": self.slot.group_index if trainable else -1, "pieces": [],
        }


# ----- saving ------------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: ZeroOptimizer,
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
    every rank. Returns ``path``.
    """
    opt = _checked(model, optimizer)
    comm = opt.comm
    final = Path(path)
    partial, _ = checkpoint_directory.siblings(final)
    opt.settle_for_checkpoint()

    def prepare() -> tuple:
        held, aliases = describe(model, opt)
        state = {"param_groups": _hyperparameters(opt), "scheduler": _state_of(scheduler), "extra": extra,
                 "loss_scale": opt.loss_scaler.state_dict() if opt.loss_scaler is not None else None}
        tensors: list[torch.Tensor] = []
        encoded = tree.encode(state, tensors)  # on every rank: a bad ``extra`` fails everywhere, before any write
        writes, pieces = _my_writes(opt, held)
        if comm.rank == 0:
            writes += [(Spec(f"x/{i}", t.dtype, tuple(t.shape)), lambda t=t: t) for i, t in enumerate(tensors)]
            checkpoint_directory.prepare(final)
        return held, aliases, encoded, writes, pieces

    held, aliases, encoded, writes, pieces = comm.everywhere(prepare, "preparing the save")
    report = progress if comm.rank == 0 or callable(progress) else False
    meter = Progress(f"saving {final}", sum(spec.nbytes for spec, _ in writes), report)
    manifests = comm.everywhere(lambda: _write_part(partial, comm, writes, pieces, meter), "writing its part",
                                share=True)
    meta = {
        "format": FORMAT, "zero_version": _version(), "torch_version": torch.__version__,
        "world_size": comm.world_size, "stage": opt.config.stage, "config": opt.config.model_dump(mode="json"),
        "optimizer_class": class_name(opt.inner), "step": max(m["step"] for m in manifests),
        "tensors": {h.name: h.record() for h in held}, "aliases": aliases, "state": encoded,
        "files": [{"name": part_name(r, comm.world_size), "bytes": m["bytes"], "entries": m["entries"]}
                  for r, m in enumerate(manifests)],
    }
    for rank, manifest in enumerate(manifests):
        for name, records in manifest["pieces"].items():
            meta["tensors"][name]["pieces"].extend([rank, *record] for record in records)
    note = comm.everywhere(lambda: _publish(partial, final, meta) if comm.rank == 0 else None,
                           "publishing the checkpoint")
    parts = f"{comm.world_size} part{'s' if comm.world_size > 1 else ''}"
    meter.finish(f"saved {final} ({parts}{'; ' + note if note else ''})")
    return final


def describe(model: torch.nn.Module, opt: ZeroOptimizer) -> tuple[list[Held], dict[str, str]]:
    """The model's ``state_dict`` tensors by first name, and its other names (tied parameters): ``{alias: name}``."""
    slot_of = {id(s.param): s for b in opt.buckets for s in b.slots}
    params = {id(p) for p in model.parameters()}
    held: list[Held] = []
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"the model's state_dict entry {name!r} is a {type(value).__name__}, not a tensor; "
                             "save it through extra= instead")
        if id(value) in first:
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        slot = slot_of.get(id(value))
        held.append(Held(name, value, "param" if id(value) in params else "buffer", slot))
    missing = [s.name for s in slot_of.values() if s.name not in first.values()]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are managed by the optimizer but not in model.state_dict()")
    return held, aliases


Write = tuple[Spec, Callable[[], torch.Tensor]]


def _my_writes(opt: ZeroOptimizer, held: list[Held]) -> tuple[list[Write], dict[str, list]]:
    """What this rank writes: its chunk of each bucket it writes (values and optimizer state, piece by
    piece) and its share of the tensors kept whole; and those pieces by tensor name, as the metadata
    records them: ``[start, numel, value key, {state name: key}]``."""
    comm = opt.comm
    writes: list[Write] = []
    pieces: dict[str, list] = {}
    for bucket in opt.buckets:
        if _writer(bucket, comm) != comm.rank:
            continue
        source = bucket.master if bucket.trainable else bucket.shard
        slot_of = {s.span.param_index: s for s in bucket.slots}
        local = {(p.slot.name, p.piece.param_start): p.tensor for p in bucket.pieces}
        for piece in bucket.layout.pieces(bucket.shard_index):
            slot = slot_of[piece.param_index]
            key = f"{slot.name}/{piece.param_start}"
            values = source.narrow(0, piece.chunk_start, piece.numel)
            writes.append((Spec(f"v/{key}", values.dtype, (piece.numel,)), lambda v=values: v))
            tensor = local.get((slot.name, piece.param_start))
            state = opt.inner.state.get(tensor, {}) if tensor is not None else {}
            for state_name, value in state.items():
                if not isinstance(value, torch.Tensor) or value.dim() not in (0, 1):
                    raise ValueError(f"optimizer state {state_name!r} of {slot.name!r} is not a tensor of the "
                                     "piece's size or a scalar tensor; this optimizer cannot be checkpointed")
                writes.append((Spec(f"s/{key}/{state_name}", value.dtype, tuple(value.shape)), lambda v=value: v))
            record = [piece.param_start, piece.numel, f"v/{key}", {n: f"s/{key}/{n}" for n in state}]
            pieces.setdefault(slot.name, []).append(record)
    whole = [h for h in held if h.slot is None]
    for i, h in enumerate(whole):
        if i % comm.world_size == comm.rank:
            writes.append((Spec(f"w/{h.name}", h.tensor.dtype, tuple(h.tensor.shape)), lambda t=h.tensor: t.detach()))
            pieces[h.name] = [[0, h.tensor.numel(), f"w/{h.name}", {}]]
    return writes, pieces


def _writer(bucket: Bucket, comm: Communicator) -> int:
    """The rank that writes ``bucket``'s chunk: its owner, or at stage 0 (one shard) rank ``index mod N``."""
    return bucket.shard_index if bucket.layout.num_shards > 1 else bucket.index % comm.world_size


def _write_part(partial: Path, comm: Communicator, writes: list[Write], pieces: dict[str, list],
                meter: Progress) -> dict[str, Any]:
    """Write this rank's file; return its manifest (entries, pieces by tensor name, size, largest ``step``)."""
    file = partial / part_name(comm.rank, comm.world_size)
    specs = [spec for spec, _ in writes]
    entries = tensorfile.write(file, specs, (make() for _, make in writes), on_bytes=meter.advance).entries
    steps = [float(make()) for spec, make in writes if spec.key.startswith("s/") and spec.key.endswith("/step")]
    return {"entries": {k: e.to_json() for k, e in entries.items()}, "pieces": pieces,
            "bytes": file.stat().st_size, "step": int(max(steps, default=0))}


def _publish(partial: Path, final: Path, meta: dict[str, Any]) -> str | None:
    """Write the metadata last, then rename the directory into place (the old checkpoint set aside meanwhile).
    What is written must pass the schema a load checks (an internal invariant: a save that succeeds loads)."""
    for record in meta["tensors"].values():
        record["pieces"].sort(key=lambda p: p[1])
    text = json.dumps(meta).encode()
    CheckpointMetadata.model_validate_json(text, strict=True)
    return checkpoint_directory.publish(partial, final, text)


# ----- loading ----------------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: ZeroOptimizer | None = None,
    *,
    scheduler: Any = None,
    progress: ProgressArg = True,
) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` at any world size and stage; return its ``extra``.

    Call it on every rank, after building the model and its ``ZeroOptimizer`` as for training (any
    stage, world size, precision or offload; the optimizer's class and parameter groups as when
    saved: their hyperparameters, e.g. the learning rate, come from the checkpoint). Restores the
    parameters (from the fp32 master weights when they were saved), buffers, the optimizer state,
    the loss scale and, if given, ``scheduler``. With ``optimizer=None`` it loads only the weights
    into a plain, unwrapped model (single process). Everything is checked first (the model's names
    and shapes, the optimizer, the files' sizes and checksums): a refused load changes nothing.
    """
    if optimizer is None:
        return _load_plain(path, model, progress)
    opt = _checked(model, optimizer)
    comm = opt.comm
    ckpt = comm.everywhere(lambda: Checkpoint(path), "opening the checkpoint")
    try:
        report = progress if comm.rank == 0 or callable(progress) else False
        plan = comm.everywhere(lambda: _plan(ckpt, model, opt, report), "checking the checkpoint")
        opt.settle_for_checkpoint()
        _apply(ckpt, opt, plan)
        if scheduler is not None and plan.state["scheduler"] is not None:
            scheduler.load_state_dict(plan.state["scheduler"])
        ranks = ckpt.meta.world_size
        plan.meter.finish(f"loaded {ckpt.path} "
                          f"(saved on {ranks} rank{'s' if ranks > 1 else ''} at stage {ckpt.meta.stage})")
        return plan.state["extra"]
    finally:
        ckpt.close()


@dataclass
class LoadPlan:
    held: list[Held]
    state: dict[str, Any]  # the decoded trees: param_groups, scheduler, extra, loss_scale
    meter: Progress


def _plan(ckpt: Checkpoint, model: torch.nn.Module, opt: ZeroOptimizer, report: ProgressArg) -> LoadPlan:
    """Every check, and the checksums of everything this rank reads; nothing is changed."""
    held, aliases = describe(model, opt)
    shapes = {h.name: tuple(h.tensor.shape) for h in held}
    _check_names(ckpt, {**shapes, **{alias: shapes[name] for alias, name in aliases.items()}})
    _check_optimizer(ckpt, opt, held)
    keys = ckpt.extra_keys()
    for h in held:
        for start, numel in _ranges(h, opt):
            keys |= ckpt.keys_of(h.name, start, numel, state=h.slot is not None and h.slot.bucket.trainable)
    meter = Progress(f"loading {ckpt.path}", sum(ckpt.entries[f][k].nbytes for f, k in keys), report)
    ckpt.verify(keys, on_bytes=meter.advance)
    state = tree.decode(ckpt.meta.state.model_dump(), ckpt.extra_tensor)
    if len(state["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"{ckpt.path} was saved with {len(state['param_groups'])} param groups but the optimizer has "
                         f"{len(opt.param_groups)}; build it with the same param groups as when it was saved")
    return LoadPlan(held, state, meter)


def _check_names(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]], shown: int = 4) -> None:
    """The model's ``state_dict`` names (tied names included) and ``shapes`` are those the checkpoint holds. The
    refusal names the shape mismatches first, then the names only the checkpoint has, then those only the model
    has, each with its count (the first ``shown`` of each listed)."""
    aliases = ckpt.meta.aliases
    saved = {name: tuple(ckpt.tensors[aliases.get(name, name)].shape) for name in [*ckpt.tensors, *aliases]}
    differ = [name for name in sorted(saved.keys() & shapes.keys()) if saved[name] != tuple(shapes[name])]
    only_saved, only_model = sorted(saved.keys() - shapes.keys()), sorted(shapes.keys() - saved.keys())
    if not (differ or only_saved or only_model):
        return
    halves = []
    if differ:
        listed = ", ".join(f"{n!r} is {saved[n]} in the checkpoint but {tuple(shapes[n])} in the model"
                           for n in differ[:shown])
        halves.append(f"{_count(differ, 'tensor')} of another shape ({listed}{_more(differ, shown)})")
    if only_saved:
        halves.append(f"the checkpoint has {_count(only_saved, 'tensor')} that the model lacks "
                      f"({', '.join(map(repr, only_saved[:shown]))}{_more(only_saved, shown)})")
    if only_model:
        halves.append(f"the model has {_count(only_model, 'tensor')} that the checkpoint lacks "
                      f"({', '.join(map(repr, only_model[:shown]))}{_more(only_model, shown)})")
    raise ValueError(f"{ckpt.path} is a checkpoint of another model: {'; '.join(halves)}")


def _count(names: list[str], what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) > 1 else ''}"


def _more(names: list[str], shown: int) -> str:
    return f", and {len(names) - shown} more" if len(names) > shown else ""


def _check_optimizer(ckpt: Checkpoint, opt: ZeroOptimizer, held: list[Held]) -> None:
    """The same optimizer class, and every trainable parameter in the same param group."""
    has_state = any(p.state for pieces in ckpt.pieces.values() for p in pieces)
    saved_class = ckpt.meta.optimizer_class
    if has_state and saved_class != class_name(opt.inner):
        raise ValueError(f"{ckpt.path} holds the state of a {saved_class} but this ZeroOptimizer wraps "
                         f"a {class_name(opt.inner)}; wrap a {saved_class} to resume from it")
    for h in held:
        if h.slot is None or not h.slot.bucket.trainable:
            continue
        record = ckpt.tensors[ckpt.meta.aliases.get(h.name, h.name)]
        if record.trainable and record.group != h.slot.group_index:
            raise ValueError(f"{h.name!r} was in param group {record.group} when saved but is in group "
                             f"{h.slot.group_index} now; build the optimizer with the same param groups")


def _ranges(h: Held, opt: ZeroOptimizer) -> list[tuple[int, int]]:
    """The element ranges of ``h`` this rank holds: its pieces in its bucket's chunk, or all of it."""
    if h.slot is None:
        return [(0, h.tensor.numel())]
    bucket = h.slot.bucket
    return [(p.param_start, p.numel) for p in bucket.layout.pieces(bucket.shard_index)
            if p.param_index == h.slot.span.param_index]


def _apply(ckpt: Checkpoint, opt: ZeroOptimizer, plan: LoadPlan) -> None:
    """Write the values into masters, shards and whole tensors; rebuild the optimizer state; share."""
    aliases = ckpt.meta.aliases
    with torch.no_grad():
        for h in plan.held:
            name = aliases.get(h.name, h.name)
            if h.slot is None:
                ckpt.read(name, 0, h.tensor.numel(), h.tensor.data.view(-1))
                continue
            bucket = h.slot.bucket
            target = bucket.master if bucket.trainable else bucket.shard
            for p in bucket.layout.pieces(bucket.shard_index):
                if p.param_index == h.slot.span.param_index:
                    ckpt.read(name, p.param_start, p.numel, target.narrow(0, p.chunk_start, p.numel))
    opt.inner.state.clear()
    piece_of = {id(p.tensor): p for b in opt.buckets for p in b.pieces}
    state, groups, index = {}, [], 0
    for group, hyper in zip(opt.inner.param_groups, plan.state["param_groups"]):
        ids = []
        for tensor in group["params"]:
            piece = piece_of[id(tensor)]
            saved = ckpt.read_state(aliases.get(piece.slot.name, piece.slot.name), piece.piece.param_start,
                                    piece.piece.numel)
            if saved:
                state[index] = saved
            ids.append(index)
            index += 1
        groups.append({**hyper, "params": ids})
    opt.finish_load({"state": state, "param_groups": groups}, plan.state["loss_scale"])


def _load_plain(path: str | os.PathLike, model: torch.nn.Module, progress: ProgressArg) -> Any:
    """Weights only, into an unwrapped model (one process)."""
    with Checkpoint(path) as ckpt:
        sd = model.state_dict(keep_vars=True)
        _check_names(ckpt, {name: tuple(tensor.shape) for name, tensor in sd.items()})
        names = {name: ckpt.meta.aliases.get(name, name) for name in sd}
        keys = ckpt.extra_keys()
        for name in set(names.values()):
            keys |= ckpt.keys_of(name, 0, ckpt.numel(name), state=False)
        meter = Progress(f"loading {ckpt.path}", sum(ckpt.entries[f][k].nbytes for f, k in keys), progress)
        ckpt.verify(keys, on_bytes=meter.advance)
        state = tree.decode(ckpt.meta.state.model_dump(), ckpt.extra_tensor)
        with torch.no_grad():
            for name, tensor in sd.items():
                ckpt.read(names[name], 0, tensor.numel(), tensor.data.view(-1))
        meter.finish(f"loaded the weights of {ckpt.path}")
        return state["extra"]


# ----- shared ------------------------------------------------------------------------------------------------


def _checked(model: torch.nn.Module, optimizer: Any) -> ZeroOptimizer:
    if not isinstance(optimizer, ZeroOptimizer):
        raise ValueError(f"save_checkpoint/load_checkpoint take the ZeroOptimizer that trains the model, got a "
                         f"{type(optimizer).__name__}; wrap it in zero.ZeroOptimizer first")
    if optimizer.module is not model:
        raise ValueError("this ZeroOptimizer was built for another model; pass the model it wraps")
    return optimizer


def _hyperparameters(opt: ZeroOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _state_of(scheduler: Any) -> Any:
    return scheduler.state_dict() if scheduler is not None else None


def _version() -> str:
    from zero import __version__

    return __version__
