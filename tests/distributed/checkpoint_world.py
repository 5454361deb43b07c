"""What each rank runs in the portable-checkpoint tests (``test_checkpoint_world.py``, and
``test_checkpoint_optimizers.py`` for the section at the end).

Two models, each trained with AdamW (two param groups) and a StepLR schedule: the parity
``ParityNet`` (a tied embedding, a frozen parameter, a 1-element parameter, a buffer) and a
Hugging Face GPT-2 built from a config, with its first block frozen (not in the optimizer).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import tempfile
from pathlib import Path

import torch

import zero
from tests.distributed.harness import global_mean
from tests.distributed.worlds import BUCKET_MB, CFG, GLOBAL_BATCH, build_model, make_optimizer
from tests.readouts import flat_params
from tests.toy import tiny_hf
from zero.models import local_slice, synthetic_batch

FIRST, MORE = 6, 6  # steps before the save, and after it
MODELS = ("parity", "gpt2")


def _gpt2(seed: int):
    model = tiny_hf("gpt2", seed, vocab_size=CFG.vocab_size).eval()  # eval: no dropout, so ranks and runs agree
    for name, p in model.named_parameters():
        p.requires_grad_(".h.0." not in name)
    return model


def build(kind: str, stage: int, seed: int = 0, **overrides):
    """A model, its ZeroOptimizer (at ``stage``, on the default group) and a StepLR schedule."""
    if kind == "parity":
        model = build_model(seed)
        inner = make_optimizer("adamw", model)
    else:
        model = _gpt2(seed)
        trained = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trained if p.dim() >= 2]},
                  {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}]
        inner = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    opt = zero.ZeroOptimizer(inner, model, stage=stage, bucket_size_mb=BUCKET_MB, **overrides)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


def train(kind: str, model, opt, scheduler, steps, rank: int, world_size: int) -> list[float]:
    """Train on the steps' global batches (this rank's share); return the global mean losses."""
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = model(x, y, step % 2 == 1) if kind == "parity" else model(input_ids=x, labels=x).loss
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(global_mean(loss, world_size))
    return losses


def continued(kind: str, model, opt, scheduler, rank: int, world_size: int) -> dict:
    losses = train(kind, model, opt, scheduler, range(FIRST, FIRST + MORE), rank, world_size)
    return {"losses": losses, "params": flat_params(model, opt), "lr": [g["lr"] for g in opt.param_groups]}


def save_and_continue(rank: int, world_size: int, root: str) -> dict:
    """N=3, stage 2: train, save, continue (the reference); then resume at N=3 stage 2 and stage 1."""
    out = {}
    for kind in MODELS:
        model, opt, scheduler = build(kind, stage=2)
        train(kind, model, opt, scheduler, range(FIRST), rank, world_size)
        path = Path(root) / kind
        zero.save_checkpoint(path, model, opt, scheduler=scheduler, extra={"next_step": FIRST, "kind": kind},
                             progress=False)
        out[(kind, "reference")] = continued(kind, model, opt, scheduler, rank, world_size)
        for stage in (2, 1):
            out[(kind, f"resumed{stage}")] = resume(kind, stage, path, rank, world_size)
    return out


def resume(kind: str, stage: int, path: Path, rank: int, world_size: int, **overrides) -> dict:
    """A fresh run (other initial weights), loaded from ``path``, trained the remaining steps."""
    model, opt, scheduler = build(kind, stage, seed=1, **overrides)
    extra = zero.load_checkpoint(path, model, opt, scheduler=scheduler, progress=False)
    assert extra == {"next_step": FIRST, "kind": kind}, extra
    return continued(kind, model, opt, scheduler, rank, world_size)


def resume_world(rank: int, world_size: int, root: str, stage: int, disk: bool = False) -> dict:
    """Resumed at ``stage``; with ``disk`` also with stage 3's parameters and optimizer offloaded to disk."""
    out = {(kind, f"resumed{stage}"): resume(kind, stage, Path(root) / kind, rank, world_size) for kind in MODELS}
    if disk:
        with tempfile.TemporaryDirectory() as offload:
            for kind in MODELS:
                out[(kind, f"resumed{stage}-disk")] = resume(kind, stage, Path(root) / kind, rank, world_size,
                                                             offload={"params": "disk", "path": offload})
    return out


def killed_mid_save(rank: int, world_size: int, root: str) -> dict:
    """Save at step 2; train a step; save over it again, and rank 1 dies halfway through writing its part."""
    model, opt, scheduler = build("parity", stage=2, timeout_s=30)
    train("parity", model, opt, scheduler, range(2), rank, world_size)
    path = Path(root) / "ckpt"
    zero.save_checkpoint(path, model, opt, scheduler=scheduler, progress=False)
    saved = flat_params(model, opt)
    train("parity", model, opt, scheduler, range(2, 3), rank, world_size)

    def die(done: int, total: int) -> None:
        if rank == 1 and done >= total // 2:
            os._exit(17)

    try:
        zero.save_checkpoint(path, model, opt, progress=die)
    except RuntimeError as err:
        return {"saved": saved, "error": str(err)}
    return {"saved": saved, "error": None}


