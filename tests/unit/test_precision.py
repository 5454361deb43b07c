"""Mixed precision at world size 1: every stage against a hand-built single-process reference.

The reference is the recipe FSDP2's own mixed-precision tests use: a low-precision copy of the
model for forward and backward, its gradients cast to fp32 onto an fp32 master copy, the same
``torch.optim`` optimizer stepping the master, and the master cast back into the copy. At one
rank ZeroOptimizer must match it bit for bit (the multi-rank comparison is in
``tests/distributed/precision_world.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.readouts import flat_params, master_weights
from tests.recipes import MasterRecipe, grad_scaler_run
from tests.toy import Net, batch
from zero import MixedPrecision, ZeroConfig, ZeroOptimizer, init_sharded
from zero.models import GPT, GPTConfig, init_gpt_weights
from zero.runtime.precision.parameters import check_device_supports

STAGES = (0, 1, 2, 3)
STEPS = 5


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference(dtype: torch.dtype, clip: float | None = None, steps: int = STEPS, model: nn.Module | None = None):
    """The hand-built recipe: returns the fp32 master weights after ``steps`` steps."""
    r = MasterRecipe(model or Net(), dtype, _adamw)
    for step in range(steps):
        r.low(batch(step).to(dtype), step % 2 == 1).backward()
        r.grads_to_master()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(r.master, clip)
        r.step()
    return r.flat()


def train(stage: int, precision: dict, clip: float | None = None,
          steps: int = STEPS) -> tuple[nn.Module, ZeroOptimizer]:
    model = Net()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=precision, bucket_size_mb=1e-4)
    for step in range(steps):
        opt.backward(model(batch(step), step % 2 == 1))  # fp32 input: cast by cast_forward_inputs
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("reduce_dtype", [None, "bf16"], ids=["reduce_fp32", "reduce_bf16"])
@pytest.mark.parametrize("clip", [None, 0.1], ids=["noclip", "clip"])
def test_bf16_is_bit_identical_to_the_hand_built_recipe(stage, reduce_dtype, clip):
    expected = reference(torch.bfloat16, clip)
    assert (expected - flat_params(Net())).abs().max() > 1e-2  # it trains
    model, opt = train(stage, {"param_dtype": "bf16", "reduce_dtype": reduce_dtype}, clip)
    assert torch.equal(master_weights(opt), expected)
    with opt.gathered_parameters():
        for p in model.parameters():
            assert p.dtype == torch.bfloat16
        whole = flat_params(model)
    assert torch.equal(whole, expected.to(torch.bfloat16))  # the parameters are the master cast down


@pytest.mark.parametrize("stage", STAGES)
def test_autocast_with_fp32_parameters_is_exact(stage):
    """The mode users bring from DDP: fp32 parameters, forward under torch.autocast."""

    def run(zero_stage):
        model = Net()
        opt = _adamw(model.parameters())
        if zero_stage is not None:
            opt = ZeroOptimizer(opt, model, stage=zero_stage, bucket_size_mb=1e-4)
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch(step), step % 2 == 1)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    assert torch.equal(run(stage), run(None))


@pytest.mark.parametrize("stage", STAGES)
def test_a_bf16_model_trains_as_plain_pytorch_without_a_policy_and_gets_masters_with_one(stage):
    """Decided: without param_dtype a model built in bf16 trains in pure bf16, as plain PyTorch does;
    with param_dtype='bf16' it gets fp32 master weights made from its bf16 values."""
    plain = Net().bfloat16()
    opt = _adamw(plain.parameters())
    for step in range(3):
        plain(batch(step).bfloat16()).backward()
        opt.step()
        opt.zero_grad()
    model = Net().bfloat16()
    zopt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage)
    for step in range(3):
        model(batch(step).bfloat16()).backward()
        zopt.step()
        zopt.zero_grad()
    with zopt.gathered_parameters():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert all("master" not in b.buffers for b in zopt.buckets)

    bf16_model = Net().bfloat16()
    expected = reference(torch.bfloat16, steps=3, model=bf16_model)  # masters start from the bf16 values
    model = Net().bfloat16()
    zopt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision={"param_dtype": "bf16"})
    for step in range(3):
        zopt.backward(model(batch(step), step % 2 == 1))
        zopt.step()
        zopt.zero_grad()
    assert all(b.buffers["master"].dtype == torch.float32 for b in zopt.partition.trainable_buckets)
    assert torch.equal(master_weights(zopt), expected)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_loss_scaling_skips_and_scales_like_grad_scaler(stage):
    """Overflows injected on chosen steps (the loss times 1e30): the same skipped steps, the same scale
    sequence and the same weights as GradScaler on the hand-built fp16 recipe."""
    policy = {"param_dtype": "fp16", "loss_scale": {"init_scale": 2.0**10, "growth_interval": 2}}
    overflow_steps = {1, 4, 5}
    steps = 9

    def loss_of(model, step, dtype):
        loss = model(batch(step).to(dtype), step % 2 == 1)
        return loss * 1e30 if step in overflow_steps else loss  # inf in fp16

    ref = grad_scaler_run(Net(), _adamw, lambda low, step: loss_of(low, step, torch.float16), steps,
                          init_scale=2.0**10, growth_interval=2)
    ref_scales, ref_skipped = ref["scales"], ref["skipped"]
    assert ref_skipped == [s in overflow_steps for s in range(steps)]
    assert len(set(ref_scales)) > 2  # it backed off and grew

    model = Net()
    zopt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=policy, bucket_size_mb=1e-4)
    scales, skipped = [], []
    for step in range(steps):
        zopt.backward(loss_of(model, step, torch.float32))
        before = master_weights(zopt).clone()
        zopt.step()
        skipped.append(torch.equal(before, master_weights(zopt)))
        scales.append(zopt.loss_scaler.scale)
        zopt.zero_grad()
    assert skipped == ref_skipped
    assert scales == ref_scales
    assert torch.equal(master_weights(zopt), ref["masters"])


def test_fp16_refuses_an_unscaled_backward_and_a_collapsed_scale():
    model = Net()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=2, precision={"param_dtype": "fp16"})
    with pytest.raises(ValueError, match="opt.backward"):
        model(batch(0)).backward()
    opt.zero_grad()
    opt.backward(model(batch(0)))
    opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="after clip_grad_norm_"):
        opt.backward(model(batch(1)))
    opt.zero_grad()

    model = Net()
    policy = {"param_dtype": "fp16", "loss_scale": {"init_scale": 4.0, "min_scale": 1.0}}
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=1, precision=policy)
    with pytest.raises(RuntimeError, match="loss scale collapsed"):
        for _ in range(4):  # 4 -> 2 -> 1 -> below the minimum
            opt.backward(model(batch(0)) * float("inf"))
            opt.step()
            opt.zero_grad()
    assert opt.loss_scaler.scale == 1.0


@pytest.mark.parametrize("stage", STAGES)
def test_edits_after_wrapping_reach_the_master_weights(stage):
    """``model.load_state_dict()`` or an in-place edit after wrapping: the next step starts from the new
    values (the master is not allowed to overwrite them), and untouched elements keep full precision."""
    model = Net()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, stage=stage,
                        precision={"param_dtype": "bf16"})
    before = master_weights(opt).clone()
    with opt.gathered_parameters(), torch.no_grad():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    state["head.weight"].fill_(0.5)
    with opt.gathered_parameters():
        model.load_state_dict(state)
    opt.backward(model(batch(0)))
    opt.step()
    with opt.gathered_parameters():
        assert torch.equal(model.head.weight, torch.full_like(model.head.weight, 0.5))
    after = master_weights(opt)
    changed = (after != before).nonzero().flatten()
    assert changed.numel() == model.head.weight.numel()  # only the edited elements; the rest kept fp32
    assert (after[changed] == 0.5).all()


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_carries_master_weights_and_loss_scale(stage):
    policy = {"param_dtype": "fp16", "loss_scale": {"init_scale": 2.0**8, "growth_interval": 1}}

    def fresh():
        model = Net()
        return model, ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=policy)

    def run(model, opt, steps):
        for step in steps:
            opt.backward(model(batch(step), step % 2 == 1))
            opt.step()
            opt.zero_grad()

    model, opt = fresh()
    run(model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())
    assert saved["loss_scale"]["scale"] == 2.0**11 and len(saved["master"]) > 0
    run(model, opt, range(3, 6))
    model2, opt2 = fresh()
    opt2.load_state_dict(saved)  # no model state needed: the parameters are the master cast down
    run(model2, opt2, range(3, 6))
    assert torch.equal(master_weights(opt2), master_weights(opt))
    assert opt2.loss_scaler.scale == opt.loss_scaler.scale

    model3 = Net()
    full = ZeroOptimizer(_adamw(model3.parameters()), model3, stage=stage)
    with pytest.raises(ValueError, match="precision"):
        full.load_state_dict(saved)


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_keep_their_dtype_and_norms_with_statistics_stay_full(stage):
    """BatchNorm's running statistics stay fp32, and so do its weight and bias (kernels take bf16 inputs
    with fp32 weights and statistics, as under autocast); every other parameter computes in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.ModuleList([nn.Linear(6, 1)]))
    model.forward = lambda x: model[3][0](model[2](model[1](model[0](x)))).square().mean()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision={"param_dtype": "bf16"})
    for step in range(2):
        opt.backward(model(batch(step)))
        opt.step()
        opt.zero_grad()
    assert model[1].running_mean.dtype == torch.float32
    assert model[1].num_batches_tracked.item() == 2
    with opt.gathered_parameters():
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("stage", STAGES)
def test_cast_forward_inputs_can_be_turned_off(stage):
    model = Net()
    policy = {"param_dtype": "bf16", "cast_forward_inputs": False}
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=policy)
    opt.backward(model(batch(0).bfloat16()))
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"module 'blocks.0' \(Linear\) computes in torch.bfloat16 .* received a "
                                         r"torch.float32 tensor, and precision.cast_forward_inputs=False"):
        model(batch(1))  # fp32 input, bf16 weights: refused where it enters, naming the setting


