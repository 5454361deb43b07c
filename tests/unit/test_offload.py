"""CPU offload at world size 1: the same numbers as without offload, host buffers named as such, and
clear errors for bad input (the multi-rank comparison is in ``tests/distributed/offload_world.py``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tests.readouts import flat_params
from tests.toy import Net, train_net
from zero import ZeroConfig, ZeroOptimizer
from zero.runtime.offload import host

pytestmark = pytest.mark.filterwarnings("ignore:offloaded AdamW")  # the hint tested at the end
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}, "fp16": {"param_dtype": "fp16"}}


def train(
    stage: int, offload: dict, precision: dict, steps: int = 4, **adamw
) -> tuple[torch.Tensor, ZeroOptimizer]:
    """AdamW with ``no_sync`` accumulation and clipping; the whole parameters (in fp32) afterwards."""
    model = Net()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, **adamw), model, stage=stage,
        offload=offload, precision=precision, bucket_size_mb=1e-4,
    )
    train_net(model, opt, steps)
    return flat_params(model, opt).float(), opt


CASES = [(s, "optimizer") for s in (1, 2, 3)] + [(3, "params")]


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_offload_changes_no_number(stage, what, precision):
    expected, _ = train(stage, {}, PRECISIONS[precision])
    got, opt = train(stage, {what: "cpu"}, PRECISIONS[precision])
    assert torch.equal(got, expected)
    labels = {item.label for b in opt.partition.trainable_buckets for _, item in b.roles()}
    assert "master weights (host)" in labels
    assert labels & {"master (host)", "shard (host)"}  # the optimizer's gradients are on the host
    params = {i.label for b in opt.partition.trainable_buckets for k, i in b.roles() if k == "parameters"}
    assert ("shard (host)" in params) == (what == "params")
    grads = {i.label for b in opt.partition.trainable_buckets for k, i in b.roles() if k == "gradients"}
    staged = stage >= 2 or precision != "fp32"  # mixed stage 1 reduces in fp32 apart from its bf16 buffer
    assert ("shard (host)" in grads) == staged  # a staged reduction's chunk goes straight to the host
    for state in opt.inner.state.values():  # the wrapped optimizer's state lives with the master weights
        assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))
    assert all("master" in b.buffers for b in opt.partition.trainable_buckets)


def test_offloaded_state_dict_round_trips():
    _, opt = train(2, {"optimizer": "cpu"}, PRECISIONS["bf16"], steps=2)
    saved = opt.state_dict()
    model = Net()
    other = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, stage=2,
        offload={"optimizer": "cpu"}, precision={"param_dtype": "bf16"}, bucket_size_mb=1e-4,
    )
    other.load_state_dict(saved)
    for a, b in zip(opt.buckets, other.buckets):
        assert torch.equal(a.master, b.master)


def test_bad_offload_input_is_refused_naming_the_cause(monkeypatch):
    with pytest.raises(ValidationError, match="offload"):
        ZeroConfig(offload={"optimizer": "nvme"})
    with pytest.raises(ValidationError, match="offload"):
        ZeroConfig(offload={"gpu": "cpu"})
    with pytest.raises(ValueError, match="offload.params='cpu' needs stage 3"):
        ZeroConfig(stage=2, offload={"params": "cpu"})
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload={"optimizer": "cpu"})
    monkeypatch.setattr(host, "available_host_bytes", lambda: 1000)
    model = Net()
    with pytest.raises(ValueError, match=r"needs about .* GiB of host memory .* only .* GiB is available"):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2, offload={"optimizer": "cpu"})
    ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2)  # nothing offloaded: no check


def test_host_memory_is_known_here():
    assert host.available_host_bytes() > 0


def test_an_unfused_host_adam_is_pointed_to_the_fused_kernel():
    """The fused CPU kernel runs at bandwidth (benchmarks/optimizer_step.py); it rounds about 1 ulp apart."""
    model = Net()
    with pytest.warns(UserWarning, match="fused=True"):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2, offload={"optimizer": "cpu"})
    expected, _ = train(2, {}, {})
    got, _ = train(2, {"optimizer": "cpu"}, {}, fused=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _gathered_buckets(opt: ZeroOptimizer) -> int:
    """How many of the optimizer's buckets hold their whole parameters on the device right now."""
    return sum(b.param_buffer.is_allocated for b in opt.buckets)


@pytest.mark.parametrize("offload", [{}, {"params": "cpu"}], ids=["resident", "params-offloaded"])
def test_close_gathers_a_bucket_at_a_time_and_gives_back_the_trained_model(offload):
    """A model larger than the device can be given back (issue 34): close() never holds more than two gathered
    buckets on the device (one waited for, the next in flight), and with offload.params the whole parameters go
    where the shards were."""
    expected, _ = train(3, offload, {})
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, stage=3,
                        offload=offload, bucket_size_mb=1e-4)
    train_net(model, opt, 4)
    most = [0]
    unshard = opt.runtime.stage.unshard

    def counting(bucket, comm, **kwargs):
        handle = unshard(bucket, comm, **kwargs)
        most[0] = max(most[0], _gathered_buckets(opt))
        return handle

    opt.runtime.stage.unshard = counting  # (this optimizer's own stage object: what close() gathers through)
    opt.close()
    assert len(opt.buckets) >= 3 and most[0] == 2, most[0]  # (more buckets than the window)
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), expected)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_gathered_parameters_with_offloaded_parameters_holds_them_on_the_host_and_takes_edits():
    """offload.params: the whole model is gathered into host memory, a bucket at a time, and nothing stays gathered
    on the device while the user holds it; edits reach the shards as they do without offload."""
    runs = {}
    for name, offload in (("resident", {}), ("offloaded", {"params": "cpu"})):
        model = Net()
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), model, stage=3, offload=offload,
                            bucket_size_mb=1e-4)
        train_net(model, opt, 2)
        with opt.gathered_parameters(modifier_rank=0):
            if name == "offloaded":
                assert _gathered_buckets(opt) == 0
            before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
            with torch.no_grad():
                model.head.weight.mul_(1.5)
        train_net(model, opt, 2, first=2)
        runs[name] = before, flat_params(model, opt)
    assert torch.equal(runs["offloaded"][0], runs["resident"][0])
    assert torch.equal(runs["offloaded"][1], runs["resident"][1])
    assert not torch.equal(runs["offloaded"][1], train(3, {"params": "cpu"}, {})[0])  # (the edit counted)


def test_gathered_parameters_on_the_host_refuses_a_cast_inside():
    """With offload.params, replacing a parameter's .data inside gathered_parameters() (a cast) is refused by name, as
    on the device: its edits could not reach the shards."""
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=3, offload={"params": "cpu"})
    with pytest.raises(ValueError, match="head.weight"):
        with opt.gathered_parameters():
            model.head.weight.data = model.head.weight.data.double()
