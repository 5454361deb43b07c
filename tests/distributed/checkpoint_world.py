"""What each rank runs in the portable-checkpoint tests (``test_checkpoint_world.py``).

Two models, each trained with AdamW (two param groups) and a StepLR schedule: the parity
``ParityNet`` (a tied embedding, a frozen parameter, a 1-element parameter, a buffer) and a
Hugging Face GPT-2 built from a config, with its first block frozen (not in the optimizer).
"""

from __future__ import annotations

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
