"""Optimizers stepped on whole parameters in a real world (issue 42): what each rank runs, and the single-process
references (``tests/distributed/test_optimizers_world.py`` compares them).

Every recipe trains ``worlds.ParityNet`` (tied weights, a module unused on even steps, a frozen parameter, a
1-element parameter, parameters split across ranks by small buckets, a stage-3 unit called twice) for a few steps:
in one process on the global batch (the reference), under DDP (whose deviation from the reference is the noise
floor) and with ``ZeroOptimizer`` at stages 0-3:

* Muon (torch's, on the 2-D hidden matrices) + AdamW (the rest, two groups) as one ``ZeroOptimizer`` over a list,
  also accumulating 4 micro-batches of 2 under ``no_sync()`` (against 1 micro-batch of 8 in one process), clipped
  (``clip_grad_norm_`` against torch's clip), with stage 3 prefetching 2 units and with the optimizer offloaded;
* Adafactor (torch's), LAMB (also with ``pre_norm=True``: a global norm inside its step, so one owner) and SOAP
  (``pytorch_optimizer``): each recipe missing here is left out;
* an optimizer zero does not know, with a per-tensor norm (:class:`NormalizedSGD`), stepped whole (exact, no
  warning) and declared elementwise in ``ZeroConfig`` (flat: differs, which proves the declaration is honoured);
* Muon + AdamW under bf16 parameters over fp32 masters against the hand-built recipe (``tests.recipes``).

``MATRIX`` says the stages of each (``QUICK_MATRIX`` under ``--quick``).
"""

from __future__ import annotations

import importlib.util
import warnings
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.harness import global_mean
from tests.distributed.worlds import BUCKET_MB, CFG, build_model
from tests.readouts import flat_params, master_weights
from tests.recipes import MasterRecipe, SeveralOptimizers
from zero import ZeroOptimizer
from zero.models import GPT, local_slice, synthetic_batch

STAGES = (0, 1, 2, 3)
STEPS = 3
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
MICRO, MICRO_BATCH = 4, 2  # accumulation: 4 micro-batches of 2 per rank
CLIP = 0.5
NUM_BATCHES = 2  # batches revisited
OFFLOAD_STAGES = (1, 3)  # the optimizer on the host (on a CPU machine the same memory, but the offloaded path)
DECLARED_STAGES = (1, 3)  # where an optimizer declared elementwise steps flat slices
PLAIN = ("muon_adamw", "adafactor", "lamb", "lamb_prenorm", "soap")  # the recipes trained without a scenario
MATRIX = {  # the stages of each part: (recipe, scenario) runs, the unknown optimizer whole and declared, offload, bf16
    "runs": {**{(recipe, "plain"): STAGES for recipe in PLAIN}, ("muon_adamw", "accum"): STAGES,
             ("muon_adamw", "clip"): STAGES},
    "unknown": STAGES, "declared": DECLARED_STAGES, "offload": OFFLOAD_STAGES, "bf16": STAGES,
}
QUICK_MATRIX = {  # --quick: Muon + AdamW at every stage, each other path once, at the stage where it differs most
    "runs": {
        ("muon_adamw", "plain"): STAGES,
        # the other rules at stage 3, where the owner needs the holders' master pieces too (below it the owner reads
        # the whole current values from its own parameter buffer): the most exchanged
        **{(recipe, "plain"): (3,) for recipe in PLAIN[1:]},
        ("muon_adamw", "accum"): (2,),  # no_sync() over reduce-scatter hooks: one update per step, not per micro-batch
        ("muon_adamw", "clip"): (3,),  # the global norm over both optimizers' sharded gradients
    },
    "unknown": (3,),  # stepped whole, the master pieces exchanged as above
    "declared": (1,),  # flat slices: a parameter split over the optimizer-state shards, normalized piece by piece
    "offload": (1,),  # below stage 3 only the host master makes the master travel to the owner
    "bf16": (2,),  # fp32 masters apart from the bf16 parameters (they travel), the bf16 gradients sharded
}


class NormalizedSGD(torch.optim.Optimizer):
    """An optimizer zero does not know: each parameter moves ``lr`` along its gradient's direction,
    ``p -= lr * g / ||g||`` (a per-tensor norm, so wrong on flat slices of a parameter)."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"] / float(p.grad.norm().clamp_min(1e-12)))


def _hidden(name: str, p: nn.Parameter) -> bool:
    """The hidden matrices Muon steps: every 2-D weight but the (tied) embedding and the positions."""
    return p.dim() == 2 and not name.startswith(("gpt.wte", "gpt.wpe"))


def _split(model: nn.Module) -> tuple[list, list, list]:
    """(hidden matrices, other matrices, vectors) of ``model``, in model order (the frozen parameter included)."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if _hidden(n, p)]
    rest = [(n, p) for n, p in named if not _hidden(n, p)]
    return hidden, [p for _, p in rest if p.dim() >= 2], [p for _, p in rest if p.dim() < 2]


