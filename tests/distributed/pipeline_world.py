"""Pipeline parallelism in a real world (issue 48): ``ZeroOptimizer`` over the parts of a model cut for torch's
``torch.distributed.pipelining`` on a dp x pp mesh of gloo ranks, what each rank runs (``test_pipeline_world.py``
compares it).

Every run trains ``zero.models.LlamaGPT`` (cut by ``zero.models.pipeline_parts``, names kept) for a few steps with
AdamW, clipped at ``CLIP``, on the same global batch, with torch's schedules at their defaults (``scale_grads=True``,
a mean loss per micro-batch):

* in one process, whole (the reference, computed on every rank alike);
* FSDP2 on each part + torch's ``PipelineStage``: the anchor, whose deviation from the reference is the noise floor
  (clipped over the whole pipeline by hand, as torchtitan does);
* ``ZeroOptimizer(..., mesh=mesh["dp"])`` + ``zero.pipelining.PipelineStage`` at stages 0-3 (one reduction per step);
* ``ZeroOptimizer(..., mesh=mesh)`` + torch's own ``PipelineStage`` at stages 0-3 (one reduction per micro-batch);

under ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` (two parts per rank, one optimizer over
both), and the zero-bubble ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``; stage 3 with its units
kept gathered from their first backward to the step (``set_reshard_after_backward(False)``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import zero
from tests.distributed.harness import value_error
from zero.models import (
    LlamaConfig,
    LlamaGPT,
    lm_loss,
    local_slice,
    pipeline_parts,
    synthetic_batch,
    tensor_parallel_plan,
)
from zero.pipelining import PipelineStage

CFG = LlamaConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=4, num_heads=4)
STEPS, CLIP, LR = 3, 0.5, 1e-2
MICRO = 4  # micro-batches per step
MICRO_BATCH = 2  # sequences per micro-batch
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
ZERO_BUBBLE = {"zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
BUCKET_MB = 0.02  # a few buckets per part


def _model(cfg: LlamaConfig = CFG) -> LlamaGPT:
    torch.manual_seed(0)
    return LlamaGPT(cfg)


def _batch(step: int, global_batch: int):
    return synthetic_batch(step, global_batch, CFG, seed=11)


def reference(global_batch: int, cfg: LlamaConfig = CFG) -> dict:
    """Single-process training of the whole model on the global batch."""
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model.loss(*_batch(step, global_batch))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": _state(model)}


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


class Pipe:
    """This rank's parts of a ``num_parts``-part pipeline over ``mesh["pp"]`` (part ``i`` on pp rank ``i % pp``)."""

    def __init__(self, mesh, num_parts: int, v_shape: bool = False, cfg: LlamaConfig = CFG):
        self.mesh, self.pp = mesh, mesh["pp"].size()
        self.parts = pipeline_parts(_model(cfg), num_parts)
        rank = mesh["pp"].get_local_rank()
        self.mine = [i for i in range(num_parts) if i % self.pp == rank]
        if v_shape:  # ScheduleZBVZeroBubble's "V": rank r holds parts r and 2 pp - 1 - r
            self.mine = [rank, num_parts - 1 - rank]
        held = [self.parts[i] for i in self.mine]
        self.module = held[0] if len(held) == 1 else torch.nn.ModuleList(held)

    def schedule(self, name: str, stage_class, **stage_kwargs):
        stages = [stage_class(self.parts[i], i, len(self.parts), torch.device("cpu"),
                              group=self.mesh["pp"].get_group(), **stage_kwargs) for i in self.mine]
        interleaved = len(stages) > 1
        return (SCHEDULES | ZERO_BUBBLE)[name](stages if interleaved else stages[0], MICRO, loss_fn=lm_loss)

    def train(self, schedule, clip, step_fn, stats=lambda: {}) -> dict:
        dp_rank, dp = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        first = self.mesh["pp"].get_local_rank() == 0
        losses, norms, traffic = [], [], []
        for step in range(STEPS):
            x, y = _batch(step, dp * MICRO * MICRO_BATCH)
            x, y = local_slice(x, dp_rank, dp), local_slice(y, dp_rank, dp)
            micro: list[torch.Tensor] = []
            schedule.step(*((x,) if first else ()), target=y, losses=micro)
            norms.append(float(clip()))
            step_fn()
            traffic.append(stats())
            held = torch.stack([torch.stack(micro).detach().mean(), torch.ones(())]) if micro else torch.zeros(2)
            dist.all_reduce(held)  # the last part's ranks hold the losses (its dp ranks, and its tp ranks alike)
            losses.append(float(held[0] / held[1]))
        return {"losses": losses, "norms": norms, "traffic": traffic}


