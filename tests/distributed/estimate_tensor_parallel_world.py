"""``zero.estimate`` of a tensor-parallel run against ``zero.profile`` in a real dp x tp world of gloo ranks
(issue 47 part 6; ``test_estimate_tensor_parallel_world.py`` compares them).

Each rank trains ``zero.models.LlamaGPT`` split by ``parallelize_module`` over ``mesh["tp"]`` with
``tensor_parallel_plan`` (plan 1: attention by heads and the MLP by hidden units; plan 2: torchtitan's Llama plan,
sequence parallel), under ``ZeroOptimizer(AdamW, model, stage=s, mesh=mesh["dp"])`` for two steps (stages 1-3; on
plan 2 also stage 0, bf16 parameters and activation checkpointing: ``CASES``), and returns its
peak: the allocator's, without the collectives' own buffers, less what the process held before (as
``estimate_world.measured``). Rank 0 also prices one case from inside the world (a default process group exists, so
the estimator spawns its child process: the workload's functions below are importable for that; a lambda is refused by
name) and checks that the world is untouched afterwards.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import zero
from zero.estimator import Workload, estimate
from zero.models import LlamaConfig, LlamaGPT, tensor_parallel_plan

CFG = LlamaConfig(vocab_size=64, seq_len=16, d_model=64, num_layers=2, num_heads=4)
MICRO = 2  # each rank's micro-batch (the tp ranks of one dp position take the same one)
BUCKET_MB = 0.02  # several buckets
PLANS = {"plan1": False, "plan2": True}  # name -> sequence parallel
STAGES = (1, 2, 3)
STEPS = 2
# besides both plans at stages 1-3, on plan 2 (ZeroConfig's fields): stage 0, bf16 parameters over fp32 masters,
# activation checkpointing of every block. (Not CPU offload: on a CPU machine host and device memory are one, so the
# allocator cannot tell the device's part from the host's.)
VARIANTS = {"stage0": (0, {}), "bf16": (3, {"precision": {"param_dtype": "bf16"}}),
            "checkpointing": (3, {"activation_checkpointing": {"classes": ["LlamaBlock"]}})}
CASES = {**{(plan, stage): (plan, stage, {}) for plan in PLANS for stage in STAGES},
         **{("plan2", name): ("plan2", stage, fields) for name, (stage, fields) in VARIANTS.items()}}


def build() -> LlamaGPT:
    torch.manual_seed(0)
    return LlamaGPT(CFG)


def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model.loss(x, y)


def batch(micro: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (micro, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def heads_and_mlp(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel=False))


def sequence_parallel(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel=True))


PARALLELIZE = {"plan1": heads_and_mlp, "plan2": sequence_parallel}


def workload(plan: str) -> Workload:
    return Workload(build, loss, batch, parallelize=PARALLELIZE[plan])


def priced(plan: str, stage: int, world_size: int, tp: int, **fields) -> dict:
    """The estimate of one case (``fields``: more of ``ZeroConfig``'s), as plain data."""
    e = estimate(workload(plan), stage=stage, world_size=world_size, tensor_parallel=tp, micro_batch=MICRO,
                 bucket_size_mb=BUCKET_MB, **fields)
    return {"estimated": e.peak, "estimated_categories": {k: v for k, v in e.categories.items() if v},
            "estimated_where": f"{e.phase} {e.module} {e.event}", "rank": e.rank}


def measure(mesh, plan: str, stage: int, **fields) -> dict:
    """This rank's measured peak of ``STEPS`` steps of one case (``fields``: more of ``ZeroConfig``'s)."""
    gc.collect()
    model = PARALLELIZE[plan](build(), mesh["tp"])
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage,
                             bucket_size_mb=BUCKET_MB, mesh=mesh["dp"], **fields)
    with zero.profile(model, opt, every_op=False) as prof:
        for step in range(STEPS):
            loss(model, *batch(MICRO, step * 100 + mesh["dp"].get_local_rank())).backward()
            opt.step()
            opt.zero_grad()
    peak = prof.peak
    out = {"measured": prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0),
           "categories": {k: v for k, v in peak.categories.items() if v},
           "where": f"{peak.phase} {peak.module} {peak.event}"}
    opt.close()
    del prof, opt, model
    gc.collect()
    return out


def checks(rank: int, world_size: int, tp: int) -> dict:
    """Every rank's measured peaks by case (``CASES``); rank 0 also one estimate priced inside the world."""
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    out: dict = {case: measure(mesh, plan, stage, **fields) for case, (plan, stage, fields) in CASES.items()}
    if rank == 0:  # (a spawned child: this process has a default process group)
        out["inside"] = priced("plan2", 3, world_size, tp)
        local = Workload(lambda: build(), loss, batch, parallelize=sequence_parallel)  # (not importable)
        try:
            estimate(local, stage=3, world_size=world_size, tensor_parallel=tp, micro_batch=MICRO)
            out["local"] = ""
        except ValueError as err:
            out["local"] = str(err)
    dist.barrier()
    total = torch.ones(())
    dist.all_reduce(total)  # the world still works, with its own ranks
    out["world"] = (dist.get_world_size(), dist.get_rank(), float(total))
    return out
