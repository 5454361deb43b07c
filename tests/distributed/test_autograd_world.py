"""Every way people call autograd trains like single-process PyTorch at every stage and world size 1, 2 and 3, with
and without activation checkpointing (``autograd_world.autograd_checks``, issue 41): input gradients of a leaf input,
a gradient-penalty loop (double backward), gradients with respect to parameters, ``backward(inputs=...)``,
``retain_graph=True`` with two backward passes, two forwards before one backward; and reentrant activation checkpointing
and a backward pass interrupted by an error (``autograd_world.toy_paths``)."""

from __future__ import annotations

import pytest

from tests.distributed.autograd_world import PATTERNS, STEPS, build, checks
from tests.distributed.harness import world_fixture
from tests.readouts import flat_params, max_diff
from zero.models import local_slice

TOL = 1e-5  # SGD keeps runs within rounding of each other

world = world_fixture(checks)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", PATTERNS)
def test_autograd_patterns_train_like_one_process(world, name, stage, checkpointing):
    world_size, results = world
    reference = results[0]["autograd"][(name, "reference", False)]
    initial = flat_params(build())
    for rank, result in enumerate(results):
        ours = result["autograd"][(name, stage, checkpointing)]
        assert max_diff(ours["params"], reference["params"]) <= TOL, f"rank {rank}"
        assert max_diff(ours["params"], initial) > 1e-3, f"rank {rank}: training did not move the parameters"
        assert len(ours["readouts"]) == STEPS
        for step, (got, expected) in enumerate(zip(ours["readouts"], reference["readouts"])):
            if name in ("grad_input", "penalty"):  # this rank's rows of the global input gradient
                expected = local_slice(expected, rank, world_size)
                assert got.shape == expected.shape and got.abs().max() > 0, f"rank {rank}, step {step}"
                assert max_diff(got, expected) <= TOL, f"rank {rank}, step {step}"
        for step, (got, plain) in enumerate(zip(ours["readouts"], ours["plain_grads"])):
            assert got.shape == plain.shape and max_diff(got, plain) <= TOL, f"rank {rank}, step {step}"
        assert len(ours["plain_grads"]) == (STEPS if name == "grad_params" else 0)


def test_checkpointing_and_an_interrupted_backward_train_like_single_process(world):
    """Reentrant activation checkpointing (a backward nested in the pass), and an error in the middle
    of a backward pass followed by zero_grad() and a retry (its collectives drained first)."""
    _, results = world
    for r in results:
        assert sorted(r["toy_paths"]) == [(case, stage) for case in ("interrupted", "reentrant") for stage in range(4)]
        for (case, stage), diff in r["toy_paths"].items():
            assert diff <= 1e-6, (case, stage, diff)
