"""The optimizer shard's header (``zero.checkpoint.shard.header``): it records the wrapped optimizer's class and
pieces, and a shard from another class, or with edited state, is refused before anything is loaded.

World size 1, no process group. Until ``ZeroOptimizer._checkpoint_header`` passes
``optimizer=self._inner``, shards are built here from ``checkpoint.header`` directly; the one
test that goes through ``ZeroOptimizer.state_dict``/``load_state_dict`` is marked below.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from tests.toy import Stack
from zero import ZeroOptimizer
from zero.checkpoint.shard import header as checkpoint

STAGES = [0, 1, 2, 3]
SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2})


def build(stage: int, optimizer=ADAMW, one_group: bool = False) -> tuple[nn.Module, ZeroOptimizer]:
    """A seeded model and its ZeroOptimizer, with weights and biases in two param groups."""
    torch.manual_seed(0)
    model = Stack()
    cls, kwargs = optimizer
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]}]
    groups.append({"params": [p for n, p in named if n.endswith("bias")], "lr": kwargs["lr"] / 2})
    params = model.parameters() if one_group else groups
    return model, ZeroOptimizer(cls(params, **kwargs), model, stage=stage)


def train_step(model: nn.Module, opt: ZeroOptimizer, seed: int = 1) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def here(opt: ZeroOptimizer) -> dict:
    """The header ``ZeroOptimizer._checkpoint_header`` gives once it passes ``optimizer=self._inner``."""
    return checkpoint.header(
        stage=opt.config.stage, world_size=opt.comm.world_size, rank=opt.comm.rank, partition=opt.partition,
        optimizer=opt.inner,
    )


def shard(opt: ZeroOptimizer) -> dict:
    """What ``ZeroOptimizer.state_dict()`` returns (a deep copy, free to edit)."""
    return copy.deepcopy({**here(opt), "optimizer": opt.inner.state_dict()})


def trained(stage: int, optimizer=ADAMW) -> tuple[nn.Module, ZeroOptimizer, dict]:
    model, opt = build(stage, optimizer)
    train_step(model, opt)
    return model, opt, shard(opt)


def refused(saved: dict, opt: ZeroOptimizer, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        checkpoint.check_loadable(saved, here(opt))


# ----- the header -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_header_records_the_class_and_each_groups_pieces_in_optimizer_order(stage):
    _, opt = build(stage)
    inner = here(opt)["inner"]
    assert inner["class"] == "torch.optim.adamw.AdamW"
    assert [[name for name, _, _ in group] for group in inner["pieces"]] == [
        ["layers.1.weight", "layers.0.weight"],  # packed in reverse registration order
        ["layers.1.bias", "layers.0.bias"],
    ]
    for records, group in zip(inner["pieces"], opt.inner.param_groups):
        assert [numel for _, _, numel in records] == [t.numel() for t in group["params"]]
        assert all(start == 0 for _, start, _ in records)  # world size 1: one whole piece per parameter


def test_header_refuses_the_optimizer_before_it_is_rebuilt():
    model = Stack()
    user_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ZeroOptimizer(user_optimizer, model, stage=1)
    with pytest.raises(ValueError, match=r"not one of this rank's pieces.*ZeroOptimizer.inner"):
        checkpoint.header(stage=1, world_size=1, rank=0, partition=opt.partition, optimizer=user_optimizer)


# ----- loading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer", [ADAMW, SGD_MOMENTUM], ids=["AdamW", "SGD"])
def test_same_class_round_trips_through_torch_save(stage, optimizer):
    model, opt, saved = trained(stage, optimizer)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh_model, fresh = build(stage, optimizer)
    checkpoint.check_loadable(saved, here(fresh))
    fresh.inner.load_state_dict(saved["optimizer"])
    with torch.no_grad():  # the parameters travel with the model's state dict, not the optimizer's
        for a, b in zip(fresh.inner.param_groups, opt.inner.param_groups):
            for x, y in zip(a["params"], b["params"]):
                x.copy_(y)
    for a, b in zip(fresh.inner.state.values(), opt.inner.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    train_step(model, opt, seed=2)
    train_step(fresh_model, fresh, seed=2)
    for x, y in zip(fresh.inner.param_groups[0]["params"], opt.inner.param_groups[0]["params"]):
        assert torch.equal(x, y)  # resuming continues exactly


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("saved_with,loaded_with", [(SGD_MOMENTUM, ADAMW), (ADAMW, SGD_MOMENTUM)])
def test_another_optimizer_class_is_refused_naming_both(stage, saved_with, loaded_with):
    _, _, saved = trained(stage, saved_with)
    _, other = build(stage, loaded_with)
    a, b = saved_with[0].__name__, loaded_with[0].__name__
    refused(saved, other, rf"state of a torch\.optim\.\w+\.{a} but this ZeroOptimizer wraps a torch\.optim\.\w+\.{b}")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer,key", [(ADAMW, "exp_avg_sq"), (SGD_MOMENTUM, "momentum_buffer")])
def test_truncated_state_tensor_is_refused_naming_the_parameter(stage, optimizer, key):
    _, opt, saved = trained(stage, optimizer)
    group = saved["optimizer"]["param_groups"][1]  # the biases
    index = group["params"][0]
    state = saved["optimizer"]["state"][index]
    state[key] = state[key][:-1]
    name = here(opt)["inner"]["pieces"][1][0][0]
    assert name == "layers.1.bias"
    refused(saved, opt,
            rf"'{key}' of parameter 'layers\.1\.bias' \(elements 0:2, tensor index {index}\) has shape \(1,\)")


def test_reshaped_state_tensor_is_refused_but_scalar_state_is_fine():
    _, opt, saved = trained(2)
    state = saved["optimizer"]["state"][0]
    assert state["step"].dim() == 0  # AdamW's step: 0-dim, accepted as is
    checkpoint.check_loadable(saved, here(opt))
    state["exp_avg"] = state["exp_avg"].reshape(2, -1)
    refused(saved, opt, r"'exp_avg' of parameter 'layers\.1\.weight'.*has shape \(2, 8\)")


@pytest.mark.parametrize("stage", STAGES)
def test_state_for_a_nonexistent_index_is_refused(stage):
    _, opt, saved = trained(stage)
    saved["optimizer"]["state"][99] = copy.deepcopy(saved["optimizer"]["state"][0])
    refused(saved, opt, r"tensor index 99, which no param group lists \(this rank's optimizer steps 4 tensors\)")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda sd: sd["optimizer"]["param_groups"].append(copy.deepcopy(sd["optimizer"]["param_groups"][0])),
         "optimizer state has 3 param groups but the wrapped optimizer has 2"),
        (lambda sd: sd["optimizer"]["param_groups"][0]["params"].pop(),
         r"param group 0 of this shard's optimizer state lists 1 tensors but this rank's optimizer steps 2"),
        (lambda sd: sd["optimizer"]["param_groups"][1]["params"].__setitem__(0, 0), "repeated tensor index 0"),
        (lambda sd: sd["optimizer"].pop("state"), "not a torch.optim state dict"),
        (lambda sd: sd["inner"]["pieces"][0].pop(), r"param group 0 held the pieces \[layers\.1\.weight\[0:16\]\]"),
        (lambda sd: sd["inner"].update({"pieces": sd["inner"]["pieces"][:1]}), "saved with 1 param groups"),
        (lambda sd: sd.update(format="zero.shard/1"), r"old format 'zero\.shard/1'.*cannot be checked"),
        (lambda sd: sd.update(format="zero.shard/9"), "cannot read"),
        (lambda sd: sd.update(format="other"), "not a ZeroOptimizer state dict"),
        (lambda sd: sd.pop("inner"), r"lacks \['inner'\]"),
        (lambda sd: sd["inner"].pop("class"), "damaged"),
    ],
)
def test_edited_shard_is_refused(edit, match):
    _, opt, saved = trained(2)
    edit(saved)
    refused(saved, opt, match)


def test_other_param_groups_are_refused():
    _, _, saved = trained(1)
    _, one_group = build(1, one_group=True)
    refused(saved, one_group, "saved with 2 param groups but the wrapped optimizer has 1")


# ----- end to end: through ZeroOptimizer.state_dict() and load_state_dict() ---------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_end_to_end_through_zero_optimizer_state_dict(stage):
    """The header ``opt.state_dict()`` writes names the wrapped class; a fresh optimizer loads it, one wrapping
    another class or given edited state refuses it before loading anything."""
    model, opt = build(stage)
    train_step(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["format"] == "zero.shard/2" and saved["inner"]["class"] == "torch.optim.adamw.AdamW"
    _, fresh = build(stage)
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    _, sgd = build(stage, SGD_MOMENTUM)
    with pytest.raises(ValueError, match=r"SGD but this ZeroOptimizer wraps a torch\.optim\.adamw\.AdamW"):
        fresh.load_state_dict(copy.deepcopy(sgd.state_dict()))
    before = copy.deepcopy(fresh.inner.state_dict())
    saved["optimizer"]["state"][0]["exp_avg"] = saved["optimizer"]["state"][0]["exp_avg"][:3]
    with pytest.raises(ValueError, match="'exp_avg' of parameter 'layers.1.weight'"):
        fresh.load_state_dict(saved)
    after = fresh.inner.state_dict()  # refused before anything was loaded
    assert all(torch.equal(after["state"][i]["exp_avg"], before["state"][i]["exp_avg"]) for i in before["state"])
