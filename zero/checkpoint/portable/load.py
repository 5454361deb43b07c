"""Loading a portable checkpoint (:mod:`zero.checkpoint.portable`) at any world size and stage: every check
first, on every rank, then each rank reads the ranges it owns now from whichever files hold them. A pipeline's
parts load from a checkpoint of the whole model, each rank its own parts' tensors
(:mod:`zero.checkpoint.portable.pipeline`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

import zero.checkpoint.portable.tree as tree
from zero.checkpoint import optimizer_set
from zero.checkpoint.portable.boxes import local_box, local_tensor
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
from zero.checkpoint.portable.pipeline import pipeline_names
from zero.checkpoint.portable.reader import Checkpoint
from zero.checkpoint.progress import ByteMeter, ProgressArg
from zero.runtime.buffers.bucket import ParamSlot
from zero.runtime.step.inner import Inner


def load_checkpoint(
    path: str | os.PathLike,
    model: Model,
    optimizer: Checkpointable | None = None,
    *,
    scheduler: Any = None,
    progress: ProgressArg = True,
) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` at any world size and stage; return its ``extra``.

    Call it on every rank, after building the model and its ``ZeroOptimizer`` as for training (any
    stage, world size, precision or offload; the same optimizers, in the same order, with the same
    parameter groups as when saved: their hyperparameters, e.g. the learning rate, come from the
    checkpoint). Restores the parameters (from the fp32 master weights when they were saved), buffers,
    the optimizer state (of a parameter stepped whole, on the rank that owns it now), the loss scale
    and, if given, ``scheduler``. With ``optimizer=None`` it loads only the weights
    into a plain, unwrapped model (single process). Everything is checked first (the model's names
    and shapes, the optimizer, the files' sizes and checksums): a refused load changes nothing.

    A pipeline's part (its pipeline known to the optimizer: a ``zero.pipelining.PipelineStage`` over it, or
    ``mesh=`` with a ``"pp"`` dimension) reads its own tensors from a checkpoint of the whole model, saved at any pp
    degree or without a pipeline; its names must be the checkpoint's, and the pipeline's parts together all of
    them. ``model``: as for :func:`save_checkpoint` (the part, or this rank's parts as a list or as the
    ``nn.ModuleList`` the optimizer wraps).
    """
    if optimizer is None:
        return _load_plain(path, model, progress)
    opt = checked(model, optimizer)
    grid = Grid.of(opt)
    ckpt = grid.everywhere(lambda: Checkpoint(path), "opening the checkpoint")
    try:
        report = progress if grid.rank == 0 or callable(progress) else False
        model_tensors, aliases = grid.everywhere(lambda: describe(parts_of(model, opt), opt), "describing the model")
        held = pipeline_names(grid, {h.name for h in model_tensors} | set(aliases))
        plan = grid.everywhere(lambda: _plan(ckpt, opt, model_tensors, aliases, held, report),
                               "checking the checkpoint")
        opt.prepare_for_checkpoint()
        _apply(ckpt, opt, plan)
        if scheduler is not None and plan.state["scheduler"] is not None:
            scheduler.load_state_dict(plan.state["scheduler"])
        ranks, tp = ckpt.meta.world_size, ckpt.meta.tensor_parallel
        mesh = f" (tp {tp})" if tp else ""
        plan.meter.finish(f"loaded {ckpt.path} "
                          f"(saved on {ranks} rank{'s' if ranks > 1 else ''}{mesh} at stage {ckpt.meta.stage})")
        return plan.state["extra"]
    finally:
        ckpt.close()


@dataclass
class LoadPlan:
    model_tensors: list[ModelTensor]
    state: dict[str, Any]  # the decoded trees: param_groups, scheduler, extra, loss_scale
    meter: ByteMeter