def test_policy_errors_name_the_field():
    with pytest.raises(ValueError, match="reduce_dtype needs precision.param_dtype"):
        ZeroConfig(precision={"reduce_dtype": "bf16"})
    with pytest.raises(ValueError, match="reduce_dtype='fp16' cannot hold bf16"):
        ZeroConfig(precision={"param_dtype": "bf16", "reduce_dtype": "fp16"})
    for dtype in ("bf16", None):
        with pytest.raises(ValueError, match="loss_scale is for fp16"):
            ZeroConfig(precision={"param_dtype": dtype, "loss_scale": {}})
    with pytest.raises(ValueError, match="min_scale"):
        ZeroConfig(precision={"param_dtype": "fp16", "loss_scale": {"init_scale": 1.0, "min_scale": 2.0}})
    with pytest.raises(ValueError, match="param_dtype"):
        ZeroConfig(precision={"param_dtype": "fp8"})
    # every spelling of a dtype is the same policy
    for spelling in ("bf16", "bfloat16", torch.bfloat16, "torch.bfloat16"):
        assert ZeroConfig(precision={"param_dtype": spelling}).precision == MixedPrecision(param_dtype="bf16")
    assert ZeroConfig(precision={"param_dtype": "fp16"}).precision.scaling.init_scale == 2.0**16


