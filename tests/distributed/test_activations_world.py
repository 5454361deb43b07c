"""Activation checkpointing changes no number at world sizes 1, 2 and 3, every stage, with dropout
(``activations_world.activation_checks``)."""

from __future__ import annotations

import pytest

from tests.distributed.activations_world import POLICIES, activation_checks
from tests.distributed.harness import world_fixture

world = world_fixture(activation_checks)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointing_is_exact_with_dropout(world, stage, policy):
    for rank, result in enumerate(world[1]):
        (losses, params), (plain_losses, plain_params) = result[(stage, policy)]
        # bit for bit but for offloaded inputs at two ranks (1 ulp: autograd adds the input's two gradient
        # contributions through one more node); the bound is 1e-6
        assert max(abs(a - b) for a, b in zip(losses, plain_losses)) <= 1e-6, f"rank {rank}"
        assert (params - plain_params).abs().max() <= 1e-6, f"rank {rank}"
