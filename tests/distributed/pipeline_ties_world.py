"""Weights tied across pipeline parts in a real world (issue 48, item 6): ``LlamaGPT`` with its output head tied to
its token embedding, cut by ``zero.models.pipeline_parts`` so that the first part (pp rank 0) holds the embedding and
the last part (pp rank 1) the head, each rank its own copy; what each rank runs (``test_pipeline_ties_world.py``
compares it).

* the reference: the whole tied model in one process, on the global batch (every rank alike);
* ``zero.pipelining.PipelineStage(..., tied_weights=TIE)`` over dp 2 x pp 2 at stages 0-3 under 1F1B, stage 1 under
  GPipe, stage 3 interleaved (parts 0 and 3 on different ranks), stage 2 under ZBV (both on pp rank 0: one tensor);
* the refusals: the tie left undeclared (zero's stage: at the first step; torch's own stage with the pipeline from
  the mesh: at construction), a name no part holds, and copies that do not start equal.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import init_device_mesh

import zero
from tests.distributed.harness import value_error
from tests.distributed.pipeline_world import (
    BUCKET_MB,
    CFG,
    CLIP,
    LR,
    MICRO,
    MICRO_BATCH,
    _held_state,
    _merged,
    _pipe,
    reference,
)
from zero.pipelining import PipelineStage

TIED = dataclasses.replace(CFG, tie_embeddings=True)
TIE = [("tok_embeddings.weight", "output.weight")]
RUNS = [("1f1b", 0), ("1f1b", 1), ("1f1b", 2), ("1f1b", 3), ("gpipe", 1), ("interleaved", 3), ("zbv", 2)]


def _optimizer(pipe, stage: int, mesh) -> zero.ZeroOptimizer:
    return zero.ZeroOptimizer(torch.optim.AdamW(pipe.module.parameters(), lr=LR), pipe.module, stage=stage,
                              mesh=mesh, bucket_size_mb=BUCKET_MB)


def tied(mesh, name: str, stage: int, tied_weights=TIE) -> dict:
    pipe = _pipe(mesh, name, TIED)
    opt = _optimizer(pipe, stage, mesh["dp"])
    schedule = pipe.schedule(name, PipelineStage, tied_weights=tied_weights)
    out = pipe.train(schedule, lambda: opt.clip_grad_norm_(CLIP), lambda: (opt.step(), opt.zero_grad()))
    with opt.gathered_parameters():
        return out | {"params": _held_state(pipe)}


def _refusals(mesh) -> dict[str, str]:
    out = {"undeclared": value_error(lambda: tied(mesh, "1f1b", 1, tied_weights=())),
           "unknown_name": value_error(lambda: tied(mesh, "1f1b", 1, tied_weights=[("tok_embeddings.weight",
                                                                                     "head.weight")]))}
    pipe = _pipe(mesh, "1f1b", TIED)
    out["torch_stage"] = value_error(lambda: _optimizer(pipe, 1, mesh))  # the pipeline from the mesh's "pp"
    pipe = _pipe(mesh, "1f1b", TIED)
    if mesh["pp"].get_local_rank() == 1:
        with torch.no_grad():
            pipe.parts[1].output.weight.mul_(1.01)
    opt = _optimizer(pipe, 1, mesh["dp"])
    schedule = pipe.schedule("1f1b", PipelineStage, tied_weights=TIE)
    out["differ"] = value_error(lambda: pipe.train(schedule, lambda: opt.clip_grad_norm_(CLIP), opt.step))
    return out


def tie_checks(rank: int, world_size: int) -> dict:
    """dp 2 x pp 2: the tied reference, zero with the tie declared in each of ``RUNS``, and the refusals."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "pp"))
    out: dict = {"reference": reference(mesh["dp"].size() * MICRO * MICRO_BATCH, TIED)}
    for name, stage in RUNS:
        out[name, stage] = tied(mesh, name, stage)
    out["refusals"] = _refusals(mesh)
    return _merged(out, mesh)
