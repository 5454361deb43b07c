"""CPU offload changes no number, at world sizes 1, 2 and 3 (``offload_world.offload_checks``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.offload_world import CASES, PRECISIONS


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_offload_equals_no_offload_bit_for_bit(world, stage, what, precision):
    _, results = world
    for rank, result in enumerate(results):
        offloaded, on_device = result["offload"][(stage, what, precision)]
        assert torch.equal(offloaded, on_device), f"rank {rank}"
        assert torch.isfinite(offloaded).all()
