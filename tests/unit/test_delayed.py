"""The delayed step of CPU offload (``offload.delayed_step``) at world size 1: equal to the hand-built
one-step delayed update, different from synchronous training, off by default, and loud where it cannot
be exact (the multi-rank comparison is in ``tests/distributed/offload_world.py``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tests.readouts import flat_params
from tests.recipes import DelayedRecipe
from tests.toy import Net, batch
from zero import ZeroConfig, ZeroOptimizer

STEPS = 5
# the recipe's first optimizer step comes at its second step(): torch warns of its scheduler
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)


def train_zero(stage: int, delayed: bool, edit_at: int | None = None) -> tuple[torch.Tensor, ZeroOptimizer]:
    """Accumulation without no_sync (two backward passes per step), clipping, an LR schedule; the parameters
    after the last step, flushed."""
    model = Net()
    opt = ZeroOptimizer(make_adamw(model.parameters()), model, stage=stage, bucket_size_mb=1e-4,
                        offload={"optimizer": "cpu", "delayed_step": delayed})
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for step in range(STEPS):
        model(batch(step)).div(2).backward()
        model(batch(step + 10), step % 2 == 1).div(2).backward()  # aux: a gradient on odd steps only
        opt.clip_grad_norm_(0.1)
        opt.step()
        schedule.step()
        opt.zero_grad()
        if step == edit_at:
            with torch.no_grad():
                model.head.bias.add_(1.0)  # in place, outside gathered_parameters()
    opt.flush()
    return flat_params(model, opt), opt


def train_recipe() -> torch.Tensor:
    model = Net()
    recipe = DelayedRecipe(model, make_adamw)
    schedule = torch.optim.lr_scheduler.StepLR(recipe.opt, step_size=1, gamma=0.7)
    for step in range(STEPS):
        model(batch(step)).div(2).backward()
        model(batch(step + 10), step % 2 == 1).div(2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        recipe.step()
        schedule.step()
    recipe.flush()
    return flat_params(model)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_delayed_step_is_the_delayed_update(stage):
    got, opt = train_zero(stage, delayed=True)
    torch.testing.assert_close(got, train_recipe(), rtol=1e-6, atol=1e-7)
    synchronous, _ = train_zero(stage, delayed=False)
    assert not torch.allclose(got, synchronous, rtol=1e-3, atol=1e-4)  # the mode really delays
    steps = [float(state["step"]) for state in opt.state_dict()["optimizer"]["state"].values()]
    assert max(steps) == STEPS  # every update applied, the last by flush()


def test_off_unless_asked_and_loud_where_inexact():
    assert (ZeroConfig().offload.delayed_step is False
            and ZeroConfig(offload={"optimizer": "cpu"}).offload.delayed_step is False)
    with pytest.raises(ValidationError, match="needs the optimizer offloaded"):
        ZeroConfig(offload={"delayed_step": True})
    with pytest.raises(ValueError, match="changed in place while a delayed step was in flight"):
        train_zero(2, delayed=True, edit_at=2)
