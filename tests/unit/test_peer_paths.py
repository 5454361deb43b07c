"""Paths the peers' own test suites exercise (DeepSpeed ZeRO, FSDP2, torch's ZeroRedundancyOptimizer), in one
process: each was a failure on main once (issue 23)."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch

from tests.readouts import flat_params
from tests.toy import Net, batch
from zero import ZeroOptimizer
from zero.comm.handles import Handle

STAGES = (0, 1, 2, 3)


def _with_skipped_steps(stage: int | None, clear: str = "opt") -> tuple[torch.Tensor, list[float], list[float]]:
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
        model.zero_grad() if clear == "model" else opt.zero_grad()  # (the Trainer clears through the model)
        if step % 3 == 2:
            clip = opt.clip_grad_norm_ if stage is not None else torch.nn.utils.clip_grad_norm_
            norms.append(float(clip(1.0) if stage is not None else clip(model.parameters(), 1.0)))
        else:
            model(batch(step)).backward()
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return flat_params(model, opt), lrs, norms


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clear", ["opt", "model"])
def test_step_without_backward_updates_nothing_and_the_scheduler_goes_on(stage, clear):
    """Peers: torch ``test_zero_redundancy_optimizer.py::test_lr_scheduler``, DeepSpeed's zero_grad variants."""
    ref_params, ref_lrs, ref_norms = _with_skipped_steps(None, clear)
    params, lrs, norms = _with_skipped_steps(stage, clear)
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
    return flat_params(model, opt), losses


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


class DictBlocks(torch.nn.Module):
    """Blocks held as ``nn.ModuleDict``s in an ``nn.ModuleList``, their layers called from the parent's forward
    (DeepSpeed ``test_zero_user_backward.py``'s MultiBlockFrozenModel), half of them frozen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"linear": torch.nn.Linear(6, 6), "norm": torch.nn.LayerNorm(6)}) for _ in range(4)
        )
        for block in self.blocks[::2]:
            block.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block["norm"](block["linear"](x)))
        return x.square().mean()


def _train_dict_blocks(**zero_config) -> torch.Tensor:
    model = DictBlocks()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if zero_config:
        opt = ZeroOptimizer(opt, model, **zero_config)
    for step in range(4):
        model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model, opt)


@pytest.mark.parametrize("plan", [{}, {"unit_size_mb": 1e-4}], ids=["default", "by_size"])
def test_stage3_units_are_modules_that_run_forward(plan):
    reference = _train_dict_blocks()
    assert torch.equal(_train_dict_blocks(stage=3, **plan), reference)


class Layers(torch.nn.ModuleDict):
    """A container of the user's own, with no forward."""


def test_a_container_named_as_a_unit_class_is_refused():
    model = DictBlocks()
    model.blocks[1] = Layers(dict(model.blocks[1].items()))
    with pytest.raises(ValueError,
                       match=r"names Layers, a container without a forward .* Name the class of the layers"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, unit_classes=["Layers"])


