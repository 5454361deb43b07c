"""Portable checkpoints across tp and dp degrees (issue 47, part 5), in one world of 4 ranks.

``LlamaGPT`` split by torchtitan's plan (sequence parallelism: row-wise embedding, ``Replicate()`` norms, column- and
row-wise projections) on a dp 2 x tp 2 mesh trains 2 steps under ``ZeroOptimizer`` (AdamW at stages 1 and 3; Muon on
the blocks' matrices with AdamW on the rest at stage 1: ``SAVED``) and is saved (``zero.checkpoint/4``: each tensor as
boxes of its global shape); the AdamW runs go on for 2 steps (the runs that never stopped). The same 4 ranks then
load each checkpoint into fresh models of other initial values, at other tp and dp degrees and stages (``LOADS``),
and the AdamW ones train 2 more steps. Rank 0 also trains the single-process reference for 4 steps. The test compares
the global values (parameters, AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``, Muon's ``momentum_buffer``) bit for
bit at the save and after each load, and the 2 resumed steps with the reference; the single-process loads (a plain
model, ``zero.consolidate``) run in the test itself.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import zero
from zero import ZeroOptimizer
from zero.models import LlamaConfig, LlamaGPT, local_slice, synthetic_batch, tensor_parallel_plan

CFG = LlamaConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
LR = 1e-2
GLOBAL_BATCH = 4
BUCKET_MB = 0.004  # several buckets, parameters split across dp ranks
SAVE_MESH = (2, 2)  # dp x tp
SAVED = {1: (1, False), 3: (3, False), "muon": (1, True)}  # name -> (stage, Muon on the blocks' matrices)
STATE = ("exp_avg", "exp_avg_sq")
# name -> (the checkpoint (SAVED), the mesh loaded on: (dp, tp), or dp alone for a plain model, sequence parallel,
# stage)
LOADS = {
    "dp1xtp4-stage2": (1, (1, 4), True, 2),
    "dp1xtp4-plan1-stage3": (3, (1, 4), False, 3),  # plan 1: plain norms where the checkpoint has Replicate() ones
    "dp4-stage3": (1, 4, False, 3),
    "dp4-stage1": (3, 4, False, 1),
    "muon-dp1xtp4-stage2": ("muon", (1, 4), True, 2),
    "muon-dp4-stage3": ("muon", 4, False, 3),
}
# --quick: the checkpoint at stage 1 (the one the schema's refusals edit) and Muon's; loaded at tp 4 (AdamW's state
# re-cut to other boxes, the weights alone, the resumed steps) and without TP (every box, the Replicate() norms and
# the row-wise embedding among them, and Muon's whole state into plain parameters sharded over dp 4, at stage 3)
QUICK_SAVED = (1, "muon")
QUICK_LOADS = ("dp1xtp4-stage2", "muon-dp4-stage3")


def _model(seed: int) -> LlamaGPT:
    torch.manual_seed(seed)
    return LlamaGPT(CFG)


def _split(model: LlamaGPT, mesh, sequence_parallel: bool) -> LlamaGPT:
    return parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(step, GLOBAL_BATCH, CFG, seed=7)


def reference() -> dict:
    """Single-process AdamW on the global batch: the parameters after 2 and 4 steps, the losses."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict = {"losses": []}
    for step in range(4):
        loss = model.loss(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        if step == 1:
            out["params2"] = _cat(model.parameters())
    out["params4"] = _cat(model.parameters())
    return out


def _cat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train(model, opt, steps: range, group) -> list[float]:
    """Steps on the global batch split over the dp ranks of ``group``; the losses (means over dp)."""
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    losses = []
    for step in steps:
        x, y = (local_slice(t, rank, dp) for t in _batch(step))
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / dp)
    return losses


def _optimizers(model: torch.nn.Module, muon: bool) -> list[torch.optim.Optimizer]:
    """AdamW; or Muon on the blocks' matrices (tp-sharded, stepped whole by their owners) and AdamW on the rest."""
    if not muon:
        return [torch.optim.AdamW(model.parameters(), lr=LR)]
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.startswith("layers.") and p.ndim == 2]
    rest = [p for n, p in named if not (n.startswith("layers.") and p.ndim == 2)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=LR)]


