"""Partial offload (``offload={"optimizer": "cpu", "ratio": r}``, ZeRO-Offload++'s Twin-Flow) at world size 1: the
first buckets backward reduces go to the host, whole, up to ``r`` of the elements; the rest step on the device; no
number changes (on the CPU host and device run the same kernels, so every ratio equals no offload bit for bit, and
``ratio=0`` is no offload); checkpoints move between ratios; the estimator prices the split; DeepSpeed's key maps to
it. The multi-rank comparison is in ``tests/distributed/offload_world.py``."""

from __future__ import annotations

import pytest
import torch

import zero
from tests.readouts import flat_params, halfway_offload
from tests.toy import Net, train_net
from zero import ZeroConfig, ZeroOptimizer
from zero.estimator import Workload, estimate
from zero.models import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.filterwarnings("ignore:offloaded AdamW")
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}, "fp16": {"param_dtype": "fp16"}}


def build(stage: int, offload: dict, precision: dict) -> tuple[Net, ZeroOptimizer]:
    model = Net()
    return model, ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, stage=stage,
                                offload=offload, precision=precision, bucket_size_mb=1e-4)


def trained(stage: int, offload: dict, precision: dict, steps: int = 4) -> tuple[torch.Tensor, ZeroOptimizer]:
    model, opt = build(stage, offload, precision)
    train_net(model, opt, steps)  # two micro-batches (no_sync), clipping
    return flat_params(model, opt).float(), opt


@pytest.mark.parametrize("stage,params", [(1, False), (2, False), (3, False), (3, True)],
                         ids=["stage1", "stage2", "stage3", "stage3-params"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_ratio_trains_like_no_offload(stage, params, precision):
    expected, _ = trained(stage, {}, PRECISIONS[precision])
    for ratio in (0.0, 0.5, 1.0):
        offload = {"optimizer": "cpu", "ratio": ratio, **({"params": "cpu"} if params else {})}
        got, opt = trained(stage, offload, PRECISIONS[precision])
        assert torch.equal(got, expected), ratio
        placed = [b.offloaded for b in opt.partition.trainable_buckets]
        numels = [b.layout.padded_numel for b in opt.partition.trainable_buckets]
        total = sum(b.layout.padded_numel for b in opt.buckets)
        hosts = placed.index(False) if False in placed else len(placed)
        assert placed == [True] * hosts + [False] * (len(placed) - hosts), placed  # the first ones, whole
        assert sum(numels[:hosts]) <= ratio * total < sum(numels[: hosts + 1]) + (ratio == 1) * total
        if params:
            assert all(b.placements.params_offloaded == b.offloaded for b in opt.buckets)


def test_a_checkpoint_moves_between_ratios_and_stages(tmp_path):
    """Saved at ratio 0.5 (stage 2), loaded with no offload at stage 3 and with all of it offloaded at stage 1: the
    resumed runs equal the one that went on."""
    precision = PRECISIONS["bf16"]
    model, opt = build(2, {"optimizer": "cpu", "ratio": 0.5}, precision)
    train_net(model, opt, 2)
    zero.save_checkpoint(tmp_path / "c", model, opt, progress=False)
    train_net(model, opt, 2, first=2)
    expected = flat_params(model, opt).float()
    for stage, offload in ((3, {}), (1, {"optimizer": "cpu"})):
        other, other_opt = build(stage, offload, precision)
        zero.load_checkpoint(tmp_path / "c", other, other_opt, progress=False)
        train_net(other, other_opt, 2, first=2)
        assert torch.equal(flat_params(other, other_opt).float(), expected), (stage, offload)


def test_ratio_is_refused_where_it_means_nothing():
    for offload, message in (({"ratio": 0.5}, "needs offload.optimizer='cpu'"),
                             ({"optimizer": "disk", "path": "/tmp", "ratio": 0.5}, "needs offload.optimizer='cpu'"),
                             ({"optimizer": "cpu", "ratio": 0.5, "delayed_step": True}, "Use one or the other"),
                             ({"optimizer": "cpu", "ratio": 1.5}, "less than or equal to 1")):
        with pytest.raises(ValueError, match=message):
            ZeroConfig(stage=2, offload=offload)


def test_deepspeed_offload_optimizer_ratio_maps_to_it():
    config, _ = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.3}}})
    assert config.offload.optimizer == "cpu" and config.offload.ratio == 0.3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_estimator_prices_the_split(stage):
    """Device bytes fall and host bytes rise with the ratio, between no offload and full offload."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=64, num_layers=4, num_heads=2)
    workload = Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda n: synthetic_batch(0, n, cfg))
    runs = [estimate(workload, stage=stage, world_size=2, micro_batch=2, bucket_size_mb=0.05, offload="cpu",
                     offload_ratio=ratio) for ratio in (0.0, 0.5, 1.0)]
    none = estimate(workload, stage=stage, world_size=2, micro_batch=2, bucket_size_mb=0.05)
    assert runs[0].peak == none.peak and runs[0].host == none.host
    assert runs[0].peak > runs[1].peak > runs[2].peak
    assert runs[0].host < runs[1].host < runs[2].host


@pytest.mark.parametrize(("stage", "params"), [(1, "none"), (2, "none"), (3, "cpu")], ids=str)
def test_the_host_estimate_is_what_the_offloaded_buckets_hold(stage, params):
    """Host memory at ratio 0.5: the host buffers of the offloaded buckets and their pieces' optimizer state."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=4, num_heads=2)
    workload = Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda n: synthetic_batch(0, n, cfg))
    e = estimate(workload, stage=stage, world_size=1, micro_batch=2, bucket_size_mb=0.01, offload="cpu",
                 params_offload=params, offload_ratio=0.5)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, bucket_size_mb=0.01,
                        offload={"optimizer": "cpu", "params": params, "ratio": 0.5})
    x, y = synthetic_batch(0, 2, cfg)
    model.loss(x, y).backward()
    opt.step()
    offloaded = [bucket for bucket in opt.partition.buckets if bucket.offloaded]
    assert 0 < len(offloaded) < len(opt.partition.buckets)
    buffers = sum(b.nbytes for bucket in offloaded
                  for b in bucket.offloaded_buffers() if b.placement.where.on_host)
    state = sum(t.untyped_storage().nbytes() for bucket in offloaded for piece in bucket.pieces
                for t in opt.inner.state[piece.tensor].values() if isinstance(t, torch.Tensor))
    assert e.host == pytest.approx(buffers + state, abs=64)