def fsdp2(mesh, name: str) -> dict:
    pipe = _pipe(mesh, name)
    for i in pipe.mine:
        fully_shard(pipe.parts[i], mesh=mesh["dp"])
    opt = torch.optim.AdamW(pipe.module.parameters(), lr=LR)
    out = pipe.train(pipe.schedule(name, TorchPipelineStage), lambda: _clip_fsdp2(pipe.module, mesh),
                     lambda: (opt.step(), opt.zero_grad()))
    return out | {"params": _held_state(pipe)}


@torch.no_grad()
def _clip_fsdp2(module: torch.nn.Module, mesh) -> torch.Tensor:
    """torchtitan's clip under pipelining: the parts' squared norms summed over pp, one coefficient."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    squares = sum(g.full_tensor().double().pow(2).sum() for g in grads)
    dist.all_reduce(squares, group=mesh["pp"].get_group())
    norm = squares.sqrt().float()
    for g in grads:
        g.mul_(torch.clamp(CLIP / (norm + 1e-6), max=1.0))
    return norm


def zero_pipeline(mesh, name: str, stage: int, torch_stage: bool = False, kept: bool = False, **overrides) -> dict:
    """``torch_stage``: torch's own ``PipelineStage``, the pipeline given to ZeroOptimizer by the mesh; ``kept``:
    ``opt.set_reshard_after_backward(False)``; ``overrides``: ZeroConfig fields."""
    pipe = _pipe(mesh, name)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(pipe.module.parameters(), lr=LR), pipe.module, stage=stage,
                             mesh=mesh if torch_stage else mesh["dp"], **{"bucket_size_mb": BUCKET_MB, **overrides})
    opt.set_reshard_after_backward(not kept)
    schedule = pipe.schedule(name, TorchPipelineStage if torch_stage else PipelineStage)
    out = pipe.train(schedule, lambda: opt.clip_grad_norm_(CLIP), lambda: (opt.step(), opt.zero_grad()),
                     lambda: {kind: s["calls"] for kind, s in opt.comm_stats.items()})
    with opt.gathered_parameters():
        params = _held_state(pipe)
    return out | {"params": params, "buckets": len(opt.buckets)}


def _pipe(mesh, name: str, cfg: LlamaConfig = CFG) -> Pipe:
    one_part = name in ("gpipe", "1f1b")
    return Pipe(mesh, mesh["pp"].size() * (1 if one_part else 2), v_shape=name == "zbv", cfg=cfg)


def _held_state(pipe: Pipe) -> dict[str, torch.Tensor]:
    return {k: v for i in pipe.mine for k, v in _state(pipe.parts[i]).items()}


STAGES = (0, 1, 2, 3)
# the stages each schedule runs at, those of zero with torch's own stage under 1F1B (stage 0: whole gradients; 2: the
# guard scaled in place) and the schedules run at stage 3 with blocks as units
FULL = {"schedules": {name: STAGES for name in (*SCHEDULES, *ZERO_BUBBLE)}, "torch_stages": (0, 2),
        "blocks": ("1f1b", "interleaved")}
QUICK = {  # --quick: every schedule once and every stage once, where its path differs most from the others
    "schedules": {"gpipe": (1,),
                  "1f1b": (0,),  # stage 0's all-reductions (torch's own stage: at stage 2)
                  "interleaved": (2,),  # two parts under one optimizer: the reduction waits for the last one
                  "zero_bubble": (3,),  # the weight pass reads the units kept gathered since the input pass
                  "zbv": (2,)},  # the weight pass's gradients, written past the hooks, handed to the reduction
    "torch_stages": (2,),  # scale_grads' division of the guard applied to the shards
    "blocks": ("interleaved",),  # stage 3, two parts per rank: their ModuleList has no forward to gather a root unit
}


def pipeline_checks(rank: int, world_size: int, runs: dict) -> dict:
    """dp ``world_size // 2`` x pp 2: the reference, then FSDP2 + pipelining under each schedule and zero at its
    stages of ``runs`` (FULL or QUICK, returned as ``"matrix"``), zero with torch's own stage under 1F1B at
    ``runs["torch_stages"]`` and with blocks as units (the same on every rank; each returns the lot)."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "pp"))
    out: dict = {"matrix": runs, "reference": reference(mesh["dp"].size() * MICRO * MICRO_BATCH)}
    for name, stages in runs["schedules"].items():
        out[name, "fsdp2"] = fsdp2(mesh, name)
        for stage in stages:
            out[name, stage] = zero_pipeline(mesh, name, stage)
    for stage in runs["torch_stages"]:
        out["1f1b", stage, "torch_stage"] = zero_pipeline(mesh, "1f1b", stage, torch_stage=True)
    # blocks as units (each part owning the rest): resharded as usual, kept over the step's backwards
    for name in runs["blocks"]:
        out[name, 3, "blocks"] = zero_pipeline(mesh, name, 3, unit_classes=["LlamaBlock"])
        out[name, 3, "blocks_kept"] = zero_pipeline(mesh, name, 3, kept=True, unit_classes=["LlamaBlock"])
    out["refusals"] = _refusals(mesh)
    return _merged(out, mesh)


