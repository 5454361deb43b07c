"""Tensor parallelism in a real world (issue 47): ``ZeroOptimizer`` over a model split by torch's
``parallelize_module`` on a dp x tp mesh of gloo ranks, what each rank runs (``test_tensor_parallel_world.py``
compares it).

Every run trains ``zero.models.LlamaGPT`` for a few steps with AdamW, clipped at ``CLIP``, on the same global batch:

* in one process, unsplit (the reference, computed on every rank alike);
* FSDP2 + TP on the same mesh (``fully_shard(..., mesh=mesh["dp"])``): the anchor, whose deviation from the
  reference is the noise floor;
* ``ZeroOptimizer(..., mesh=mesh["dp"])`` at stages 0-3,

under plan 1 (attention by heads, the MLP by hidden units; embedding, norms and head plain) and plan 2 (torchtitan's
Llama plan: sequence parallelism, replicated norms with partial gradients). Also: per-head q/k norms declared the
torch way (exact) and left plain (refused by name), the model-state bytes at stages 1 and 3, and the refusals.
"""

from __future__ import annotations

import contextlib
import math
import tempfile

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import zero
from tests.distributed.harness import value_error
from tests.recipes import MasterRecipe, SeveralOptimizers
from zero import ZeroOptimizer
from zero.models import LlamaConfig, LlamaGPT, local_slice, synthetic_batch, tensor_parallel_plan

CFG = LlamaConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
STEPS = 3
CLIP = 0.5
LR = 1e-2
BUCKET_MB = 0.004  # several buckets, parameters split across dp ranks
PLANS = {"plan1": False, "plan2": True}  # name -> sequence parallel
# Muon's own noise: single-process training with this relative gradient noise. Newton-Schulz in bf16 carries any
# rounding-level change far: 1e-7 moves the parameters 4e-4 to 9e-4 (L2, relative) depending on the draw, and from
# 3e-7 on it saturates at ~1.7e-3; TP's own gradients differ from one process's by rounding of about 1e-6.
MUON_NOISE = 1e-6


def _model(cfg: LlamaConfig = CFG) -> LlamaGPT:
    torch.manual_seed(0)
    return LlamaGPT(cfg)


def _batch(step: int, global_batch: int, cfg: LlamaConfig = CFG):
    return synthetic_batch(step, global_batch, cfg, seed=7)


def _full(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's global value, flattened in model order (a collective over tp)."""
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).clone()
                      for p in model.parameters()])


def _trainable(model: torch.nn.Module, frozen: bool) -> list[torch.Tensor]:
    """``frozen``: the token embedding frozen (a frozen base under adapters, in small); the parameters to train."""
    model.tok_embeddings.weight.requires_grad_(not frozen)
    return [p for p in model.parameters() if p.requires_grad]


def reference(global_batch: int, cfg: LlamaConfig = CFG, frozen: bool = False) -> dict:
    """Single-process training on the global batch."""
    model = _model(cfg)
    opt = torch.optim.AdamW(_trainable(model, frozen), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, global_batch, cfg)
        loss = model.loss(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = _full(model)
    model.loss(*_batch(STEPS, global_batch, cfg)).backward()  # the next step's gradients: their inf-norm
    inf = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type=math.inf))
    return {"losses": losses, "norms": norms, "params": params, "inf_norm": inf}


def reference_bf16(global_batch: int) -> dict:
    """Single-process bf16 parameters over fp32 masters on the global batch (``tests.recipes.MasterRecipe``)."""
    recipe = MasterRecipe(_model(), torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=LR))
    losses = []
    for step in range(STEPS):
        loss = recipe.low.loss(*_batch(step, global_batch))
        loss.backward()
        recipe.grads_to_master()
        torch.nn.utils.clip_grad_norm_(recipe.master, CLIP)
        recipe.step()
        losses.append(float(loss))
    return {"losses": losses, "params": _full(recipe.low).float()}


def muon_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Muon on the blocks' matrices (tp-sharded ones among them), AdamW on the rest: the usual Muon recipe."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.startswith("layers.") and p.ndim == 2]
    rest = [p for n, p in named if not (n.startswith("layers.") and p.ndim == 2)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=LR)]


