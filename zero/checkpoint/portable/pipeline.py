"""A pipeline's checkpoint: every rank of a pipeline (pipeline parallelism, torch's ``torch.distributed.pipelining``:
each pp rank holds one or more parts of the model) saves into one checkpoint of the whole model.

Parts that keep the whole model's names (``layers.3.attention.wq.weight``: ``zero.models.pipeline_parts``, as
torchtitan's split) hold, together, the whole model's ``state_dict``. So the checkpoint is an ordinary one of the
whole model (format 2, 3 or 4 as without a pipeline; nothing in it records the pp degree), written by the ranks of
``pp x dp (x tp)``, and loads into the whole model, into another pp or dp degree, and through ``zero.consolidate``.

Saving, the pp ranks tell one another what their parts hold (:func:`pipeline_view`: one all-gather of names and
records over pp, and one of the checksums of the tensors several parts keep): each tensor is written once, by the
first pp rank holding it (a buffer or frozen tensor that several parts keep, such as torchtitan's ``freqs_cis``, only
if their values agree; a parameter zero trains or shards on two pp ranks is refused: two optimizers would step it);
every part's optimizers and param groups must be the same (the checkpoint holds one set); rank 0 records every
part's tensors, in the order of the parts' stages, and their tied names. Loading, each rank's names must be the
checkpoint's, and their union over pp all of it (:func:`pipeline_names`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from zero.checkpoint.portable.boxes import local_tensor
from zero.checkpoint.portable.model_tensors import Checkpointable, Grid, ModelTensor


@dataclass
class PipelineView:
    """What a save of this rank needs to know of the other pp ranks."""

    elsewhere: set[str]  # tensors another pp rank writes
    records: dict[str, dict[str, Any]]  # every tensor's metadata record, in the order of the parts' stages
    aliases: dict[str, str]  # every part's tied names


def pipeline_view(grid: Grid, opt: Checkpointable, model_tensors: list[ModelTensor], aliases: dict[str, str],
                  boxed: bool, groups: Any, optimizers: list[dict[str, Any]]) -> PipelineView:
    """Every pp rank's tensors, checked (``groups``: this rank's encoded param groups, ``optimizers``: its optimizer
    records, both the same on every pp rank). Without a pipeline, this rank's own, and no collective."""
    if grid.pp is None:
        return PipelineView(set(), {h.name: h.record(boxed) for h in model_tensors}, aliases)
    keys = _stage_keys(opt, grid, 1 + max((h.part for h in model_tensors), default=0))
    mine = {"tensors": [[h.name, h.record(boxed), keys[h.part], h.slot is not None] for h in model_tensors],
            "aliases": aliases, "groups": groups, "optimizers": optimizers}
    views = grid.over_pp(mine, "sharing what the pipeline's parts hold")
    holders = grid.everywhere(lambda: _holders(views), "checking the pipeline's parts")
    shared = {name for name, ranks in holders.items() if len(ranks) > 1}
    crcs = grid.over_pp({h.name: _crc(h.tensor) for h in model_tensors if h.name in shared},
                        "comparing the tensors several parts keep")
    grid.everywhere(lambda: _same_values(crcs, holders, shared), "comparing the tensors several parts keep")
    order = sorted(((key, p, i), name, record) for p, view in enumerate(views)
                   for i, (name, record, key, _) in enumerate(view["tensors"]))
    records: dict[str, dict[str, Any]] = {}
    for _, name, record in order:
        records.setdefault(name, record)
    merged = {alias: name for view in views for alias, name in view["aliases"].items() if alias not in records}
    return PipelineView({name for name, ranks in holders.items() if ranks[0] != grid.pp_rank}, records, merged)


def pipeline_names(grid: Grid, names: set[str]) -> set[str] | None:
    """The union over pp of every rank's ``state_dict`` names (``names``: this rank's), or None without a pipeline."""
    if grid.pp is None:
        return None
    return {name for held in grid.over_pp(sorted(names), "sharing the names the pipeline's parts hold")
            for name in held}


def _stage_keys(opt: Checkpointable, grid: Grid, count: int) -> list[int]:
    """The stage index of each of this rank's ``count`` parts: as their ``zero.pipelining.PipelineStage`` s joined, or
    as torch's interleaved schedules place them (part ``j`` of pp rank ``r``: stage ``r + j x pp``)."""
    pipeline = opt.runtime.pipeline
    joined = pipeline.parts
    return list(joined) if len(joined) == count else [grid.pp_rank + j * grid.pp_size for j in range(count)]


def _holders(views: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The pp ranks holding each tensor; a ValueError if the parts' optimizers differ or a tensor on several pp ranks
    cannot be written once."""
    first = views[0]
    for p, view in enumerate(views[1:], 1):
        differ = _difference(first, view)
        if differ:
            raise ValueError(f"the part on pp rank {p} is trained with other optimizers or param groups than the part "
                             f"on pp rank 0 ({differ}); a checkpoint of the whole model holds one set: build every "
                             "part's ZeroOptimizer with the same optimizers and param groups")
    holders: dict[str, list[int]] = {}
    seen: dict[str, tuple[dict[str, Any], bool]] = {}
    for p, view in enumerate(views):
        for name, record, _, managed in view["tensors"]:
            if name not in seen:
                seen[name] = record, managed
                holders[name] = [p]
                continue
            q = holders[name][0]
            if managed or seen[name][1]:
                raise ValueError(f"pp ranks {q} and {p} both hold {name!r}, a parameter zero trains or shards: two "
                                 "optimizers would step it and the checkpoint of the whole model holds it once; cut "
                                 "the model into parts that keep the whole model's names, each parameter in one part")
            if record != seen[name][0]:
                raise ValueError(f"pp ranks {q} and {p} both hold a tensor named {name!r}, of other shapes or dtypes "
                                 f"({seen[name][0]['shape']} {seen[name][0]['dtype']} and {record['shape']} "
                                 f"{record['dtype']}); cut the model into parts that keep the whole model's names")
            holders[name].append(p)
    return holders


def _difference(first: dict[str, Any], other: dict[str, Any]) -> str:
    """What differs between two pp ranks' optimizers or param groups, in words ('' if nothing)."""
    if other["optimizers"] != first["optimizers"]:
        return f"optimizers {other['optimizers']} vs {first['optimizers']}"
    if len(other["groups"]) != len(first["groups"]):
        return f"{len(other['groups'])} param groups vs {len(first['groups'])}"
    for i, (group, ours) in enumerate(zip(other["groups"], first["groups"])):
        for key in sorted(group.keys() | ours.keys()):
            if group.get(key) != ours.get(key):
                return f"param group {i}'s {key} is {group.get(key)} vs {ours.get(key)}"
    return ""


def _same_values(crcs: list[dict[str, int]], holders: dict[str, list[int]], shared: set[str]) -> None:
    for name in sorted(shared):
        ranks = holders[name]
        values = {crcs[p][name] for p in ranks}
        if len(values) > 1:
            raise ValueError(f"pp ranks {', '.join(map(str, ranks))} hold different values of {name!r}, which the "
                             "checkpoint of the whole "
                             "model holds once; keep the parts' copies equal, or cut the model into parts that keep "
                             "the whole model's names, each tensor in one part")


def _crc(tensor: torch.Tensor) -> int:
    """The CRC-32 of what this rank holds of ``tensor``'s bytes."""
    values = local_tensor(tensor).detach().reshape(-1).contiguous().cpu()
    return zlib.crc32(values.view(torch.uint8).numpy().tobytes())
