"""What a pipeline schedule asks of the optimizer, in one process (world size 1): the reduction held back over
micro-batches and done once with no backward pass (``set_requires_gradient_sync`` / ``reduce_gradients``, what
``zero.pipelining.PipelineStage`` calls), and ``p.grad.div_(n)`` on a sharded-gradient guard (torch's own stage's
``scale_grads``). The schedules themselves run in ``tests/distributed/test_pipeline_world.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.readouts import flat_params
from tests.toy import Net, batch
from zero import ZeroOptimizer

STAGES = (0, 1, 2, 3)
MICRO = 3  # micro-batches of 2 of the batch's 6 rows
STEPS = 3
TOL = 1e-6


def _micro_losses(model: Net, step: int) -> list[torch.Tensor]:
    """The step's batch as ``MICRO`` mean losses (``Net``'s loss is a mean over its rows)."""
    return [model(rows) for rows in batch(step).chunk(MICRO)]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """One mean loss over the whole batch per step, clipped: what the micro-batches must add up to."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        model(batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return flat_params(model, None)


def _train(stage: int, backward) -> torch.Tensor:
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=stage)
    for step in range(STEPS):
        backward(model, opt, step)
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return flat_params(model, opt)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def held_back_then_reduced(model, opt, step):
    """torch's stage for FSDP, and zero's: every micro-batch with the synchronization off, one reduction after."""
    opt.set_requires_gradient_sync(False)
    for loss in _micro_losses(model, step):
        loss.backward()
    opt.set_requires_gradient_sync(True)
    opt.reduce_gradients(divide_factor=MICRO)


def reduced_each_then_divided(model, opt, step):
    """torch's own stage over any other module: a reduction per micro-batch, then ``p.grad.div_(n)``."""
    for loss in _micro_losses(model, step):
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(MICRO)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("backward", [held_back_then_reduced, reduced_each_then_divided], ids=["held", "divided"])
def test_micro_batches_add_up_to_the_batch(reference, stage, backward):
    assert _rel(_train(stage, backward), reference) < TOL


def test_reduce_gradients_without_held_gradients_changes_nothing():
    """Nothing accumulated (no backward, or already reduced): no reduction, no step."""
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=2)
    before = flat_params(model, opt)
    opt.reduce_gradients(divide_factor=4)
    opt.step()
    assert torch.equal(flat_params(model, opt), before)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_guard_keeps_refusing_other_uses(stage):
    """Only an in-place scaling by a number goes to the shards; a tensor factor still names the fix (``_opt`` kept
    alive: dropped, it would give the model back)."""
    model = Net()
    _opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=stage)
    model(batch(0)).backward()
    p = next(model.parameters())
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        p.grad.div_(torch.tensor(2.0))
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        p.grad.div(2)


class _Mesh:
    """A device mesh as ``mesh=`` reads it: named dimensions, each a group (strings stand in for groups here)."""

    def __init__(self, *names: str):
        self.mesh_dim_names, self.ndim = names, len(names)

    def __getitem__(self, name: str) -> "_Mesh":
        return _Mesh(name)

    def get_group(self) -> str:
        return f"group {self.mesh_dim_names[0]}"


def test_the_mesh_names_the_dp_and_pp_groups():
    from zero.comm.groups import data_parallel_group, pipeline_group

    assert data_parallel_group(None, _Mesh("dp")) == "group dp"
    assert data_parallel_group(None, _Mesh("replicate")) == "group replicate"  # any 1-D mesh, as FSDP2 takes it
    assert pipeline_group(_Mesh("pp")) is None  # a 1-D mesh is the dp dimension, whatever its name
    assert data_parallel_group(None, _Mesh("pp", "dp")) == "group dp"
    assert pipeline_group(_Mesh("pp", "dp", "tp")) == "group pp"
    with pytest.raises(ValueError, match="named among"):
        data_parallel_group(None, _Mesh("pp", "fsdp"))
