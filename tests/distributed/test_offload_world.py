"""CPU and disk offload change no number, at world sizes 1, 2 and 3 (``offload_world.offload_checks``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import world_fixture
from tests.distributed.offload_world import CASES, PRECISIONS, offload_checks

world = world_fixture(offload_checks)


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_offload_equals_no_offload_bit_for_bit(world, stage, what, precision):
    _, results = world
    for rank, result in enumerate(results):
        offloaded, on_device = result["parity"][(stage, what, precision)]
        assert torch.equal(offloaded, on_device), f"rank {rank}"
        assert torch.isfinite(offloaded).all()


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_partial_offload_equals_no_offload_bit_for_bit(world, stage, what, precision):
    """offload.ratio=0.5: the first buckets on the host, the rest stepped on the device (on the CPU, with the same
    kernels: every number unchanged), with no_sync accumulation and clipping, every rank (uneven shards at 3)."""
    _, results = world
    for rank, result in enumerate(results):
        partial, on_device = result["partial"][(stage, what, precision)]
        assert torch.equal(partial, on_device), f"rank {rank}"


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_disk_offload_equals_no_offload_bit_for_bit(world, stage, what, precision):
    """Offload to disk (a file per rank, uneven shards at 3 ranks) changes no number either."""
    _, results = world
    for rank, result in enumerate(results):
        on_disk, on_device = result["disk"][(stage, what, precision)]
        assert torch.equal(on_disk, on_device), f"rank {rank}"
        assert result["disk_left"] == [], f"rank {rank}"


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
def test_offload_moves_the_optimizer_side_to_the_host(world, stage, what):
    """bf16 parameters, gradients and reduction; per rank, after a step: the host holds the fp32 master
    and Adam's m and v (12Ψ/N), and at stages 2-3 the bf16 gradient shard, which goes down as each
    reduction completes (2Ψ/N; the step's fp32 copy of it is released after the step); the compute
    side keeps the bf16 parameters (stage 1 also its bf16 gradient buffer, reduced in place; stage 3
    its parameter shard, or with offloaded parameters nothing but one-element placeholders)."""
    world_size, results = world
    for rank, result in enumerate(results):
        mem = result["memory"][(stage, what)]
        psi, p, n = mem["numel"], mem["padded_numel"], world_size
        compute = {1: 4 * p, 2: 2 * p, 3: 2 * p / n}[stage]
        host = (12 if stage == 1 else 14) * p / n
        if what == "params":
            compute, host = 0, host + 2 * p / n  # the bf16 parameter shard moved too
        assert psi * compute / p <= mem["compute"] <= 1.01 * compute + 64, (rank, mem)
        assert psi * host / p <= mem["host"] <= 1.01 * host + 64, (rank, mem)


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_step_is_the_delayed_update_at_every_world_size(world, stage):
    for rank, result in enumerate(world[1]):
        got, recipe = result["delayed"][stage]
        # fp32 sums over ranks in another order than the reference's, as in the other parity tests
        torch.testing.assert_close(got, recipe, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")


def test_auto_ratio_agrees_across_ranks_and_trains_like_no_offload(world):
    """offload.ratio="auto" with budgets that differ by rank: every rank takes the most offload any rank needs (the
    buckets' placements, and so their step order, agree), which fits each rank's budget, and trains as no offload."""
    size, results = world
    ratios = {result["auto"]["ratio"] for result in results}
    assert len(ratios) == 1, ratios
    for rank, result in enumerate(results):
        auto = result["auto"]
        assert auto["fits"], f"rank {rank}"
        assert torch.equal(auto["got"], auto["expected"]), f"rank {rank}"
    if size > 1:  # rank 0's budget alone would keep part of the optimizer side on the device; the others' would not
        assert ratios.pop() > 0.5
