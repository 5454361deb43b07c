"""Activation checkpointing changes no number at world sizes 1, 2 and 3, every stage, with dropout
(``activations_world.activation_checks``)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.activations_world import POLICIES


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointing_is_exact_with_dropout(world, stage, policy):
    for rank, result in enumerate(world[1]):
        (losses, params), (plain_losses, plain_params) = result["activations"][(stage, policy)]
        assert losses == plain_losses, f"rank {rank}"
        assert torch.equal(params, plain_params), f"rank {rank}"
