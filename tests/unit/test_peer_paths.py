"""Paths the peers' own test suites exercise (DeepSpeed ZeRO, FSDP2, torch's ZeroRedundancyOptimizer), in one
process: each was a failure on main once (issue 23)."""

from __future__ import annotations

import datetime

import pytest
import torch

from tests.toy import Net, batch
from zero import ZeroOptimizer
from zero.comm import Handle

STAGES = (0, 1, 2, 3)


def _params(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    with opt.gathered_parameters() if isinstance(opt, ZeroOptimizer) else torch.no_grad():
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _with_skipped_steps(stage: int | None) -> tuple[torch.Tensor, list[float], list[float]]:
    """Train with SGD and a StepLR; every third step is `zero_grad(); step()` with no backward
    (torch: nothing updated, the scheduler still steps). Returns parameters, learning rates and the clip
    norms of the skipped steps."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if stage is not None:
        opt = ZeroOptimizer(opt, model, stage=stage)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs, norms = [], []
    for step in range(7):
        opt.zero_grad()
        if step % 3 == 2:
            clip = opt.clip_grad_norm_ if stage is not None else torch.nn.utils.clip_grad_norm_
            norms.append(float(clip(1.0) if stage is not None else clip(model.parameters(), 1.0)))
        else:
            model(batch(step)).backward()
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return _params(model, opt), lrs, norms


@pytest.mark.parametrize("stage", STAGES)
def test_step_without_backward_updates_nothing_and_the_scheduler_goes_on(stage):
    """Peers: torch ``test_zero_redundancy_optimizer.py::test_lr_scheduler``, DeepSpeed's zero_grad variants."""
    ref_params, ref_lrs, ref_norms = _with_skipped_steps(None)
    params, lrs, norms = _with_skipped_steps(stage)
    assert torch.equal(params, ref_params)
    assert lrs == ref_lrs
    assert norms == ref_norms == [0.0, 0.0]


class ScaledSGD(torch.optim.SGD):
    """An optimizer whose ``step`` takes an extra keyword argument (peer: torch ``test_step_with_kwargs``)."""

    @torch.no_grad()
    def step(self, closure=None, *, lr_scale: float = 1.0):
        for group in self.param_groups:
            group["lr"] *= lr_scale
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] /= lr_scale


def _train_with_kwargs_and_closure(stage: int | None) -> tuple[torch.Tensor, list[float]]:
    model = Net()
    opt = ScaledSGD(model.parameters(), lr=0.1)
    if stage is not None:
        opt = ZeroOptimizer(opt, model, stage=stage)
    losses = []
    for step in range(4):
        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = model(batch(step))
            loss.backward()
            return loss

        losses.append(opt.step(closure, lr_scale=0.5 * (step + 1)).item())
    return _params(model, opt), losses


@pytest.mark.parametrize("stage", STAGES)
def test_step_forwards_its_keyword_arguments_and_runs_the_closure(stage):
    ref_params, ref_losses = _train_with_kwargs_and_closure(None)
    params, losses = _train_with_kwargs_and_closure(stage)
    assert losses == ref_losses
    assert torch.equal(params, ref_params)


class _TimedOut:
    def wait(self, timeout: datetime.timedelta) -> None:
        raise RuntimeError("timed out")


def test_a_timeout_below_one_second_is_printed_as_given():
    handle = Handle(_TimedOut(), "all-gather of bucket 0", datetime.timedelta(seconds=0.5))
    with pytest.raises(RuntimeError, match=r"did not complete within 0\.5s"):
        handle.wait()
