"""World size 1 without a process group: exact equality with plain PyTorch, and API behaviour."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.runtime.buffers.sharded_grad import ShardedGrad

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=2)


def train(model, opt, steps=4, clip=None, scheduler=None):
    for step in range(steps):
        x, y = synthetic_batch(step, 4, CFG)
        model.loss(x, y).backward()
        if clip is not None:
            clip()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.RMSprop, {"lr": 1e-2}),
    ],
)
def test_bit_identical_to_plain_pytorch_without_a_process_group(stage, cls, kwargs):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = cls(ref.parameters(), **kwargs)
    opt = ZeroOptimizer(cls(model.parameters(), **kwargs), model, stage=stage, bucket_size_mb=0.001)
    train(ref, ref_opt, clip=lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    train(model, opt, clip=lambda: opt.clip_grad_norm_(0.1))
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert opt.comm.world_size == 1 and opt.comm_stats == {}  # nothing is sent
    assert type(opt.zero_stage) is int and opt.zero_stage == opt.stage_policy.number == stage  # (as in DeepSpeed)


def test_lr_scheduler_drives_the_sharded_optimizer():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(ref, ref_opt, scheduler=ref_sched)
    train(model, opt, scheduler=sched)
    assert opt.inner.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5**4
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_unused_parameter_is_left_alone_like_pytorch():
    """A parameter with no gradient is skipped (no weight decay, no Adam state), as PyTorch does."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    before = model["unused"].weight.detach().clone()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5), model, stage=2)
    model["used"](torch.randn(2, 4)).sum().backward()
    opt.step()
    assert torch.equal(model["unused"].weight, before)
    with_state = {piece.slot.name for b in opt.buckets for piece in b.pieces if piece.tensor in opt.inner.state}
    assert with_state == {"used.weight", "used.bias"}


def test_stage2_releases_gradients_and_stage1_keeps_views():
    torch.manual_seed(0)
    for stage in (1, 2):
        model = GPT(CFG)
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
        x, y = synthetic_batch(0, 4, CFG)
        model.loss(x, y).backward()
        # p.grad is a guard: the reduced gradient is sharded (zero.runtime.buffers.sharded_grad)
        assert all(type(p.grad) is ShardedGrad for p in model.parameters())
        if stage == 2:
            assert all(not b.staging.is_allocated for b in opt.buckets)  # staging released
        else:  # autograd accumulated into the persistent gradient buckets in place, as with DDP
            assert all(b.grads.buffer.is_allocated for b in opt.buckets)
        opt.step()
        opt.zero_grad()
        expected = 0 if stage == 2 else 4 * opt.partition.padded_numel  # stage 1 keeps its buckets
        assert opt.model_state_bytes().gradients == expected
