"""The collective codec seam in one process: the communicator's default codec, the world-of-one fast path (no
codec, nothing sent), the identity codec's calls, and ``Works``. Real collectives through codecs:
``tests/distributed/test_codec_world.py``."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tests.codecs import Bf16WireCodec
from zero.comm.codec import Codec, IdentityCodec, Works
from zero.comm.communicator import Communicator

TIMEOUT = datetime.timedelta(seconds=1)


@pytest.fixture(autouse=True)
def no_process_group(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)


class Done:
    """A work that has completed; remembers the timeout it was waited with."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self, timeout: datetime.timedelta) -> None:
        self.log.append((self.name, timeout))


class RecordingTransport:
    """Records the raw collectives a codec asks for, as a world of 2 at rank 1."""

    rank, world_size, device, backend = 1, 2, torch.device("cpu"), "fake"

    def __init__(self) -> None:
        self.calls: list = []

    def _call(self, kind: str, output: torch.Tensor, input: torch.Tensor) -> Done:
        self.calls.append((kind, output, input))
        return Done([], kind)

    def all_gather(self, output, input):
        return self._call("all_gather", output, input)

    def reduce_scatter(self, output, input):
        return self._call("reduce_scatter", output, input)

    def all_to_all(self, output, input):
        return self._call("all_to_all", output, input)


class RecordingCodec(IdentityCodec):
    """Records the collectives it is asked for and does them locally, as a world of one would."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_gather(self, output, input, transport):
        self.calls.append("all_gather")
        output.copy_(input)
        return Done([], "all_gather")

    def reduce_scatter(self, output, input, transport):
        self.calls.append("reduce_scatter")
        output.copy_(input)
        return Done([], "reduce_scatter")


def test_the_default_codec_is_the_identity_and_can_be_replaced(monkeypatch):
    """Replaced between collectives (an attribute), the codec the next collective goes through is the new one."""
    comm = Communicator()
    assert isinstance(comm.codec, IdentityCodec) and repr(comm.codec) == "IdentityCodec()"
    assert Communicator().codec is not comm.codec  # one each: a codec may keep state
    double = Bf16WireCodec()
    assert Communicator(codec=double).codec is double
    monkeypatch.setattr(Communicator, "skips_collectives", property(lambda self: False))  # as if it had a group
    first, second = RecordingCodec(), RecordingCodec()
    comm.codec = first
    comm.all_gather(torch.zeros(2), torch.ones(2)).wait()
    comm.codec = second
    comm.reduce_scatter(torch.zeros(2), torch.ones(2)).wait()
    assert first.calls == ["all_gather"] and second.calls == ["reduce_scatter"]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "forced_without_group"])
def test_a_world_of_one_sends_nothing_and_never_asks_the_codec(force):
    double = Bf16WireCodec()
    comm = Communicator(codec=double, force_collectives=force)
    values = torch.arange(4.0) / 3  # not representable in bfloat16: a codec on the way would show
    gathered, scattered, in_place = torch.zeros(4), torch.zeros(4), values.clone()
    comm.all_gather(gathered, values).wait()
    comm.reduce_scatter(scattered, values).wait()
    comm.reduce_scatter(in_place, in_place).wait()
    for got in (gathered, scattered, in_place):
        assert torch.equal(got, values)
    assert double.counts() == {} and comm.stats.as_dict("current") == {}


def test_the_identity_codec_hands_the_same_tensors_to_one_raw_collective_each():
    transport, codec = RecordingTransport(), IdentityCodec()
    whole = torch.zeros(12)
    chunk = whole[6:]  # rank 1's chunk, in place
    codec.all_gather(whole, chunk, transport).wait(TIMEOUT)
    codec.reduce_scatter(chunk, whole, transport).wait(TIMEOUT)
    (gather, g_out, g_in), (reduce, r_out, r_in) = transport.calls
    assert (gather, reduce) == ("all_gather", "reduce_scatter")
    assert g_out is whole and g_in is chunk and r_out is chunk and r_in is whole


def test_the_codec_base_class_must_be_implemented():
    for method in (Codec().all_gather, Codec().reduce_scatter):
        with pytest.raises(NotImplementedError):
            method(torch.zeros(2), torch.zeros(1), RecordingTransport())


def test_works_waits_for_each_work_then_decodes_and_waits_for_a_second_phase():
    log: list = []
    second = Done(log, "second phase")
    works = Works([Done(log, "a"), Done(log, "b")], lambda: log.append(("decode", None)) or second)
    works.wait(TIMEOUT)
    assert log == [("a", TIMEOUT), ("b", TIMEOUT), ("decode", None), ("second phase", TIMEOUT)]
    log.clear()
    Works([Done(log, "c")]).wait(TIMEOUT)
    assert log == [("c", TIMEOUT)]