# ----- several optimizers, and optimizers stepped on whole parameters (issue 42) ---------------------------------
#
# ``Hidden`` trained with Muon (its two hidden matrices) + AdamW (the rest, two groups) in one ZeroOptimizer, with
# Adafactor, and with SOAP (``pytorch_optimizer``, whose state holds lists of matrices and Python numbers): saved at
# N=2, resumed at N=1, 2 and 3, every run compared bit for bit with the one that never stopped. Across world sizes
# that needs the reduced gradient to be the same bits at every N: every rank computes the gradient of the global
# batch, and a hook hands rank 0's, rounded to 8 significant bits and multiplied by N (exact), to the reduction and
# zeros from the others, so the reduction (divided by N, summed) gives back exactly the rounded gradient at any N.
# Each world also trains the whole run uninterrupted, which checks that premise on its own.

WHOLE_RECIPES = ("muon_adamw", "adafactor", "soap")
SAVED_AT = 2  # the world size that saves
SAVE_STAGE = 2
RESUMES = {1: (0, 2), 2: (3,), 3: (1, 3)}  # world size: the stages resumed at through the portable checkpoint
STAGE0 = "muon_adamw-stage0"  # also saved at stage 0 (every rank owns every whole parameter; rank i mod N writes)
WHOLE_FIRST, WHOLE_MORE = 3, 3


class Hidden(torch.nn.Module):
    """An embedding, a residual MLP (the three hidden matrices Muon takes, which change owners between 2 and 3
    ranks), a LayerNorm and an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.down = torch.nn.Linear(24, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        gelu = torch.nn.functional.gelu
        x = x + self.down(gelu(self.mid(gelu(self.up(x)))))
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def whole_missing(recipe: str) -> str | None:
    """Why ``recipe`` cannot run here (``None``: it can)."""
    needs = {"muon_adamw": "Muon", "adafactor": "Adafactor"}.get(recipe)
    if needs is not None and getattr(torch.optim, needs, None) is None:
        return f"torch {torch.__version__} has no torch.optim.{needs}"
    if recipe == "soap" and importlib.util.find_spec("pytorch_optimizer") is None:
        return "pytorch_optimizer is not installed"
    return None


def whole_optimizers(recipe: str, model: Hidden) -> list[torch.optim.Optimizer]:
    hidden = [model.up.weight, model.mid.weight, model.down.weight]
    matrices = [model.embed.weight, model.head.weight]
    vectors = [model.up.bias, model.mid.bias, model.down.bias, model.norm.weight, model.norm.bias]
    if recipe == "muon_adamw":
        return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01),
                torch.optim.AdamW([{"params": matrices}, {"params": vectors, "lr": 5e-3, "weight_decay": 0.0}],
                                  lr=1e-2, weight_decay=0.1)]
    groups = [{"params": hidden + matrices}, {"params": vectors, "weight_decay": 0.0}]
    if recipe == "adafactor":
        return [torch.optim.Adafactor(groups, lr=1e-2, weight_decay=0.01)]
    from pytorch_optimizer import SOAP

    return [SOAP(groups, lr=3e-3, precondition_frequency=2)]


def _exact_share(rank: int, world_size: int, grad: torch.Tensor) -> torch.Tensor:
    """Rank 0's gradient, rounded to bf16's 8 significant bits and times N (exact); zeros elsewhere."""
    return grad.to(torch.bfloat16).to(grad.dtype) * world_size if rank == 0 else torch.zeros_like(grad)


def build_whole(recipe: str, stage: int, rank: int, world_size: int, seed: int = 0):
    """``Hidden`` with the exact-share hooks, its ZeroOptimizer over ``recipe`` and a StepLR schedule."""
    torch.manual_seed(seed)
    model = Hidden()
    for p in model.parameters():
        p.register_hook(functools.partial(_exact_share, rank, world_size))
    opt = zero.ZeroOptimizer(whole_optimizers(recipe, model), model, stage=stage, bucket_size_mb=0.0005)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_whole(model, opt, scheduler, steps) -> list[float]:
    """Every rank trains on the whole global batch of each step (the hooks share it out exactly)."""
    losses = []
    for step in steps:
        idx = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(step))
        loss = model(idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _finish(model, opt, scheduler) -> dict:
    losses = train_whole(model, opt, scheduler, range(WHOLE_FIRST, WHOLE_FIRST + WHOLE_MORE))
    return {"losses": losses, "params": flat_params(model, opt), "lr": [g["lr"] for g in opt.param_groups]}


def _uninterrupted(recipe: str, stage: int, rank: int, world_size: int) -> dict:
    model, opt, scheduler = build_whole(recipe, stage, rank, world_size)
    train_whole(model, opt, scheduler, range(WHOLE_FIRST))
    return _finish(model, opt, scheduler)


def _whole_states(opt) -> dict[str, dict]:
    """This rank's whole-parameter optimizer state by parameter name (shapes and values, cloned)."""
    out = {}
    for slot, stand_in in opt.runtime.whole_parameter_step.owned():
        for inner in opt.optimizers:
            if stand_in in inner.state:
                out[slot.name] = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                  for k, v in inner.state[stand_in].items()}
    return out


