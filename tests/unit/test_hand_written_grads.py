"""A ``p.grad`` that no backward pass delivered (``torch.autograd.grad`` or ``torch.func``, then ``p.grad = g``) is
refused by ``step()`` and ``clip_grad_norm_()`` at every stage, naming the parameter and the fix, where it used to be
ignored: the step changed nothing, silently. ``opt.zero_grad()`` clears it, and training goes on as usual."""

from __future__ import annotations

import pytest
import torch

from tests.toy import Net, batch
from zero import ZeroOptimizer


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.parametrize("call", ("step", "clip"))
def test_gradients_written_by_hand_are_refused(stage, call):
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage, bucket_size_mb=1e-4)
    grads = torch.autograd.grad(model(batch(0), use_aux=True), list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    with pytest.raises(ValueError, match="was set outside a backward pass ZeroOptimizer saw"):
        opt.step() if call == "step" else opt.clip_grad_norm_(1.0)
    opt.zero_grad()
    with opt.gathered_parameters():
        before = [p.detach().clone() for p in model.parameters()]
    model(batch(0), use_aux=True).backward()
    opt.step()
    with opt.gathered_parameters():
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