def test_the_planner_offloads_the_least_that_fits():
    """Between no offload and full offload the planner keeps the most of the optimizer side on the device: the
    smallest ratio (a bucket boundary: stage 3's units here) whose peak fits, and one bucket less does not."""
    from zero.estimator import plan
    from zero.estimator.partial_offload import offload_boundaries

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=64, num_layers=8, num_heads=2)
    workload = Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda n: synthetic_batch(0, n, cfg))
    kw = dict(stage=3, world_size=2, micro_batch=2)
    none, full = estimate(workload, **kw).peak, estimate(workload, offload="cpu", **kw).peak
    budget = (none + full) / 2
    chosen = [e for e in plan(workload, gpu_memory=budget / 0.9, world_size=2, micro_batches=[2]).fits
              if (e.stage, e.checkpointing, e.optimizer_offload) == (3, False, "cpu")]
    assert len(chosen) == 1 and 0 < chosen[0].offload_ratio < 1 and chosen[0].peak <= budget
    boundaries = offload_boundaries(workload.layout(3, 2))
    less = boundaries[boundaries.index(chosen[0].offload_ratio) - 1]
    assert estimate(workload, offload="cpu", offload_ratio=less, **kw).peak > budget


def test_auto_picks_at_construction_what_the_planner_picks():
    """``ratio="auto"`` with a budget between no offload's peak and full offload's: the optimizer is built at the
    smallest ratio whose estimate fits (the planner's), trains as no offload does, and the message says which."""
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=64, num_layers=4, num_heads=2)
    workload = Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda n: synthetic_batch(0, n, cfg))
    kw = dict(stage=2, world_size=1, micro_batch=2, bucket_size_mb=0.05)
    budget, expected = halfway_offload(workload, **kw)
    assert 0 < expected < 1
    x, y = synthetic_batch(0, 2, cfg)

    def run(offload: dict, example: zero.StepExample | None = None) -> tuple[torch.Tensor, ZeroOptimizer]:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=2, bucket_size_mb=0.05,
                            offload=offload, example=example)
        for _ in range(2):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt), opt

    example = zero.StepExample(loss=lambda m, a, b: m.loss(a, b), batch=(x, y))
    got, opt = run({"optimizer": "cpu", "ratio": "auto", "gpu_memory": budget / 0.9}, example)
    assert opt.config.offload.ratio == expected
    assert 0 < sum(b.offloaded for b in opt.partition.trainable_buckets) < len(opt.partition.trainable_buckets)
    assert torch.equal(got, run({})[0])


def test_auto_refuses_what_it_cannot_price():
    model = Net()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs the loss and one micro-batch"):
        ZeroOptimizer(adamw, model, stage=2, offload={"optimizer": "cpu", "ratio": "auto", "gpu_memory": 1e9})
    with pytest.raises(ValueError, match="set offload.gpu_memory"):
        ZeroOptimizer(adamw, model, stage=2, offload={"optimizer": "cpu", "ratio": "auto"},
                      example=zero.StepExample(loss=lambda m, x: m(x).sum(), batch=(torch.randn(2, 6),)))
    with pytest.raises(ValueError, match="budget of ratio='auto'"):
        ZeroConfig(offload={"optimizer": "cpu", "gpu_memory": 1e9})
    with pytest.raises(ValueError, match="used only by offload.ratio='auto'"):
        ZeroOptimizer(adamw, model, stage=2, example=zero.StepExample(loss=lambda m, x: m(x).sum(), batch=()))
    with pytest.raises(ValueError, match="even the whole optimizer side on the host needs"):
        ZeroOptimizer(adamw, model, stage=2, offload={"optimizer": "cpu", "ratio": "auto", "gpu_memory": 1e3},
                      example=zero.StepExample(loss=lambda m, x: m(x).sum(), batch=(torch.randn(2, 6),)))