def _globals(model, opt, group) -> dict:
    """Every parameter's global value and AdamW state, flattened in model order (collectives over dp and tp): the
    state from this rank's pieces, the largest over dp (each element is on one dp rank; -inf elsewhere); and the
    state of the parameters stepped whole, by name, from their owners (each tp rank's holds the global tensor's)."""
    with opt.gathered_parameters():
        out = {"params": _cat(_full(p) for p in model.parameters())}
    state = {t: v for inner in opt.runtime.inners if not inner.whole for t, v in inner.optimizer.state.items()}
    pieces = [p for b in opt.buckets for p in b.pieces if p.tensor in state]
    slots = sorted((s for b in opt.buckets if b.trainable for s in b.slots), key=lambda s: s.order)
    out["step"] = sorted({float(state[p.tensor]["step"]) for p in pieces})
    for key in STATE:
        values = []
        for slot in slots:
            local = torch.full(slot.shape, -torch.inf)
            for p in pieces:
                if p.slot is slot:
                    local.view(-1).narrow(0, p.piece.param_start, p.piece.numel).copy_(state[p.tensor][key])
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            if slot.local.tensor_parallel:
                local = DTensor.from_local(local, slot.local.mesh, slot.local.placements, run_check=False)
            values.append(_full(local))
        out[key] = _cat(values)
    whole = {inner.optimizer: inner for inner in opt.runtime.inners if inner.whole}
    mine = {slot.name: optimizer.state[stand_in]["momentum_buffer"]
            for slot, stand_in in opt.runtime.whole_parameter_step.owned()
            for optimizer in whole if stand_in in optimizer.state}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out["whole"] = {}
    for found in gathered:
        for name, value in found.items():  # the owners on the tp ranks hold the same
            assert torch.equal(out["whole"].setdefault(name, value), value), name
    return out


def _save(path: str, stage: int, muon: bool = False) -> dict:
    mesh = init_device_mesh("cpu", SAVE_MESH, mesh_dim_names=("dp", "tp"))
    model = _split(_model(0), mesh, True)
    opt = ZeroOptimizer(_optimizers(model, muon), model, stage=stage, bucket_size_mb=BUCKET_MB, mesh=mesh["dp"])
    _train(model, opt, range(2), mesh["dp"].get_group())
    zero.save_checkpoint(path, model, opt, progress=False)
    saved = _globals(model, opt, mesh["dp"].get_group())
    if muon:
        return saved
    losses = _train(model, opt, range(2, 4), mesh["dp"].get_group())  # the run that never stopped
    with opt.gathered_parameters():
        return saved | {"losses": losses, "params4": _cat(_full(p) for p in model.parameters())}


def _load(path: str, where, sequence_parallel: bool, stage: int, muon: bool) -> dict:
    out = {}
    if isinstance(where, tuple):
        mesh = init_device_mesh("cpu", where, mesh_dim_names=("dp", "tp"))
        model, group, config = _split(_model(1), mesh, sequence_parallel), mesh["dp"].get_group(), {"mesh": mesh["dp"]}
        weights = _split(_model(2), mesh, sequence_parallel)  # weights only, each rank its boxes, no optimizer
        zero.load_checkpoint(path, weights, progress=False)
        out["weights"] = _cat(_full(p) for p in weights.parameters())
    else:
        model, group, config = _model(1), dist.group.WORLD, {}
    opt = ZeroOptimizer(_optimizers(model, muon), model, stage=stage, bucket_size_mb=BUCKET_MB, **config)
    zero.load_checkpoint(path, model, opt, progress=False)
    out["loaded"] = _globals(model, opt, group)
    if muon:  # (Muon's bf16 Newton-Schulz carries rounding far: its resumed steps are test_tensor_parallel_world's)
        return out
    losses = _train(model, opt, range(2, 4), group)
    with opt.gathered_parameters():
        params = _cat(_full(p) for p in model.parameters())
    return out | {"losses": losses, "params4": params}


def checkpoint_checks(rank: int, world_size: int, root: str, saves: tuple = tuple(SAVED),
                      loads: tuple = tuple(LOADS)) -> dict:
    """Save at dp 2 x tp 2 (``saves`` of ``SAVED``), load as ``LOADS`` says (``loads``); rank 0's results, and the
    reference."""
    out: dict = {"saved": {saved: _save(os.path.join(root, str(saved)), *SAVED[saved]) for saved in saves}}
    for name in loads:
        saved, where, sequence_parallel, stage = LOADS[name]
        out[name] = _load(os.path.join(root, str(saved)), where, sequence_parallel, stage, SAVED[saved][1])
    if rank == 0:
        out["reference"] = reference()
    return out if rank == 0 else {}
