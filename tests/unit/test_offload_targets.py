"""Offload targets are a table (``zero.offload.TARGETS``), and a target of your own is one entry and one placement
class, named by import path: this file defines one, a second host-memory target that counts the bytes it places,
and shows that the policy's rules, the runtime (one process, the same numbers as the ``"cpu"`` target, bit for bit)
and the estimator (the same figures as ``"cpu"``; the runtime's placed bytes are the plan's host bytes) take it with
no change to zero's modules, and that nothing is registered anywhere (the table is an immutable tuple)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.readouts import flat_params
from tests.toy import Net, train_net
from zero import ZeroConfig, ZeroOptimizer
from zero.estimator import Workload, estimate
from zero.estimator.offloading import OffloadChoice
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.offload import TARGETS, Offload, OffloadTarget, Where, target_of
from zero.runtime.buffers.placement import HostPlacement

pytestmark = pytest.mark.filterwarnings("ignore:offloaded AdamW")


class CountingHostPlacement(HostPlacement):
    """Host memory as the ``"cpu"`` target's placement, counting the buffers and bytes placed here."""

    def __init__(self, pin: bool) -> None:
        super().__init__(pin)
        self.buffers = 0
        self.placed = 0

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        self.buffers += 1
        self.placed += numel * dtype.itemsize
        return super().new(numel, dtype, allocate=allocate)


COUNTING_HOST = OffloadTarget("counting-host", Where.HOST, f"{__name__}:CountingHostPlacement", tier=1)
COUNTING = f"{__name__}:COUNTING_HOST"  # what offload.optimizer / offload.params say
NOT_A_PLACEMENT = OffloadTarget("broken", Where.HOST, "tests.toy:Net", tier=1)
SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
BF16 = {"param_dtype": "bf16"}


def _train(stage: int, offload: dict, precision: dict, steps: int = 3) -> tuple[torch.Tensor, ZeroOptimizer]:
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1), model, stage=stage,
                        offload=offload, precision=precision, bucket_size_mb=1e-4)
    train_net(model, opt, steps)
    return flat_params(model, opt).float(), opt


def _mine(offload: dict) -> dict:
    return {k: COUNTING if v == "cpu" else v for k, v in offload.items()}


@pytest.mark.parametrize("stage,offload,precision", [
    (1, {"optimizer": "cpu"}, {}),
    (2, {"optimizer": "cpu"}, BF16),
    (2, {"optimizer": "cpu", "ratio": 0.5}, BF16),
    (3, {"params": "cpu"}, BF16),
    (3, {"optimizer": "cpu", "delayed_step": True}, {}),
], ids=str)
def test_a_target_of_your_own_trains_as_the_cpu_target(stage, offload, precision):
    expected, _ = _train(stage, offload, precision)
    got, opt = _train(stage, _mine(offload), precision)
    assert torch.equal(got, expected)  # the same arithmetic, wherever the bytes live
    placements = opt.runtime.placements
    mine = placements.optimizer
    assert type(mine) is CountingHostPlacement and placements.paged is None
    assert (placements.shard is mine) == ("params" in offload)  # one placement per target, shared by the sides
    host = [spec for bucket in opt.partition.plan.buckets for spec in bucket.buffers if spec.where is Where.HOST]
    assert mine.buffers == len(host) > 0 and mine.placed == sum(spec.nbytes for spec in host)
    opt.close()


def test_the_estimator_prices_a_target_of_your_own():
    work = Workload(lambda: GPT(SMALL), lambda m, x, y: m.loss(x, y), lambda micro: synthetic_batch(0, micro, SMALL))
    kw = dict(world_size=2, micro_batch=2, precision="mixed")
    for stage, offload in ((2, {"optimizer": "cpu"}), (3, {"optimizer": "cpu", "params": "cpu"}),
                           (2, {"optimizer": "cpu", "ratio": 0.5, "bucket_size_mb": 0.01})):
        settings = {k: v for k, v in offload.items() if k == "bucket_size_mb"}
        policy = {k: v for k, v in offload.items() if k != "bucket_size_mb"}
        cpu = estimate(work, stage=stage, offload=policy, **settings, **kw)
        mine = estimate(work, stage=stage, offload=_mine(policy), **settings, **kw)
        assert (mine.categories, mine.host, mine.disk) == (cpu.categories, cpu.host, 0.0)
        assert mine.optimizer_offload == COUNTING and mine.offload and not mine.paged
        assert mine.config.offload.optimizer == COUNTING  # the config that runs it
    # the plan's host bytes, as the estimator reads them, are the bytes the runtime's placement is asked for
    model = GPT(SMALL)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2, offload={"optimizer": COUNTING})
    layout = work.layout(2, 1, offload=OffloadChoice.of(Offload(optimizer=COUNTING)))
    assert opt.runtime.placements.optimizer.placed == sum(b.host for b in layout.buckets) > 0
    opt.close()


def test_the_policy_reads_the_table():
    assert [t.name for t in TARGETS] == ["none", "cpu", "disk"]  # fastest first
    assert isinstance(TARGETS, tuple) and all(dataclasses.is_dataclass(t) for t in TARGETS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TARGETS[1].tier = 0  # type: ignore[misc]
    assert COUNTING_HOST not in TARGETS and target_of(COUNTING) is COUNTING_HOST  # nothing registered: imported
    assert [target_of(t.name) for t in TARGETS] == list(TARGETS)
    policy = Offload(optimizer="none", params=COUNTING)
    assert policy.optimizer_target is COUNTING_HOST and policy.params_on_host and not policy.pages
    # the stage rules hold for any target off the device
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload={"optimizer": COUNTING})
    with pytest.raises(ValueError, match=f"offload.params='{COUNTING}' needs stage 3"):
        ZeroConfig(stage=2, offload={"params": COUNTING})
    # parameters on disk take the optimizer side along, to the same target
    with pytest.raises(ValueError, match="keeps the optimizer side on disk too"):
        Offload(optimizer=COUNTING, params="disk", path="/tmp")


@pytest.mark.parametrize(("name", "message"), [
    ("nvme", "offload.optimizer='nvme' should be 'none', 'cpu' or 'disk', or an offload target of your own"),
    ("tests.unit.no_such_module:X", "module 'tests.unit.no_such_module' does not import"),
    (f"{__name__}:NO_SUCH", f"module '{__name__}' has no 'NO_SUCH'"),
    (f"{__name__}:CountingHostPlacement", "not a zero.offload.OffloadTarget"),
    (f"{__name__}:", "is not an import path: give 'module:NAME'"),
], ids=str)
def test_a_bad_target_is_refused_naming_the_cause(name, message):
    with pytest.raises(ValueError, match=message):
        Offload(optimizer=name)


def test_a_target_whose_placement_is_not_one_is_refused_when_built():
    model = Net()
    with pytest.raises(ValueError, match="offload target 'broken' names .* as its placement, not a subclass of"):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2,
                      offload={"optimizer": f"{__name__}:NOT_A_PLACEMENT"})
