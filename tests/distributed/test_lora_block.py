"""A LoRA-style block by hand (issue 23): a frozen ``nn.Linear`` and a trainable low-rank adapter beside it in the
same stage-3 unit, blocks in an ``nn.ModuleList`` (one unit each) between a frozen input layer and a frozen head.

The adapters of block ``i`` need the gradient of block ``i``'s input, which goes through the frozen weights of every
later block: a unit must stay gathered until the gradient of its input is computed, not only until its last
trainable gradient arrives. Trained with ``opt.clip_grad_norm_``, every stage must equal plain PyTorch bit for bit in
one process (without a process group, and stage 3 in a gloo world of one with ``force_collectives=True``, which
sends every all-gather and reduce-scatter for real), and the frozen weights must not change.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_world
from tests.toy import batch
from zero import ZeroOptimizer

D, R, BLOCKS, STEPS, MAX_NORM = 16, 4, 3, 6, 0.5


class Adapted(nn.Module):
    """``x + tanh(base(x) + up(down(x)))`` with ``base`` frozen: PEFT's LoRA ``Linear`` in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.down = nn.Linear(D, R, bias=False)
        self.up = nn.Linear(R, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + self.up(self.down(x)))


class AdaptedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D).requires_grad_(False)
        self.blocks = nn.ModuleList(Adapted() for _ in range(BLOCKS))
        self.head = nn.Linear(D, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def train(stage: int | None, **options) -> dict:
    """``STEPS`` AdamW steps with clipping: plain PyTorch (``stage=None``) or ZeroOptimizer; the losses, norms and
    every parameter afterwards, and the parameters before."""
    torch.manual_seed(0)
    model = AdaptedNet()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    if stage is not None:
        opt = ZeroOptimizer(opt, model, stage=stage, **options)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(batch(step, rows=8, width=D))
        loss.backward()
        if stage is None:
            norms.append(torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM).item())
        else:
            norms.append(opt.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with opt.gathered_parameters() if stage is not None else torch.no_grad():
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "final": final, "initial": initial}


def _check_equal(ours: dict, ref: dict) -> None:
    assert ours["losses"] == ref["losses"]
    assert ours["norms"] == ref["norms"]
    different = [n for n, p in ref["final"].items() if not torch.equal(ours["final"][n], p)]
    assert not different, f"parameters differ from plain PyTorch: {different}"
    frozen = [n for n in ref["final"] if not n.endswith(("down.weight", "up.weight"))]
    changed = [n for n in frozen if not torch.equal(ours["final"][n], ref["initial"][n])]
    assert not changed, f"frozen parameters changed: {changed}"


@pytest.fixture(scope="module")
def plain() -> dict:
    ref = train(None)
    assert any(n > MAX_NORM for n in ref["norms"])  # clipping acts
    moved = [n for n in ref["final"] if not torch.equal(ref["final"][n], ref["initial"][n])]
    assert sorted(moved) == sorted(f"blocks.{i}.{m}.weight" for i in range(BLOCKS) for m in ("down", "up"))
    return ref


RUNS = [(0, {}), (1, {}), (2, {}), (3, {}), (3, {"reshard_after_forward": False}), (3, {"prefetch_units": 0})]
IDS = ["stage0", "stage1", "stage2", "stage3", "stage3-keep-after-forward", "stage3-no-prefetch"]


@pytest.mark.parametrize("stage,options", RUNS, ids=IDS)
def test_adapter_beside_a_frozen_linear_equals_pytorch(plain, stage, options):
    _check_equal(train(stage, **options), plain)


def _forced(rank: int, world_size: int) -> dict:
    return train(3, force_collectives=True)


def test_stage3_with_forced_collectives_equals_pytorch(plain):
    _check_equal(run_world(_forced, 1)[0], plain)
