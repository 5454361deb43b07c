"""The communicator's real collectives in a gloo world of one: every kind issued for real with
``force_collectives=True`` (and skipped without it), its results and its counters (the communicator in one process:
``tests/unit/test_comm.py``)."""

from __future__ import annotations

import torch

from tests.distributed.harness import run_world
from zero.comm.communicator import Communicator


def _forced_collectives(rank: int, world_size: int) -> dict:
    """Every collective kind, issued for real through a gloo world of one (and skipped without forcing)."""
    comm = Communicator(force_collectives=True, timeout_s=60)
    plain = Communicator()
    results: dict = {"skips": (comm.skips_collectives, plain.skips_collectives)}
    summed = torch.arange(4.0)
    comm.all_reduce(summed).wait()
    maxed = torch.tensor([3.0, -1.0])
    comm.all_reduce(maxed, op="max").wait()
    scattered, in_place = torch.zeros(4), torch.arange(4.0)
    comm.reduce_scatter(scattered, torch.arange(4.0)).wait()
    comm.reduce_scatter(in_place, in_place).wait()
    gathered, gathered_in_place = torch.zeros(3), torch.arange(3.0)
    comm.all_gather(gathered, torch.arange(3.0)).wait()
    comm.all_gather(gathered_in_place, gathered_in_place).wait()
    sent = torch.arange(5.0)
    comm.broadcast(sent, 0).wait()
    results["tensors"] = [summed, maxed, scattered, in_place, gathered, gathered_in_place, sent]
    results["objects"] = comm.all_gather_object({"rank": rank})
    results["stats"] = comm.stats.as_dict("current")
    plain.all_reduce(torch.ones(2)).wait()
    plain.broadcast(torch.ones(2)).wait()
    results["plain_stats"] = plain.stats.as_dict("current")
    return results


def test_forced_collectives_really_run_in_a_world_of_one():
    (results,) = run_world(_forced_collectives, 1, timeout_s=120)
    assert results["skips"] == (False, True)
    expected = [torch.arange(4.0), torch.tensor([3.0, -1.0]), torch.arange(4.0), torch.arange(4.0),
                torch.arange(3.0), torch.arange(3.0), torch.arange(5.0)]  # fmt: skip
    for got, want in zip(results["tensors"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert results["objects"] == [{"rank": 0}]
    waited = {kind: entry.pop("wait_s") for kind, entry in results["stats"].items()}  # each handle was waited for
    assert set(waited) == {"all_gather", "all_reduce", "broadcast", "reduce_scatter"}
    assert all(isinstance(s, float) and 0 < s < 60 for s in waited.values()), waited
    assert results["stats"] == {
        "all_gather": {"calls": 2, "numel": 6, "bytes": 24},
        "all_reduce": {"calls": 2, "numel": 6, "bytes": 24},
        "broadcast": {"calls": 1, "numel": 5, "bytes": 20},
        "reduce_scatter": {"calls": 2, "numel": 8, "bytes": 32},
    }
    assert results["plain_stats"] == {}  # not forced: nothing sent, nothing counted