def reference_muon(global_batch: int, noise: float = 0.0) -> dict:
    """Single-process Muon + AdamW on the global batch; ``noise``: each gradient perturbed by that relative amount
    (seeded), which measures how far rounding-level differences carry through Newton-Schulz (Muon's own noise)."""
    model = _model()
    opt = SeveralOptimizers(muon_adamw(model))
    generator = torch.Generator().manual_seed(3)
    losses = []
    for step in range(STEPS):
        loss = model.loss(*_batch(step, global_batch))
        loss.backward()
        for p in model.parameters():
            p.grad.add_(p.grad * noise * torch.randn(p.grad.shape, generator=generator))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": _full(model)}


def _train(model, opt, clip, mesh, global_batch: int, cfg: LlamaConfig = CFG, micro: int = 1,
           clear: bool = True) -> dict:
    """``micro`` > 1: that many micro-batches per step, all but the last under ``opt.no_sync()``; ``clear``: the
    gradients cleared with ``opt.zero_grad()``, else zeroed by ``model.zero_grad(set_to_none=False)``."""
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, global_batch, cfg)
        x, y = local_slice(x, dp_rank, dp), local_slice(y, dp_rank, dp)
        loss = 0.0
        for i in range(micro):
            with opt.no_sync() if i < micro - 1 else contextlib.nullcontext():
                part = model.loss(local_slice(x, i, micro), local_slice(y, i, micro)) / micro
                part.backward()
            loss = loss + part.detach()
        norm = clip()
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad() if clear else model.zero_grad(set_to_none=False)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(float(mean) / dp)
    return {"losses": losses, "norms": norms}


