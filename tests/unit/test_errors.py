"""Bad input fails at once with a message that names the cause and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from zero import ZeroConfig, ZeroOptimizer
from zero.runtime.buffers.layout import plan_buckets


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def wrap(model=None, cls=torch.optim.AdamW, **kwargs):
    model = model or small_model()
    return model, ZeroOptimizer(cls(model.parameters(), lr=1e-2), model, **kwargs)


def backward(model):
    model(torch.randn(3, 4)).square().mean().backward()


@pytest.mark.parametrize("stage", [-1, 4, 7])
def test_unknown_stage_names_the_allowed_values(stage):
    with pytest.raises(ValidationError, match=r"stage must be one of 0, 1, 2"):
        wrap(stage=stage)


@pytest.mark.parametrize("size", [0, -1.5])
def test_non_positive_bucket_size(size):
    with pytest.raises(ValidationError, match="bucket_size_mb"):
        wrap(bucket_size_mb=size)


def test_unknown_config_field_is_rejected():
    with pytest.raises(ValidationError, match="bucket_sise_mb"):
        ZeroConfig(bucket_sise_mb=3)


def test_config_from_json_and_yaml_files(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stage": 1, "bucket_size_mb": 4}))
    (tmp_path / "c.yaml").write_text("stage: 0\ntimeout_s: 30\n")
    assert ZeroConfig.from_file(tmp_path / "c.json").stage == 1
    assert ZeroConfig.from_file(tmp_path / "c.json", stage=2).stage == 2  # overrides win
    assert ZeroConfig.from_file(tmp_path / "c.yaml").timeout_s == 30
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ValueError, match="unknown config format"):
        ZeroConfig.from_file(tmp_path / "c.toml")


def test_config_object_and_overrides_combine():
    _, opt = wrap(config=ZeroConfig(stage=1, bucket_size_mb=1), bucket_size_mb=2)
    assert (opt.config.stage, opt.config.bucket_size_mb) == (1, 2)
    with pytest.raises(ValidationError):
        wrap(config=ZeroConfig(stage=1), bucket_size_mb=0)


def test_optimizer_with_parameters_outside_the_model():
    model, stray = small_model(), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(3,\).*not in the model"):
        ZeroOptimizer(opt, model)


def test_step_after_no_sync_only():
    model, opt = wrap()
    with opt.no_sync():
        backward(model)
    with pytest.raises(ValueError, match="inside no_sync"):
        opt.step()


def test_optimizers_that_cannot_step_one_parameter_at_a_time_are_refused_by_name():
    model = small_model()
    with pytest.raises(ValueError, match="LBFGS is not supported: its step re-evaluates the whole model"):
        ZeroOptimizer(torch.optim.LBFGS(model.parameters()), model)
    with pytest.raises(ValueError, match="SparseAdam is not supported: it steps sparse gradients"):
        ZeroOptimizer(torch.optim.SparseAdam(model.parameters()), model)
    with pytest.raises(ValueError, match="LBFGS is not supported"):  # in a list too
        ZeroOptimizer([torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.LBFGS(model[2].parameters())],
                      model)


def test_a_parameter_in_two_optimizers_is_refused_by_name():
    model = small_model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.AdamW([model[2].weight], lr=1e-3)
    with pytest.raises(ValueError, match=r"parameter '2.weight' is in two of the optimizers .*\(#0 and #1\)"):
        ZeroOptimizer([first, second], model)


def test_an_empty_list_of_optimizers_is_refused():
    with pytest.raises(ValueError, match="empty list of optimizers"):
        ZeroOptimizer([], small_model())


def test_a_list_entry_that_is_not_an_optimizer_is_refused():
    model = small_model()
    with pytest.raises(ValueError, match="wraps torch.optim.Optimizer instances, got list"):
        ZeroOptimizer([torch.optim.SGD(model.parameters(), lr=0.1), [model[0].weight]], model)


@pytest.mark.parametrize("offload,match", [
    ({"optimizer": "cpu", "delayed_step": True}, "offload.delayed_step steps a copy of one elementwise optimizer"),
    ({"optimizer": "disk"}, "offload to disk pages one elementwise optimizer"),
])
def test_offloads_that_step_one_elementwise_optimizer_refuse_several_or_a_whole_one(offload, match, tmp_path):
    offload = {**offload, "path": str(tmp_path)} if offload["optimizer"] == "disk" else offload
    model = small_model()
    several = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.AdamW(model[2].parameters(), lr=1e-3)]
    with pytest.raises(ValueError, match=match + r".*several optimizers \(SGD, AdamW\)"):
        ZeroOptimizer(several, model, stage=1, offload=offload)
    if getattr(torch.optim, "Adafactor", None) is not None:
        with pytest.raises(ValueError, match=match + r".*Adafactor, stepped on whole parameters"):
            ZeroOptimizer(torch.optim.Adafactor(model.parameters()), model, stage=1, offload=offload)


def test_optimizer_that_already_stepped_is_refused():
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    backward(model)
    opt.step()
    with pytest.raises(ValueError, match="already stepped"):
        ZeroOptimizer(opt, model)


def test_wrapping_twice_is_refused():
    model, opt = wrap()
    with pytest.raises(ValueError, match="already a ZeroOptimizer"):
        ZeroOptimizer(opt, model)


def test_no_trainable_parameters():
    model = small_model().requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_unfrozen_after_construction_is_reported():
    model = small_model()
    model[0].bias.requires_grad_(False)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model[0].bias.requires_grad_(True)
    backward(model)
    with pytest.raises(ValueError, match=r"'0.bias' was frozen"):
        opt.step()


def test_add_param_group_after_construction():
    _, opt = wrap()
    with pytest.raises(NotImplementedError, match="before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda sd: sd.update(world_size=4), r"world size 4.*zero.save_checkpoint\(\), which loads at any world size"),
        (lambda sd: sd.update(rank=1), "rank=1"),
        (lambda sd: sd.update(stage=1), "stage=1"),
        (lambda sd: sd.update(format="other"), "not a ZeroOptimizer state dict"),
        (lambda sd: sd["layout"]["params"].__setitem__(0, ("x", (9, 9), "torch.float32")), "does not match the model"),
    ],
)
def test_load_state_dict_mismatch(edit, match):
    model, opt = wrap(stage=2)
    backward(model)
    opt.step()
    sd = opt.state_dict()
    edit(sd)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)


def test_load_state_dict_from_a_different_model():
    model, opt = wrap()
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    _, other_opt = wrap(other)
    with pytest.raises(ValueError, match="does not match the model"):
        opt.load_state_dict(other_opt.state_dict())


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="bucket_cap"):
        plan_buckets([3], ["a"], 0, 2)
    with pytest.raises(ValueError, match="no elements"):
        plan_buckets([0], ["a"], 10, 2)
