"""The calls users make around the optimizer (world size 1, no process group): each exact or a loud error.

``model.zero_grad()`` (Hugging Face Trainer), ``torch.nn.utils.clip_grad_norm_``, ``p.grad`` edits,
``model.to()`` after wrapping. The multi-rank versions run in ``tests/distributed`` (scenarios
``zero_grad_paths`` and ``passes3``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from tests.readouts import flat_params
from tests.toy import CheckpointedNet, Net, batch
from zero import ZeroOptimizer

STAGES = (0, 1, 2, 3)

def run(stage: int | None, clear, steps: int = 6, passes: int = 1) -> torch.Tensor:
    """Train with SGD (momentum, weight decay); ``clear(model, opt, step)`` after each step."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if stage is not None:
        opt = ZeroOptimizer(opt, model, stage=stage)
    for step in range(steps):
        for _ in range(passes):
            (model(batch(step), use_aux=step % 2 == 1) / passes).backward()
        opt.step()
        clear(model, opt, step)
    return flat_params(model, opt)


def clear_like_trainer(model, opt, step):
    model.zero_grad()


def clear_in_turn(model, opt, step):
    if step % 3 == 0:
        model.zero_grad()
    elif step % 3 == 1:
        model.zero_grad(set_to_none=False)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("clear", [clear_like_trainer, clear_in_turn], ids=["model_zero_grad", "in_turn"])
def test_model_zero_grad_is_opt_zero_grad(stage, clear):
    """model.zero_grad() (both modes) and skipping it altogether train as plain PyTorch does."""
    expected = run(None, clear)
    got = run(stage, clear)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_several_backward_passes_before_step(stage):
    expected = run(None, lambda m, o, s: o.zero_grad(), passes=3)
    torch.testing.assert_close(run(stage, lambda m, o, s: o.zero_grad(), passes=3), expected, rtol=0, atol=1e-6)


def wrapped(stage: int):
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
    model(batch(0)).backward()
    return model, opt


def test_torch_clip_grad_norm_is_exact_at_stage_0():
    model, opt = wrapped(0)
    plain = Net()
    plain(batch(0)).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01) == expected
    for p, q in zip(model.parameters(), plain.parameters()):
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_clip_grad_norm_fails_loudly_when_gradients_are_sharded(stage):
    model, opt = wrapped(stage)
    with pytest.raises(RuntimeError, match=r"sharded across ranks.*opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="sharded across ranks"):
        model.head.weight.grad.sum()
    assert opt.clip_grad_norm_(1.0) > 0  # the supported path still works
    opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replacing_a_sharded_gradient_is_refused(stage):
    model, opt = wrapped(stage)
    model.head.bias.grad = torch.zeros(model.head.bias.shape)
    with pytest.raises(ValueError, match=r"p.grad of 'head.bias' was replaced"):
        opt.step()


def test_replacing_a_gradient_at_stage_0_is_used():
    model, opt = wrapped(0)
    plain = Net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(batch(0)).backward()
    for m in (model, plain):
        m.head.weight.grad = m.head.weight.grad * 3
    opt.step()
    plain_opt.step()
    assert torch.equal(flat_params(model, opt), flat_params(plain, plain_opt))


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_cast_after_wrapping_fails_before_a_gradient_is_used(stage, cast):
    """Stages 0-2: the next backward pass (before autograd accumulates anything) or step() refuses."""
    model, opt = wrapped(stage)
    opt.step()
    opt.zero_grad()
    getattr(model, cast)()
    x = batch(1).to(getattr(torch, "float64" if cast == "double" else cast))
    message = r"changed dtype or device after ZeroOptimizer wrapped the model"
    with pytest.raises(ValueError, match=message):
        model.blocks[0](x).sum().backward()  # (through a child module too)
    with pytest.raises(ValueError, match=message):
        opt.step()


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_replaced_after_wrapping_are_refused(stage):
    model, opt = wrapped(stage)
    opt.step()
    fresh = Net()
    model.load_state_dict(fresh.state_dict(), assign=True)  # new Parameter objects
    model(batch(1)).backward()
    with pytest.raises(ValueError, match=r"'(\w|\.)+' is no longer the one ZeroOptimizer manages"):
        opt.step()


@pytest.mark.parametrize("with_grads", [False, True])
def test_cast_after_wrapping_fails_at_once_at_stage_3(with_grads):
    model, opt = wrapped(3)
    if not with_grads:
        opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"changed dtype or device after ZeroOptimizer wrapped the model"):
        model.double()