def _resumed(recipe: str, stage: int, path: Path, rank: int, world_size: int) -> dict:
    """Other initial weights, loaded from ``path`` at ``stage``: what each rank owns and its state, then trained on."""
    model, opt, scheduler = build_whole(recipe, stage, rank, world_size, seed=1)
    zero.load_checkpoint(path, model, opt, scheduler=scheduler, progress=False)
    owned = {slot.name: opt.runtime.whole_parameter_step.owner_of[key]
             for key, slot in opt.runtime.whole_parameter_step.slot_of.items()}
    return {"states": _whole_states(opt), "owners": owned, **_finish(model, opt, scheduler)}


def save_whole_world(rank: int, world_size: int, root: str) -> dict:
    """N=2: per recipe, train, save a portable checkpoint and each rank's state_dict, go on (the reference); then
    resume from this rank's state_dict (the weights through gathered_parameters), and from the portable one. Muon +
    AdamW is also saved at stage 0 (``STAGE0``) and resumed at stage 1."""
    out = {}
    for recipe in WHOLE_RECIPES:
        if whole_missing(recipe):
            continue
        model, opt, scheduler = build_whole(recipe, SAVE_STAGE, rank, world_size)
        train_whole(model, opt, scheduler, range(WHOLE_FIRST))
        path = Path(root) / recipe
        zero.save_checkpoint(path, model, opt, scheduler=scheduler, progress=False)
        shard = copy.deepcopy(opt.state_dict())
        weights = {k: v.clone() for k, v in model.state_dict().items()}  # (stage 2: whole on every rank)
        saved = {"params": flat_params(model, opt), "states": _whole_states(opt),
                 "owners": {slot.name: opt.runtime.whole_parameter_step.owner_of[key]
                            for key, slot in opt.runtime.whole_parameter_step.slot_of.items()},
                 "shard": {k: shard[k] for k in ("format", "inners")} if "inners" in shard else shard["inner"],
                 "scheduler": scheduler.state_dict()}
        out[(recipe, "saved")] = saved
        out[(recipe, "reference")] = _finish(model, opt, scheduler)
        model, opt, scheduler = build_whole(recipe, SAVE_STAGE, rank, world_size, seed=1)
        with opt.gathered_parameters():
            model.load_state_dict(weights)
        opt.load_state_dict(shard)
        scheduler.load_state_dict(saved["scheduler"])
        out[(recipe, "per-rank")] = _finish(model, opt, scheduler)
        for stage in RESUMES[world_size]:
            out[(recipe, f"resumed{stage}")] = _resumed(recipe, stage, path, rank, world_size)
        out[(recipe, "uninterrupted")] = _uninterrupted(recipe, SAVE_STAGE, rank, world_size)
        if recipe == "muon_adamw":
            model, opt, scheduler = build_whole(recipe, 0, rank, world_size)
            train_whole(model, opt, scheduler, range(WHOLE_FIRST))
            zero.save_checkpoint(Path(root) / STAGE0, model, opt, scheduler=scheduler, progress=False)
            out[(STAGE0, "resumed1")] = _resumed(recipe, 1, Path(root) / STAGE0, rank, world_size)
    return out


def resume_whole_world(rank: int, world_size: int, root: str) -> dict:
    """N=1 or 3: per recipe, resume the N=2 checkpoint at each stage of ``RESUMES`` (and the one saved at stage 0
    at the last); train uninterrupted too."""
    out = {}
    for recipe in WHOLE_RECIPES:
        if whole_missing(recipe):
            continue
        for stage in RESUMES[world_size]:
            out[(recipe, f"resumed{stage}")] = _resumed(recipe, stage, Path(root) / recipe, rank, world_size)
        out[(recipe, "uninterrupted")] = _uninterrupted(recipe, RESUMES[world_size][-1], rank, world_size)
        if recipe == "muon_adamw":
            stage = RESUMES[world_size][-1]
            out[(STAGE0, f"resumed{stage}")] = _resumed(recipe, stage, Path(root) / STAGE0, rank, world_size)
    return out