def _refusals(mesh) -> dict[str, str]:
    """zero.pipelining.PipelineStage over a part no ZeroOptimizer manages, with a dw_builder, and a second stage
    over the same optimizer on another group."""
    pipe = _pipe(mesh, "1f1b")
    part, index, cpu = pipe.parts[pipe.mine[0]], pipe.mine[0], torch.device("cpu")
    group = mesh["pp"].get_group()
    unmanaged = value_error(lambda: PipelineStage(part, index, 2, cpu, group=group))
    opt = zero.ZeroOptimizer(torch.optim.AdamW(part.parameters()), part, stage=1, mesh=mesh["dp"])
    out = {"unmanaged": unmanaged,
           "dw_builder": value_error(lambda: PipelineStage(part, index, 2, cpu, group=group, dw_builder=lambda: None))}
    PipelineStage(part, index, 2, cpu, group=group)
    out["two_pipelines"] = value_error(lambda: PipelineStage(part, index, 2, cpu, group=mesh["dp"].get_group(),
                                                        optimizer=opt))
    return out


def _merged(out: dict, mesh) -> dict:
    """Every run's parameters from each pp rank's parts put together (the dp ranks hold the same)."""
    gathered = [None] * mesh["pp"].size()
    params = {key: run["params"] for key, run in out.items() if isinstance(run, dict) and "params" in run}
    dist.all_gather_object(gathered, params, group=mesh["pp"].get_group())
    for key in params:
        out[key]["params"] = {k: v for part in gathered for k, v in part[key].items()}
    return out


def rel_l2(run: dict, ref: dict) -> float:
    a, b = run["params"], ref["params"]
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b))
    return num / math.sqrt(sum(float(b[k].pow(2).sum()) for k in b))


# ----- dp x tp x pp ------------------------------------------------------------------------------------------------

def _tensor_parallel(part: torch.nn.Module, mesh, sequence_parallel: bool) -> torch.nn.Module:
    """The part split by torchtitan's Llama plan over ``mesh["tp"]`` (the plan's entries for modules it holds)."""
    plan = tensor_parallel_plan(_model(), sequence_parallel)
    held = {name for name, _ in part.named_modules()}
    return parallelize_module(part, mesh["tp"], {k: v for k, v in plan.items() if k in held})


def three_d(mesh, stage: int | str, sequence_parallel: bool) -> dict:
    """1F1B over dp x tp x pp: each part tensor-parallel over tp, then FSDP2 (``stage="fsdp2"``) or zero over dp."""
    pipe = _pipe(mesh, "1f1b")
    for i in pipe.mine:
        _tensor_parallel(pipe.parts[i], mesh, sequence_parallel)
    if stage == "fsdp2":
        fully_shard(pipe.module, mesh=mesh["dp"])
        opt = torch.optim.AdamW(pipe.module.parameters(), lr=LR)
        out = pipe.train(pipe.schedule("1f1b", TorchPipelineStage), lambda: _clip_fsdp2(pipe.module, mesh),
                         lambda: (opt.step(), opt.zero_grad()))
        return out | {"params": _held_state(pipe)}
    opt = zero.ZeroOptimizer(torch.optim.AdamW(pipe.module.parameters(), lr=LR), pipe.module, stage=stage,
                             mesh=mesh["dp"], bucket_size_mb=BUCKET_MB)
    out = pipe.train(pipe.schedule("1f1b", PipelineStage), lambda: opt.clip_grad_norm_(CLIP),
                     lambda: (opt.step(), opt.zero_grad()))
    with opt.gathered_parameters():
        return out | {"params": _held_state(pipe)}


def three_d_checks(rank: int, world_size: int, stages: tuple[int, ...]) -> dict:
    """dp 2 x pp 2 x tp 2 (8 ranks): the reference, FSDP2 + TP + pipelining and zero at ``stages``, both plans."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    out: dict = {"reference": reference(mesh["dp"].size() * MICRO * MICRO_BATCH)}
    for plan, sequence_parallel in (("plan1", False), ("plan2", True)):
        for stage in ("fsdp2", *stages):
            out[plan, stage] = three_d(mesh, stage, sequence_parallel)
    return _merged(out, mesh)
