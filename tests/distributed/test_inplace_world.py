"""In-place operations on a unit's input train exactly at every stage, at world sizes 1, 2 and 3
(``inplace_world.inplace_checks``): a torchvision-style ResNet against DDP (batch norm normalizes each rank's own
rows, as under DDP), blocks that start with ``F.relu(x, inplace=True)``, ``x.mul_``, ``x +=`` against DDP and
single-process PyTorch. SGD keeps every run within rounding of the others (1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import world_fixture
from tests.distributed.inplace_world import STEPS, build, inplace_checks
from tests.readouts import flat_params, max_diff

world = world_fixture(inplace_checks)


@pytest.mark.parametrize("name", ["resnet", "inplace"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_in_place_operations_train_like_ddp(world, name, stage):
    world_size, results = world
    reference = results[0][(name, "reference")]
    initial = flat_params(build(name))
    for rank, result in enumerate(results):
        ours, ddp = result[(name, f"stage{stage}")], result[(name, "ddp")]
        assert len(ours["losses"]) == STEPS and all(torch.isfinite(torch.tensor(ours["losses"])))
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=1e-6), f"rank {rank}"
        assert max_diff(ours["params"], ddp["params"]) <= 1e-5, f"rank {rank}"
        if name == "inplace":  # no batch statistics: the same numbers as one process on the whole batch
            assert max_diff(ours["params"], reference["params"]) <= 1e-5, f"rank {rank}"
        assert max_diff(ours["params"], initial) > 1e-3, f"rank {rank}: training did not move the parameters"