TRANSFORMS = {
    "grad": lambda model, x: torch.func.grad(lambda x: model(x))(x),
    "grad_and_value": lambda model, x: torch.func.grad_and_value(lambda x: model(x))(x)[0],
    "jacrev": lambda model, x: torch.func.jacrev(lambda x: model(x))(x),
    "vmap_grad": lambda model, x: torch.func.vmap(torch.func.grad(lambda row: model(row.unsqueeze(0))))(x),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_torch_func_through_the_model(transform):
    """Peer: DeepSpeed ``test_zero_torch_func.py``. Stages 0-2 equal plain torch; stage 3 refuses with the way out."""
    model = Net()
    x = batch(0)
    reference = TRANSFORMS[transform](model, x)
    for stage in (0, 1, 2):
        model = Net()
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
        assert torch.equal(TRANSFORMS[transform](model, x), reference)
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)  # noqa: F841 (kept alive)
    with pytest.raises(RuntimeError, match=r"torch.func transform .* Use stage 0, 1 or 2 .*gathered_parameters"):
        TRANSFORMS[transform](model, x)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_micro_batches_accumulate_in_the_fp32_reduce_dtype(stage):
    """Peer: FSDP2 ``test_grad_acc_with_reduce_dtype``: under no_sync() the bf16 gradients of each micro-batch
    are added in fp32 (the reduce dtype), not in bf16 (5e-3 off after 4 micro-batches)."""
    model = Net().to(torch.bfloat16)
    plain = Net().to(torch.bfloat16)
    expected = [torch.zeros(p.shape) for p in plain.parameters()]
    for step in range(4):
        grads = torch.autograd.grad(plain(batch(step).bfloat16(), use_aux=True), list(plain.parameters()))
        for total, grad in zip(expected, grads):
            total += grad.float()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage,
                        precision={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    for step in range(4):
        with opt.no_sync() if step < 3 else torch.enable_grad():
            model(batch(step), use_aux=True).backward()
    got = torch.cat([g.flatten() for g in opt.runtime.master_grads()])
    assert torch.allclose(got, torch.cat([t.flatten() for t in expected]), rtol=1e-6, atol=1e-7)


class ExternalInputs(torch.nn.Module):
    """Each block gets, besides the hidden state, a tensor its parent makes in fp32 inside forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Mix() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.linspace(-0.1, 0.1, x.shape[-1])  # fp32, whatever the model's dtype
        for block in self.blocks:
            x = block(x, bias)
        return x.float().square().mean()


class Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) + bias)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_casts_the_inputs_of_every_unit(stage, checkpointing):
    """Peers: FSDP2 ``test_submodules_with_external_inputs``, ``test_checkpoint_recompute_casts_forward_inputs``."""
    reference = ExternalInputs()
    model = ExternalInputs()
    policy = {"activation_checkpointing": {}} if checkpointing else {}
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage,
                        precision={"param_dtype": "bf16"}, **policy)
    for step in range(3):
        loss = model(batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(batch(step))
        ref_loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())


def _rewrapped(first: int | None, second: int | None, close: bool) -> torch.Tensor:
    """Two steps under one optimizer, then the optimizer is closed or dropped and a new one (fresh state)
    trains two more steps; ``None`` is plain torch."""
    model = Net()
    for stage in (first, second):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if stage is not None:
            opt = ZeroOptimizer(opt, model, stage=stage)
        for step in range(2):
            model(batch(step)).backward()
            opt.step()
            opt.zero_grad()
        if close and stage is not None:
            opt.close()
        del opt
    return flat_params(model)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("close", [True, False], ids=["close", "del"])
def test_a_model_is_given_back_whole_and_can_be_wrapped_again(stage, close):
    """Peer: DeepSpeed ``test_zero_optimizer.py::test_load_immediate_save`` (a model wrapped a second time)."""
    reference = _rewrapped(None, None, close)
    for second in (None, stage, 3 if stage != 3 else 0):
        assert torch.equal(_rewrapped(stage, second, close), reference), second


def test_a_stage3_optimizer_dropped_in_the_middle_of_a_step_gives_the_model_back_whole():
    """Dropped after a forward, with the root unit still gathered (it is kept until the step): the model is given
    back whole (world of one) with the values of its shards, and trains plainly afterwards."""
    model, reference = Net(), Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
    loss = model(batch(0))
    del opt, loss
    gc.collect()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    model(batch(1)).backward()
    assert all(p.grad is not None for p in model.blocks.parameters())


@pytest.mark.parametrize("stage", STAGES)
def test_close_removes_every_hook_and_refuses_further_use(stage):
    model = Net()
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage,
                        precision={"param_dtype": "bf16"})
    model(batch(0)).backward()
    opt.step()
    opt.close()
    assert hooks() == before
    assert all(type(p) is torch.nn.Parameter and p.grad is None or stage == 0 for p in model.parameters())
    model(batch(1).bfloat16()).backward()  # plain autograd on the bf16 model now: no hook of ours runs
    assert all(p.grad is not None for p in model.blocks.parameters())
    for use in (opt.step, opt.zero_grad, lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(ValueError, match="was closed"):
            use()


def test_a_second_optimizer_over_parameters_of_a_live_one_is_refused_at_stage_3():
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)  # noqa: F841 (alive)
    with pytest.raises(ValueError, match="already managed by another ZeroOptimizer"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
