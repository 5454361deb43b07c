"""The host step's threads (``offload.host_threads``): "auto" takes the cores of the process's CPU affinity, shared
among the ranks of the machine when they were not bound to cores of their own; the count holds while the host steps
(also in the delayed step's thread) and is restored after, so a program under torchrun's ``OMP_NUM_THREADS=1``
keeps one thread elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from tests.toy import Net, train_net
from zero import ZeroOptimizer
from zero.offload import Offload
from zero.runtime.step.host_threads import host_step_threads

pytestmark = pytest.mark.filterwarnings("ignore:offloaded CountingAdamW")


@pytest.mark.parametrize("affinity,machine,local,expected", [
    (16, 16, 1, 16),   # one rank, every core
    (16, 16, 4, 4),    # four unbound ranks share the machine
    (16, 16, 32, 1),   # more ranks than cores: one each
    (4, 16, 4, 4),     # bound to 4 cores of its own (numactl, torchrun --numa-binding): all of them
])
def test_auto_takes_the_cores_the_rank_owns(monkeypatch, affinity, machine, local, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    assert host_step_threads("auto", local) == expected
    assert host_step_threads(3, local) == 3


@pytest.mark.parametrize("value", [0, -2, True, "4", 1.5])
def test_a_bad_thread_count_is_refused(value):
    with pytest.raises(ValueError, match="host_threads"):
        Offload(optimizer="cpu", host_threads=value)


class CountingAdamW(torch.optim.AdamW):
    """AdamW recording torch's thread count at each of its steps."""

    seen: list[int]

    def step(self, closure=None):
        type(self).seen.append(torch.get_num_threads())
        return super().step(closure)


@pytest.mark.parametrize("offload", [
    {"optimizer": "cpu", "host_threads": 2},
    {"optimizer": "cpu", "host_threads": 2, "ratio": 0.5},
    {"optimizer": "cpu", "host_threads": 2, "delayed_step": True},
], ids=["full", "partial", "delayed"])
def test_the_host_steps_with_its_threads_and_restores_the_callers(offload):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun's OMP_NUM_THREADS=1
    try:
        CountingAdamW.seen = []
        model = Net()
        opt = ZeroOptimizer(CountingAdamW(model.parameters(), lr=0.05), model, stage=2, offload=offload,
                            bucket_size_mb=1e-4, elementwise_optimizers=["CountingAdamW"])  # (a subclass: declared)
        train_net(model, opt, 3)
        opt.flush()  # (the delayed step: its last update in flight)
        assert CountingAdamW.seen and set(CountingAdamW.seen) == {2}, CountingAdamW.seen
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_nothing_offloaded_leaves_the_threads_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        CountingAdamW.seen = []
        model = Net()
        opt = ZeroOptimizer(CountingAdamW(model.parameters(), lr=0.05), model, stage=2,
                            offload={"optimizer": "cpu", "host_threads": 2, "ratio": 0.0}, bucket_size_mb=1e-4)
        train_net(model, opt, 2)
        assert set(CountingAdamW.seen) == {1}
    finally:
        torch.set_num_threads(before)