def fsdp2_tp(mesh, sequence_parallel: bool, global_batch: int, cfg: LlamaConfig = CFG, declared: bool = True,
             bf16: bool = False) -> dict:
    model = parallelize_module(_model(cfg), mesh["tp"], tensor_parallel_plan(_model(cfg), sequence_parallel, declared))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for module in [*model.layers, model]:
        fully_shard(module, mesh=mesh["dp"], **({"mp_policy": policy} if bf16 else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = _train(model, opt, lambda: _clip_by_mesh(model), mesh, global_batch, cfg)
    params = _full(model)
    return out | {"params": params.to(torch.bfloat16).float() if bf16 else params}


@torch.no_grad()
def _clip_by_mesh(model: torch.nn.Module) -> torch.Tensor:
    """torch's clip for FSDP2 over a model whose parameters live on two meshes (dp; dp x tp), which
    ``clip_grad_norm_`` refuses (its ``stack`` needs one mesh): each parameter's norm made whole, then one scale."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).full_tensor() for g in grads]))
    coef = torch.clamp(CLIP / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def zero_tp(mesh, sequence_parallel: bool, stage: int, global_batch: int, cfg: LlamaConfig = CFG,
            declared: bool = True, micro: int = 1, optimizers=None, frozen: bool = False, clear: bool = True,
            **config) -> dict:
    model = parallelize_module(_model(cfg), mesh["tp"], tensor_parallel_plan(_model(cfg), sequence_parallel, declared))
    optimizer = optimizers(model) if optimizers else torch.optim.AdamW(_trainable(model, frozen), lr=LR)
    opt = ZeroOptimizer(optimizer, model, stage=stage, bucket_size_mb=BUCKET_MB, mesh=mesh["dp"], **config)
    out = _train(model, opt, lambda: opt.clip_grad_norm_(CLIP), mesh, global_batch, cfg, micro, clear)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    x, y = (local_slice(t, dp_rank, dp) for t in _batch(STEPS, global_batch, cfg))
    model.loss(x, y).backward()  # the next step's gradients: their inf-norm, over dp and tp
    out["inf_norm"] = float(opt.clip_grad_norm_(math.inf, norm_type=math.inf))
    opt.zero_grad()
    with opt.gathered_parameters():
        params = _full(model).float()
    return out | {"params": params, "bytes": opt.model_state_bytes(), "local_numel": _local_numel(model)}


def profiled(mesh, stage: int, global_batch: int) -> dict:
    """``zero.profile`` over two steps of a TP model (plan 2): its categories after the last step, against what the
    optimizer says it holds, and the largest unexplained byte count."""
    model = parallelize_module(_model(), mesh["tp"], tensor_parallel_plan(_model(), True))
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model, stage=stage, bucket_size_mb=BUCKET_MB,
                        mesh=mesh["dp"])
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    with zero.profile(model, opt, every_op=False) as prof:
        for step in range(2):
            x, y = (local_slice(t, dp_rank, dp) for t in _batch(step, global_batch))
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    rest = [s for s in prof.samples if s.event == "optimizer step ends"][-1]
    return {"rest": dict(rest.categories), "bytes": opt.model_state_bytes(), "local_numel": _local_numel(model),
            "max_unexplained": max(abs(s.unexplained) for s in prof.samples), "peak": prof.peak.allocated}


def _local_numel(model: torch.nn.Module) -> int:
    return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in model.parameters())


# features composed with TP (plan 2): name -> (stage, micro-batches, ZeroConfig fields)
COMPOSED = {
    "accumulation": {"stage": 2, "micro": 2},
    "offload": {"stage": 3, "offload": {"optimizer": "cpu", "params": "cpu"}},
    "checkpointing": {"stage": 3, "activation_checkpointing": {"classes": ["LlamaBlock"]}},
    "frozen-1": {"stage": 1, "frozen": True},  # (the frozen embedding: a row-wise DTensor kept whole at stages 0-2)
    "frozen-3": {"stage": 3, "frozen": True},  # (... sharded with its unit at stage 3)
    "zeroed-1": {"stage": 1, "clear": False},  # model.zero_grad(set_to_none=False) on the DTensor guards
    "zeroed-2": {"stage": 2, "clear": False},
}
STAGES = (0, 1, 2, 3)
PLAIN = {"plans": {plan: STAGES for plan in PLANS}}  # the plans alone, at every stage (the dp 3 mesh)
# the 2 x 2 mesh: the plans, the features composed with TP (COMPOSED's names), the stages of frozen parameters under
# bf16, Muon and bf16 parameters, and the FSDP2 anchors of the per-head q/k norms (declared; left plain: its drift);
# then the profiler and the refusals
FULL = PLAIN | {"composed": tuple(COMPOSED), "frozen-bf16": (1, 3), "muon": (1, 3), "bf16": (1, 3),
                "qk": ("fsdp2", "fsdp2_plain")}
QUICK = {  # --quick: every stage, plan and feature once, where its path differs most from the others
    "plans": {"plan1": (3,),  # plain embedding, norms and head next to DTensors, sharded with them over dp
              "plan2": (0,)},  # stage 0's whole gradients (1: frozen-1, zeroed-1; 2: accumulation, qk; 3: the rest)
    "composed": ("accumulation", "offload", "checkpointing",
                 "frozen-1",  # the frozen row-wise embedding kept whole (sharded with its unit: frozen-bf16 at 3)
                 "zeroed-1"),  # zeroed in place: a DTensor guard that holds no values
    "frozen-bf16": (3,),  # bf16 shards over fp32 masters, the frozen embedding sharded with its unit
    "muon": (3,),  # the owner gathers its matrix over tp, the parameter sharded over dp as well
    "bf16": (),  # (bf16 parameters: frozen-bf16, held to FSDP2's bf16 deviation)
    "qk": ("fsdp2",),  # (the plain q/k norms' FSDP2 drift is torch's; zero's refusal of them runs)
}


def tensor_parallel_checks(rank: int, world_size: int, tp: int, runs: dict) -> dict:
    """Everything one dp x tp world runs (``runs``: PLAIN, FULL or QUICK, returned as ``"matrix"``); rank 0's results
    (the reference is the same everywhere). With ``runs["composed"]``: also the features composed with TP, the q/k
    norms, the profiler and the refusals."""
    dp = world_size // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    global_batch = 4 * dp
    out: dict = {"matrix": runs, "reference": reference(global_batch)}
    for plan, sp in PLANS.items():
        out[plan, "fsdp2"] = fsdp2_tp(mesh, sp, global_batch)
        for stage in runs["plans"][plan]:
            out[plan, stage] = zero_tp(mesh, sp, stage, global_batch)
    if "composed" not in runs:
        return out if rank == 0 else {}
    out["frozen", "reference"] = reference(global_batch, frozen=True)
    for name in runs["composed"]:
        out[name] = zero_tp(mesh, True, global_batch=global_batch, **COMPOSED[name])
    for stage in runs["frozen-bf16"]:
        out["frozen-bf16", stage] = zero_tp(mesh, True, stage, global_batch, frozen=True,
                                            precision={"param_dtype": "bf16"})
    out["muon", "reference"] = reference_muon(global_batch)
    out["muon", "noise"] = reference_muon(global_batch, noise=MUON_NOISE)
    for stage in runs["muon"]:
        out["muon", stage] = zero_tp(mesh, True, stage, global_batch, optimizers=muon_adamw)
    if runs["bf16"]:
        out["bf16", "reference"] = reference_bf16(global_batch)
    out["bf16", "fsdp2"] = fsdp2_tp(mesh, True, global_batch, bf16=True)
    for stage in runs["bf16"]:
        out["bf16", stage] = zero_tp(mesh, True, stage, global_batch, precision={"param_dtype": "bf16"})
    qk = LlamaConfig(**{**CFG.__dict__, "qk_norm": True})
    out["profile"] = profiled(mesh, 3, global_batch)
    out["qk", "reference"] = reference(global_batch, qk)
    for anchor in runs["qk"]:
        out["qk", anchor] = fsdp2_tp(mesh, True, global_batch, qk, declared=anchor == "fsdp2")
    out["qk", 2] = zero_tp(mesh, True, 2, global_batch, qk)
    out["qk", "plain_error"] = value_error(lambda: zero_tp(mesh, True, 2, global_batch, qk, declared=False))
    out["refusals"] = _refusals(mesh)
    return out if rank == 0 else {}


def _refusals(mesh) -> dict:
    model = parallelize_module(_model(), mesh["tp"], tensor_parallel_plan(_model(), False))
    adamw = torch.optim.AdamW(model.parameters())

    def use_sharded() -> None:  # a stage-3 DTensor parameter used outside its unit's forward
        sharded = parallelize_module(_model(), mesh["tp"], tensor_parallel_plan(_model(), True))
        opt = ZeroOptimizer(torch.optim.AdamW(sharded.parameters()), sharded, stage=3, mesh=mesh["dp"])
        try:
            sharded.layers[0].attention.wq.weight * 2
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        finally:
            opt.close()

    def use_grad() -> None:  # p.grad of a DTensor parameter at stage 1 holds no values: used, it says so
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=1, mesh=mesh["dp"])
        model.loss(*(local_slice(t, mesh["dp"].get_local_rank(), mesh["dp"].size()) for t in _batch(0, 8))).backward()
        try:
            model.layers[0].attention.wq.weight.grad * 2
        except RuntimeError as e:
            raise ValueError(str(e)) from e
        finally:
            opt.close()

    return {
        "grad_use": value_error(use_grad),
        "sharded_use": value_error(use_sharded),
        "overlap": value_error(lambda: ZeroOptimizer(adamw, model, mesh=mesh["tp"])),
        "both": value_error(lambda: ZeroOptimizer(adamw, model, mesh=mesh["dp"], process_group=mesh["dp"].get_group())),
        "disk": value_error(lambda: ZeroOptimizer(adamw, model, mesh=mesh["dp"],
                                             offload={"optimizer": "disk", "path": tempfile.mkdtemp()})),
    }


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def loss_gap(run: dict, ref: dict) -> float:
    return max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))


def norm_gap(run: dict, ref: dict) -> float:
    return max(abs(a - b) / b for a, b in zip(run["norms"], ref["norms"]) if math.isfinite(b))
