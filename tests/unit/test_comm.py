"""The communicator in one process: launcher without a process group, tensor devices, chained handles (real
collectives in a world of one: ``tests/distributed/test_comm_world.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero.comm.communicator import Communicator
from zero.comm.groups import resolve_device
from zero.comm.handles import Chain


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)


# ----- a launcher without a process group ------------------------------------------------------------------


def test_launcher_world_without_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 but never called torch.distributed.init_process_group"):
        Communicator()


@pytest.mark.parametrize("world", ["1", ""])
def test_launcher_world_of_one_runs_without_process_group(monkeypatch, world):
    monkeypatch.setenv("WORLD_SIZE", world)
    assert Communicator().world_size == 1


# ----- devices -----------------------------------------------------------------------------------------------


def test_device_defaults_to_the_cpu_without_nccl():
    comm = Communicator()
    assert comm.device == torch.device("cpu")
    assert comm.skips_collectives and not comm.force_collectives
    assert Communicator(device="meta").device == torch.device("meta")


def test_forcing_collectives_needs_a_process_group():
    comm = Communicator(force_collectives=True)
    assert comm.force_collectives and comm.skips_collectives  # nothing to send through
    comm.all_reduce(torch.ones(2)).wait()
    assert comm.stats.as_dict("current") == {}


def test_nccl_refuses_a_device_that_is_not_cuda():
    with pytest.raises(ValueError, match=r"nccl, which moves only CUDA tensors, but the device is cpu\. Move"):
        resolve_device("cpu", "nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_defaults_to_the_current_gpu_with_its_index():
    assert resolve_device(None, "nccl") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("cuda", "gloo").index == torch.cuda.current_device()


COLLECTIVES = {
    "all-reduce": lambda comm, t, what: comm.all_reduce(t, what=what),
    "reduce-scatter": lambda comm, t, what: comm.reduce_scatter(t, t, what=what),
    "all-gather": lambda comm, t, what: comm.all_gather(t, t, what=what),
    "broadcast": lambda comm, t, what: comm.broadcast(t, what=what),
}


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("comm_device, tensor_device", [("cpu", "meta"), ("meta", "cpu")])
def test_collective_refuses_a_tensor_on_another_device_even_at_world_size_one(kind, comm_device, tensor_device):
    comm = Communicator(device=comm_device)
    message = rf"zero: {kind} of x got a tensor on {tensor_device}, but .* sends tensors on {comm_device} "
    with pytest.raises(ValueError, match=message):
        COLLECTIVES[kind](comm, torch.zeros(4, device=tensor_device), f"{kind} of x")


def test_reduce_scatter_checks_the_output_too():
    comm = Communicator()
    with pytest.raises(ValueError, match="tensor on meta"):
        comm.reduce_scatter(torch.zeros(4, device="meta"), torch.zeros(4), what="reduce-scatter")


class _Phase:
    """A handle that logs when it is waited for."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def advance(self) -> None:
        pass

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def test_a_chain_advances_once_and_waits_for_its_second_phase_once():
    """advance() waits for the first phase and starts the second without waiting for it (the reducer advances
    HSDP's buckets at the next launch); wait() then waits for the second; neither repeats."""
    log: list[str] = []

    def second() -> _Phase:
        log.append("start second")
        return _Phase("second", log)

    chain = Chain(_Phase("first", log), second)
    chain.advance()
    chain.advance()
    assert log == ["wait first", "start second"]
    chain.wait()
    chain.wait()
    assert log == ["wait first", "start second", "wait second"]
    log.clear()
    unadvanced = Chain(_Phase("first", log), second)
    unadvanced.wait()
    assert log == ["wait first", "start second", "wait second"]