def _plan(ckpt: Checkpoint, opt: Checkpointable, model_tensors: list[ModelTensor], aliases: dict[str, str],
          held: set[str] | None, report: ProgressArg) -> LoadPlan:
    """Every check, and the checksums of everything this rank reads; nothing is changed. ``held``: the names the
    pipeline's parts hold together (None: no pipeline, this model is the whole)."""
    shapes = {h.name: tuple(h.tensor.shape) for h in model_tensors}
    _check_names(ckpt, {**shapes, **{alias: shapes[name] for alias, name in aliases.items()}}, held=held)
    _check_optimizer(ckpt, opt, model_tensors)
    keys = ckpt.extra_keys()
    for h in model_tensors:
        name, box = ckpt.meta.aliases.get(h.name, h.name), h.box
        for start, numel in _ranges(h, opt):
            keys |= ckpt.keys_of(name, start, numel, state=h.slot is not None and h.slot.bucket.trainable, box=box)
    names = slot_names(model_tensors)
    for slot, _ in opt.runtime.whole_parameter_step.owned():  # the whole parameters this rank steps: their state
        keys |= ckpt.whole_state_keys(ckpt.meta.aliases.get(names[id(slot)], names[id(slot)]))
    meter = ByteMeter(f"loading {ckpt.path}", sum(ckpt.entries[f][k].nbytes for f, k in keys), report)
    ckpt.verify(keys, on_bytes=meter.advance)
    state = tree.decode(ckpt.meta.state.model_dump(), ckpt.extra_tensor)
    if len(state["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"{ckpt.path} was saved with {len(state['param_groups'])} param groups but the optimizer has "
                         f"{len(opt.param_groups)}; build it with the same param groups as when it was saved")
    return LoadPlan(model_tensors, state, meter)


def _check_names(ckpt: Checkpoint, shapes: dict[str, tuple[int, ...]], shown: int = 4,
                 held: set[str] | None = None) -> None:
    """The model's ``state_dict`` names (tied names included) and ``shapes`` are those the checkpoint holds (a
    pipeline's part: the checkpoint's, and ``held``, the names of the pipeline's parts together, all of them). The
    refusal names the shape mismatches first, then the names only the checkpoint has, then those only the model
    has, each with its count (the first ``shown`` of each listed)."""
    aliases = ckpt.meta.aliases
    saved = {name: tuple(ckpt.tensors[aliases.get(name, name)].shape) for name in [*ckpt.tensors, *aliases]}
    differ = [name for name in sorted(saved.keys() & shapes.keys()) if saved[name] != tuple(shapes[name])]
    only_saved = sorted(saved.keys() - (shapes.keys() if held is None else held))
    only_model = sorted(shapes.keys() - saved.keys())
    if not (differ or only_saved or only_model):
        return
    halves = []
    if differ:
        listed = ", ".join(f"{n!r} is {saved[n]} in the checkpoint but {tuple(shapes[n])} in the model"
                           for n in differ[:shown])
        halves.append(f"{_count(differ, 'tensor')} of another shape ({listed}{_more(differ, shown)})")
    if only_saved:
        lacking = "the model lacks" if held is None else "no part of the pipeline holds"
        halves.append(f"the checkpoint has {_count(only_saved, 'tensor')} that {lacking} "
                      f"({', '.join(map(repr, only_saved[:shown]))}{_more(only_saved, shown)})"
                      + (_PART_HINT if held is None and not only_model and not differ else ""))
    if only_model:
        halves.append(f"the model has {_count(only_model, 'tensor')} that the checkpoint lacks "
                      f"({', '.join(map(repr, only_model[:shown]))}{_more(only_model, shown)})")
    raise ValueError(f"{ckpt.path} is a checkpoint of another model: {'; '.join(halves)}")


_PART_HINT = (" (if the model is one part of a pipeline: give its ZeroOptimizer mesh=mesh with its 'pp' dimension, or "
              "build its zero.pipelining.PipelineStage, before loading)")


def _count(names: list[str], what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) > 1 else ''}"


def _more(names: list[str], shown: int) -> str:
    return f", and {len(names) - shown} more" if len(names) > shown else ""


def _check_optimizer(ckpt: Checkpoint, opt: Checkpointable, model_tensors: list[ModelTensor]) -> None:
    """The same optimizers (classes, order, step paths, param groups; one elementwise optimizer's class only
    matters when the checkpoint holds its state), and every trainable parameter in the same param group."""
    saved, here = ckpt.meta.optimizer_records(), optimizer_set.records(opt.runtime.inners)
    has_state = any(p.state for boxes in ckpt.boxes.values() for b in boxes for p in b.pieces) or any(
        t.whole_state is not None for t in ckpt.tensors.values())
    if has_state or len(saved) > 1 or len(here) > 1 or "whole" in {o["path"] for o in [*saved, *here]}:
        optimizer_set.check_same(saved, here, str(ckpt.path), paths=has_state)
    for h in model_tensors:
        if h.slot is None or not h.slot.bucket.trainable:
            continue
        record = ckpt.tensors[ckpt.meta.aliases.get(h.name, h.name)]
        if record.trainable and record.group != h.slot.group_index:
            raise ValueError(f"{ckpt.path}: {h.name!r} was in param group {record.group} when saved but is in group "
                             f"{h.slot.group_index} now; build the optimizer with the same param groups")