@pytest.mark.parametrize("stage", STAGES)
def test_model_to_its_own_device_is_harmless(stage):
    expected = run(stage, lambda m, o, s: o.zero_grad())

    def clear_and_move(model, opt, step):
        model.to("cpu")  # with gradients (guards at stages 1-3) still in p.grad
        opt.zero_grad()
        model.float()

    torch.testing.assert_close(run(stage, clear_and_move), expected, rtol=0, atol=0)


def test_gathered_parameters_with_a_frozen_parameter_outside_the_optimizer():
    model = Net()
    model.blocks[0].requires_grad_(False)
    opt = ZeroOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), model, stage=3)
    with opt.gathered_parameters(model):
        assert torch.isfinite(model.blocks[0].weight).all()
    assert opt.partition.frozen_numel == sum(p.numel() for p in model.blocks[0].parameters())


@pytest.mark.parametrize("stage", STAGES)
def test_two_optimizers_over_one_parameter_are_refused(stage):
    """The second is refused before it touches the parameters: the first still trains as plain PyTorch does."""
    model = Net()
    first = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
    with pytest.raises(ValueError, match=r"'head\.(weight|bias)' is already managed by another ZeroOptimizer"):
        ZeroOptimizer(torch.optim.SGD(model.head.parameters(), lr=0.1), model, stage=stage)
    plain = Net()
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    for m, o in ((model, first), (plain, reference)):
        m(batch(0)).backward()
        o.step()
        o.zero_grad()
    torch.testing.assert_close(flat_params(model, first), flat_params(plain), rtol=0, atol=0)
    if stage < 3:  # once the first is dropped, the model can be wrapped again (stage 3 keeps it sharded)
        del first
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_model_and_optimizer_are_freed_without_the_garbage_collector(stage):
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch's first optimizer leaves a frame cycle
    gc.collect()
    gc.disable()
    try:
        model = Net()
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
        model(batch(0)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        refs = [weakref.ref(model), weakref.ref(opt)] + [weakref.ref(p) for p in model.parameters()]
        del model, opt
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def _compiled_run(how: str) -> tuple[list[float], torch.Tensor]:
    torch._dynamo.reset()
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, stage=3)
    forward = model
    if how == "model":
        forward = torch.compile(model, backend="aot_eager")
    elif how == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    losses = []
    for step in range(3):
        loss = forward(batch(step), use_aux=step % 2 == 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, flat_params(model, opt)


@pytest.mark.parametrize("how", ["model", "blocks"])
def test_torch_compile_at_stage_3(how):
    """Whole-model and per-unit compile: the gathering hooks run eagerly (graph breaks), the units'
    forwards compile; training matches the eager run."""
    expected_losses, expected = _compiled_run("eager")
    losses, got = _compiled_run(how)
    torch._dynamo.reset()  # (compiled code holds tensors that later tests would count as live)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


# ----- reviewed corner cases: each equal to plain PyTorch doing the same, or a clear error ----------------


def train_like(stage, build, body, steps=4):
    """``body(model, opt, step)`` does a step's backward passes; then step() and zero_grad() as usual."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    if stage is not None:
        opt = ZeroOptimizer(opt, model, stage=stage)
    for step in range(steps):
        body(model, opt, step)
        opt.step()
        opt.zero_grad()
    return flat_params(model, opt)


def same_as_pytorch(stage, build, body):
    torch.testing.assert_close(train_like(stage, build, body), train_like(None, build, body), rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing(stage, reentrant):
    same_as_pytorch(stage, lambda: CheckpointedNet(reentrant), lambda m, o, s: m(batch(s), s % 2 == 1).backward())


@pytest.mark.parametrize("stage", STAGES)
def test_reentrant_checkpointing_around_the_first_gradients(stage):
    """The first gradients come from inside a reentrant checkpoint (a nested backward that ends first): the pass
    ends with the outer one (PEFT's prepare_model_for_kbit_training checkpoints so under a frozen head)."""
    same_as_pytorch(stage, lambda: CheckpointedNet(True, first_grad_inside=True),
                    lambda m, o, s: m(batch(s), s % 2 == 1).backward())


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("build", [lambda: CheckpointedNet(reentrant=False),
                                   lambda: CheckpointedNet(reentrant=True, first_grad_inside=True)],
                         ids=["non_reentrant", "reentrant_first_grads_inside"])
def test_an_error_inside_backward_then_zero_grad_and_retry(stage, build):
    """(With the first gradients inside reentrant checkpointing, the error comes after that nested pass ended.)"""

    def body(model, opt, step):
        if step == 1:
            with pytest.raises(RuntimeError, match="boom"):
                model(batch(step), boom=True).backward()
            if isinstance(opt, ZeroOptimizer):  # incomplete gradients are refused until cleared
                with pytest.raises(ValueError, match="last backward pass failed"):
                    opt.step()
                model.zero_grad(set_to_none=False)
                with pytest.raises(ValueError, match="last backward pass failed"):
                    model(batch(step)).backward()
            opt.zero_grad()
        model(batch(step), s % 2 == 1 if (s := step) else False).backward()

    same_as_pytorch(stage, build, body)


def test_a_gradient_given_to_an_unused_parameter_at_stage_0():
    def body(model, opt, step):
        model(batch(step)).backward()  # aux unused: no gradient
        assert model.aux.weight.grad is None
        model.aux.weight.grad = torch.full_like(model.aux.weight, 0.5)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.add_(0.01)

    same_as_pytorch(0, Net, body)


@pytest.mark.parametrize("stage", STAGES)
def test_model_zero_grad_then_opt_zero_grad_keeping_zeros(stage):
    def body(model, opt, step):
        model(batch(step), step % 2 == 0).backward()
        if step == 1:
            model.zero_grad()
            opt.zero_grad(set_to_none=False)  # nothing to keep: no parameter has a gradient
            model(batch(step)).backward()

    same_as_pytorch(stage, Net, body)


def halve(param: torch.Tensor) -> None:
    param.grad.mul_(0.5)


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_hook_registered_after_wrapping_sees_the_gradient_first(stage):
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
    model.head.weight.register_post_accumulate_grad_hook(halve)  # runs after ZeroOptimizer's own hook
    plain = Net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain.head.weight.register_post_accumulate_grad_hook(halve)
    for step in range(3):
        for m, o in ((model, opt), (plain, plain_opt)):
            m(batch(step)).backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(flat_params(model, opt), flat_params(plain, plain_opt), rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_foreach_zero_over_guards_and_local_gradients(stage):
    def body(model, opt, step):
        model(batch(step), use_aux=True).backward()
        with opt.no_sync() if isinstance(opt, ZeroOptimizer) else torch.no_grad():
            if isinstance(opt, ZeroOptimizer):
                model(batch(step + 10)).backward()  # aux keeps its guard, the others get local gradients
        if not isinstance(opt, ZeroOptimizer):
            model(batch(step + 10)).backward()
        torch._foreach_zero_([p.grad for p in model.parameters() if p.grad is not None])
        model(batch(step)).backward()

    same_as_pytorch(stage, Net, body)


def test_stage3_backward_with_inputs():
    def body(model, opt, step):
        model(batch(step)).backward(inputs=list(model.parameters()))

    same_as_pytorch(3, Net, body)


@pytest.mark.parametrize("stage", [0, 1, 2])  # (stage 3's parameters are placeholders: save a gathered state_dict)
def test_the_whole_model_pickles(stage, tmp_path):
    model, opt = wrapped(stage)
    opt.step()
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    plain = Net()
    plain(batch(0)).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert type(loaded) is Net
    torch.testing.assert_close(flat_params(loaded), flat_params(plain), rtol=0, atol=0)  # the stepped weights
    loaded(batch(1)).backward()  # a plain model again: its gradients are whole tensors, no stage's stand-ins
    used = [*loaded.blocks.parameters(), *loaded.head.parameters()]  # (aux: odd steps only)
    assert all(type(p.grad) is torch.Tensor and p.grad.shape == p.shape for p in used)


@pytest.mark.parametrize("variant", ["one_pass", "retained", "separate", "penalty_first"])
def test_stage3_root_parameters_used_after_forward(variant):
    """An L2 penalty on a root-unit parameter built after forward, backpropagated in one pass or in two
    (through a retained graph): the root unit stays gathered until step(), so no pass reads a placeholder."""

    def body(model, opt, step):
        out = model(batch(step))
        penalty = model.head.weight.square().sum() * 0.1
        if variant == "one_pass":
            (out + penalty).backward()
        elif variant == "retained":
            out.backward(retain_graph=True)
            (penalty + out * 0.5).backward()
        elif variant == "separate":
            out.backward()
            penalty.backward()
        else:
            penalty.backward()
            out.backward()

    same_as_pytorch(3, Net, body)
