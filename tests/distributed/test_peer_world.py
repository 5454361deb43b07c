"""Peer-suite paths that need several ranks (``peer_world``), in real gloo worlds of 2 and 3 ranks, against plain
single-process torch on the same global batch (fp32: 1e-6 relative; the same sums in another order)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.peer_world import dropped_and_wrapped_again, peer_checks, two_optimizers


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def world(request):
    return run_world(peer_checks, request.param)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_two_optimizers_over_disjoint_parts_of_one_model(world):
    reference = two_optimizers(0, 1, None)
    for rank in world:
        for stages, params in rank["two_optimizers"].items():
            assert _close(params, reference), stages


def test_a_stage3_optimizer_dropped_without_close_leaves_the_model_to_the_next(world):
    reference, _ = dropped_and_wrapped_again(0, 1, None)
    for rank in world:
        for second, (params, refusal) in rank["wrapped_again"].items():
            assert _close(params, reference), second
            assert "dropped without close()" in refusal and "Build a new ZeroOptimizer" in refusal


def test_ddp_around_a_managed_model_is_refused(world):
    for rank in world:
        for stage, messages in rank["ddp"].items():
            assert len(messages) == 2, (stage, messages)
            assert "DistributedDataParallel wraps the model;" in messages[0]
            second = "a model whose parameters a stage-3" if stage == 3 else "the model ZeroOptimizer manages"
            assert f"DistributedDataParallel wraps {second}" in messages[1], messages[1]