def _groups(params: list, vectors: list, lr: float) -> list[dict]:
    """Two groups with different hyperparameters (the vectors at half the learning rate, no weight decay)."""
    return [{"params": params}, {"params": vectors, "lr": lr * 0.5, "weight_decay": 0.0}]


def muon_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden, matrices, vectors = _split(model)
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(_groups(matrices, vectors, 1e-2), lr=1e-2, weight_decay=0.1)]


def adafactor(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden, matrices, vectors = _split(model)
    return [torch.optim.Adafactor(_groups(hidden + matrices, vectors, 1e-2), lr=1e-2, weight_decay=0.01)]


def lamb(model: nn.Module) -> list[torch.optim.Optimizer]:
    from pytorch_optimizer import Lamb

    hidden, matrices, vectors = _split(model)
    return [Lamb(_groups(hidden + matrices, vectors, 1e-2), lr=1e-2, weight_decay=0.01)]


def lamb_prenorm(model: nn.Module) -> list[torch.optim.Optimizer]:
    """LAMB scaling every gradient by the global norm over all its parameters inside its step: one owner steps them
    all (per parameter, each owner would see only its own parameters' norm)."""
    from pytorch_optimizer import Lamb

    hidden, matrices, vectors = _split(model)
    return [Lamb(_groups(hidden + matrices, vectors, 1e-2), lr=1e-2, weight_decay=0.01, pre_norm=True)]


def soap(model: nn.Module) -> list[torch.optim.Optimizer]:
    from pytorch_optimizer import SOAP

    hidden, matrices, vectors = _split(model)
    return [SOAP(_groups(hidden + matrices, vectors, 3e-3), lr=3e-3, precondition_frequency=2)]


def normalized(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [NormalizedSGD([p for p in model.parameters()], lr=0.01)]


RECIPES: dict[str, Callable[[nn.Module], list[torch.optim.Optimizer]]] = {
    "muon_adamw": muon_adamw, "adafactor": adafactor, "lamb": lamb, "lamb_prenorm": lamb_prenorm, "soap": soap,
    "normalized": normalized,
}


def missing(recipe: str) -> str | None:
    """Why ``recipe`` cannot run here (``None``: it can): torch before Muon or Adafactor, no ``pytorch_optimizer``."""
    needs = {"muon_adamw": "Muon", "adafactor": "Adafactor"}.get(recipe)
    if needs is not None and getattr(torch.optim, needs, None) is None:
        return f"torch {torch.__version__} has no torch.optim.{needs}"
    if recipe in ("lamb", "lamb_prenorm", "soap") and importlib.util.find_spec("pytorch_optimizer") is None:
        return "pytorch_optimizer is not installed (pip install pytorch_optimizer)"
    return None


def whole_updates(optimizers: list[torch.optim.Optimizer]) -> int:
    """Parameters with a gradient now in the optimizers zero steps whole (every one here but AdamW)."""
    return sum(p.grad is not None for o in optimizers if not isinstance(o, torch.optim.AdamW)
               for g in o.param_groups for p in g["params"])


def train(recipe: str, scenario: str, rank: int, world_size: int, mode: str, settings: dict | None = None) -> dict:
    """``STEPS`` steps of ``recipe``; ``mode``: "reference" (one process, the global batch of ``world_size`` ranks
    in one micro-batch), "ddp" or "stage{0..3}" (with ``settings``: more ``ZeroConfig`` fields); ``scenario``:
    "plain", "accum" (4 micro-batches of 2 per rank, under ``no_sync`` but the last) or "clip" (the global norm
    clipped to ``CLIP``)."""
    model = build_model()
    optimizers = RECIPES[recipe](model)
    accum = scenario == "accum"
    micro = MICRO if accum else 1
    global_batch = MICRO * MICRO_BATCH * world_size if accum else GLOBAL_BATCH
    if mode == "reference":
        rank, world_size, micro = 0, 1, 1
        forward, no_sync, opt = model, nullcontext, None
    elif mode == "ddp":
        forward = DistributedDataParallel(model, find_unused_parameters=True)
        no_sync, opt = forward.no_sync, None
    else:
        opt = ZeroOptimizer(optimizers, model, stage=int(mode[-1]), bucket_size_mb=BUCKET_MB, **(settings or {}))
        forward, no_sync = model, opt.no_sync
    losses, norms, counted = [], [], 0
    for step in range(STEPS):
        x, y = synthetic_batch(step % NUM_BATCHES, global_batch, CFG)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with nullcontext() if i == micro - 1 else no_sync():
                loss = forward(xm, ym, step % 2 == 1) / micro
                loss.backward()
            total += loss.detach()
        if scenario == "clip":
            clip = opt.clip_grad_norm_ if opt is not None else (
                lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
            norms.append(float(clip(CLIP)))
        counted += whole_updates(optimizers) if opt is None else 0
        for o in [opt] if opt is not None else optimizers:
            o.step()
            o.zero_grad()
        losses.append(global_mean(total, world_size))
    out = {"losses": losses, "norms": norms, "params": flat_params(model, opt), "whole_updates": counted}
    if opt is not None:
        out["updates"] = opt.runtime.whole_parameter_step.updates
        out["owned"] = len(opt.runtime.whole_parameter_step.owned())
        out["all_to_all"] = opt.comm_stats.get("all_to_all", {}).get("numel", 0)  # (the last step's)
        opt.close()
    return out


def _runs(recipe: str, scenario: str, rank: int, world_size: int, stages: tuple[int, ...] = STAGES) -> dict:
    runs = {}
    if rank == 0:  # in the same process as the runs it is compared with (same threads, same kernels)
        runs["reference"] = train(recipe, scenario, 0, world_size, "reference")
    for mode in ("ddp", *(f"stage{s}" for s in stages)):
        runs[mode] = train(recipe, scenario, rank, world_size, mode)
    return runs


def unknown_optimizer(rank: int, world_size: int, stages: tuple[int, ...] = STAGES,
                      declared: tuple[int, ...] = DECLARED_STAGES) -> dict:
    """:class:`NormalizedSGD` stepped whole (at ``stages``, warnings recorded) and declared elementwise (at
    ``declared``)."""
    out = {"whole": {}, "declared": {}, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["whole"] = _runs("normalized", "plain", rank, world_size, stages)
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    for stage in declared:
        settings = {"elementwise_optimizers": ["NormalizedSGD"]}
        out["declared"][stage] = train("normalized", "plain", rank, world_size, f"stage{stage}", settings)
    return out


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _gpt_muon_adamw(named: list[tuple[str, torch.Tensor]]) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in named if p.dim() == 2 and n.startswith("blocks")]
    rest = [p for n, p in named if not (p.dim() == 2 and n.startswith("blocks"))]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)]


def bf16_recipe(rank: int, world_size: int, ddp: bool) -> torch.Tensor:
    """The hand-built bf16 recipe with Muon + AdamW on fp32 masters, in one process or under DDP."""
    model = _gpt()
    names = [n for n, _ in model.named_parameters()]
    r = MasterRecipe(model, torch.bfloat16,
                     lambda masters: SeveralOptimizers(_gpt_muon_adamw(list(zip(names, masters)))))
    forward = DistributedDataParallel(r.low) if ddp else r.low
    for step in range(STEPS):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        if ddp:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        nn.functional.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
        r.grads_to_master()
        r.step()
    return r.flat()


def bf16_run(rank: int, world_size: int, stage: int) -> torch.Tensor:
    model = _gpt()
    opt = ZeroOptimizer(_gpt_muon_adamw(list(model.named_parameters())), model, stage=stage,
                        precision={"param_dtype": "bf16"}, bucket_size_mb=BUCKET_MB)
    for step in range(STEPS):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        opt.backward(model.loss(local_slice(x, rank, world_size), local_slice(y, rank, world_size)))
        opt.step()
        opt.zero_grad()
    masters = master_weights(opt)
    opt.close()
    return masters


def bf16_parity(rank: int, world_size: int, stages: tuple[int, ...] = STAGES) -> dict:
    out = {"ddp": bf16_recipe(rank, world_size, ddp=True)}
    if rank == 0:
        out["reference"] = bf16_recipe(0, 1, ddp=False)
    for stage in stages:
        out[stage] = bf16_run(rank, world_size, stage)
    return out


def optimizer_checks(rank: int, world_size: int, matrix: dict = MATRIX) -> dict:
    """Everything one world runs (recipes missing here are left out: the tests skip them), at ``matrix``'s stages
    (``QUICK_MATRIX`` under ``--quick``), returned with the results."""
    runs = {}
    for recipe in PLAIN:
        if missing(recipe) is None:
            runs[(recipe, "plain")] = _runs(recipe, "plain", rank, world_size, matrix["runs"][(recipe, "plain")])
    out: dict = {"matrix": matrix, "runs": runs,
                 "unknown": unknown_optimizer(rank, world_size, matrix["unknown"], matrix["declared"])}
    if missing("muon_adamw") is None:
        for scenario in ("accum", "clip"):
            stages = matrix["runs"][("muon_adamw", scenario)]
            runs[("muon_adamw", scenario)] = _runs("muon_adamw", scenario, rank, world_size, stages)
        out["prefetch"] = train("muon_adamw", "plain", rank, world_size, "stage3", {"prefetch_units": 2})
        with warnings.catch_warnings():  # (AdamW's foreach host step is the reference's: no fused kernel here)
            warnings.filterwarnings("ignore", "offloaded AdamW steps on the host")
            out["offload"] = {stage: train("muon_adamw", "plain", rank, world_size, f"stage{stage}",
                                           {"offload": {"optimizer": "cpu"}}) for stage in matrix["offload"]}
        out["bf16"] = bf16_parity(rank, world_size, matrix["bf16"])
    return out