def test_a_device_that_cannot_compute_in_the_dtype_is_refused():
    """The meta device computes nothing: the probe fails and the error names the field."""
    with pytest.raises(ValueError, match="param_dtype='bf16' cannot run on meta"):
        check_device_supports(MixedPrecision(param_dtype="bf16"), torch.device("meta"))
    check_device_supports(MixedPrecision(param_dtype="bf16"), torch.device("cpu"))


def test_full_precision_loss_scale_and_backward_are_plain():
    model = Net()
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=2)
    loss = model(batch(0))
    assert opt.scale_loss(loss) is loss and opt.loss_scaler is None
    opt.backward(loss)
    opt.step()


def test_meta_init_makes_fp32_masters_equal_to_a_normal_build():
    """Built on meta under bf16: each parameter is initialized in fp32 (its master), then cast."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
    torch.manual_seed(1234)
    normal = flat_params(GPT(cfg))
    torch.manual_seed(1234)
    model, opt = init_sharded(
        lambda: GPT(cfg), lambda m: _adamw(m.parameters()), init_fn=init_gpt_weights, precision={"param_dtype": "bf16"}
    )
    assert torch.equal(master_weights(opt), normal)
    assert torch.equal(flat_params(model, opt), normal.bfloat16())


@pytest.mark.parametrize("stage", STAGES)
def test_user_paths_under_bf16(stage):
    """Two backward passes per step without no_sync() and model.zero_grad() (Trainer's way): bit-identical
    to the recipe doing the same (with a bf16 reduction, gradients add in bf16 as p.grad does); torch's own
    clip and a cast after wrapping are loud errors."""
    r = MasterRecipe(Net(), torch.bfloat16, _adamw)
    for step in range(3):
        for half in (0, 1):
            (r.low(batch(10 * half + step).bfloat16(), step % 2 == 1) / 2).backward()
        r.grads_to_master()
        r.step()
    model = Net()
    policy = {"param_dtype": "bf16", "reduce_dtype": "bf16"}
    opt = ZeroOptimizer(_adamw(model.parameters()), model, stage=stage, precision=policy, bucket_size_mb=1e-4)
    for step in range(3):
        for half in (0, 1):
            opt.backward(model(batch(10 * half + step), step % 2 == 1) / 2)
        opt.step()
        model.zero_grad()
    assert torch.equal(master_weights(opt), r.flat())

    opt.backward(model(batch(0)))
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.zero_grad()
    with pytest.raises((RuntimeError, ValueError), match="after ZeroOptimizer wrapped|after wrapping"):
        model.float()  # refused at the call (stage 3) or as the next forward starts
        model(batch(0))