def _ranges(h: ModelTensor, opt: Checkpointable) -> list[tuple[int, int]]:
    """The element ranges of ``h`` this rank holds (of its local tensor): its pieces in its bucket's chunk, or all of
    it."""
    if h.slot is None:
        return [(0, local_tensor(h.tensor).numel())]
    bucket = h.slot.bucket
    return [(p.param_start, p.numel) for p in bucket.layout.pieces(bucket.shard_index)
            if p.param_index == h.slot.span.param_index]


def _apply(ckpt: Checkpoint, opt: Checkpointable, plan: LoadPlan) -> None:
    """Write the values into masters, shards and whole tensors; rebuild the optimizer state; share."""
    aliases = ckpt.meta.aliases
    with torch.no_grad():
        for h in plan.model_tensors:
            name, box = aliases.get(h.name, h.name), h.box
            if h.slot is None:
                local = local_tensor(h.tensor)
                ckpt.read(name, 0, local.numel(), local.data.view(-1), box=box)
                continue
            bucket = h.slot.bucket
            target = bucket.master if bucket.trainable else bucket.shard
            for p in bucket.layout.pieces(bucket.shard_index):
                if p.param_index == h.slot.span.param_index:
                    ckpt.read(name, p.param_start, p.numel, target.narrow(0, p.chunk_start, p.numel), box=box)
    states = [_inner_state(ckpt, opt, inner, plan) for inner in opt.runtime.inners]
    opt.finish_load(states[0] if len(states) == 1 else states, plan.state["loss_scale"])


def _inner_state(ckpt: Checkpoint, opt: Checkpointable, inner: Inner, plan: LoadPlan) -> dict[str, Any]:
    """The ``torch.optim`` state dict of one wrapped optimizer over this rank's share, read from ``ckpt``: each
    piece's state cut from the saved pieces (flat), or each owned whole parameter's state as its owner saved it."""
    aliases = ckpt.meta.aliases
    names = slot_names(plan.model_tensors)
    inner.optimizer.state.clear()
    piece_of = {id(p.tensor): p for b in opt.buckets for p in b.pieces}
    slot_of: dict[int, ParamSlot] = {id(stand_in): slot for slot, stand_in in opt.runtime.whole_parameter_step.owned()}
    state, groups, index = {}, [], 0
    for group, gi in zip(inner.optimizer.param_groups, inner.groups):
        ids = []
        for tensor in group["params"]:
            if inner.whole:
                name = names[id(slot_of[id(tensor)])]
                saved = ckpt.whole_state(aliases.get(name, name))
            else:
                piece = piece_of[id(tensor)]
                name = names[id(piece.slot)]
                saved = ckpt.read_state(aliases.get(name, name), piece.piece.param_start,
                                        piece.piece.numel, into=partial(opt.runtime.paging.state_target, piece),
                                        box=local_box(piece.slot.param))
            if saved:
                state[index] = saved
            ids.append(index)
            index += 1
        groups.append({**plan.state["param_groups"][gi], "params": ids})
    return {"state": state, "param_groups": groups}


def _load_plain(path: str | os.PathLike, model: Model, progress: ProgressArg) -> Any:
    """Weights only, into an unwrapped model (one process; or each rank of a tensor-parallel one its boxes; or the
    whole model's parts, as a list)."""
    with Checkpoint(path) as ckpt:
        parts = list(model) if isinstance(model, (list, tuple)) else [model]
        sd = {name: value for part in parts for name, value in part.state_dict(keep_vars=True).items()}
        _check_names(ckpt, {name: tuple(tensor.shape) for name, tensor in sd.items()})
        names = {name: ckpt.meta.aliases.get(name, name) for name in sd}
        keys = ckpt.extra_keys()
        for name, tensor in sd.items():
            keys |= ckpt.keys_of(names[name], 0, local_tensor(tensor).numel(), state=False, box=local_box(tensor))
        meter = ByteMeter(f"loading {ckpt.path}", sum(ckpt.entries[f][k].nbytes for f, k in keys), progress)
        ckpt.verify(keys, on_bytes=meter.advance)
        state = tree.decode(ckpt.meta.state.model_dump(), ckpt.extra_tensor)
        with torch.no_grad():
            for name, tensor in sd.items():
                local = local_tensor(tensor)
                ckpt.read(names[name], 0, local.numel(), local.data.view(-1), box=local_box(tensor))
        meter.finish(f"loaded the weights of {ckpt.path}")
        return state["extra"]
