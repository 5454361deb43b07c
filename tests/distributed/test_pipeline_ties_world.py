"""Weights tied across pipeline parts (issue 48, item 6): the output head tied to the token embedding, the two on
different pp ranks (``pipeline_ties_world.tie_checks``: one world, dp 2 x pp 2).

Declared (``zero.pipelining.PipelineStage(..., tied_weights=...)``), training matches the tied model in one process:
parameters within ``PARAMS_TOL`` relative L2 (the untied pipeline's own noise floor, FSDP2 + pipelining's, is ~2e-6:
four micro-batch means added instead of one mean), losses within ``LOSS_TOL``, the clip norm within 1e-4 relative
(the tie counted once), and the two copies equal after every step. Undeclared, a name no part holds, and copies that
start apart are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.pipeline_ties_world import RUNS, tie_checks
from tests.distributed.pipeline_world import rel_l2
from tests.distributed.tensor_parallel_world import loss_gap, norm_gap

PARAMS_TOL, LOSS_TOL, NORM_RTOL = 1e-5, 1e-5, 1e-4


@pytest.fixture(scope="module")
def world():
    return run_world(tie_checks, 4)[0]


@pytest.mark.parametrize("schedule, stage", RUNS, ids=[f"{n}-stage{s}" for n, s in RUNS])
def test_tied_weights_train_as_one_tensor(world, schedule, stage):
    run, ref = world[schedule, stage], world["reference"]
    assert rel_l2(run, ref) <= PARAMS_TOL, f"parameters {rel_l2(run, ref):.3g} off the tied model's"
    assert loss_gap(run, ref) <= LOSS_TOL, (run["losses"], ref["losses"])
    assert norm_gap(run, ref) <= NORM_RTOL, (run["norms"], ref["norms"])
    params = run["params"]
    torch.testing.assert_close(params["tok_embeddings.weight"], params["output.weight"], rtol=0, atol=0)


def test_undeclared_or_wrong_ties_are_refused(world):
    refused = world["refusals"]
    assert "'tok_embeddings.weight' (pp rank 0) and 'output.weight' (pp rank 1) hold the same values" in \
        refused["undeclared"]
    assert "tied_weights=[(name, other_name)]" in refused["undeclared"]
    assert "hold the same values" in refused["torch_stage"] and "mesh['dp']" in refused["torch_stage"]
    assert "['head.weight'], which no part of the pipeline holds" in refused["unknown_name"]
    assert "hold different values" in refused["differ"]
