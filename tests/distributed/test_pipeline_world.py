"""Pipeline parallelism (issue 48): ``ZeroOptimizer`` at stages 0-3 over the parts of ``LlamaGPT`` cut for torch's
pipeline schedules at their defaults, on a dp 2 x pp 2 mesh, against single-process training on the global batch,
with FSDP2 + pipelining on the same mesh as the noise floor (``pipeline_world.pipeline_checks``: one world); and
dp 2 x pp 2 x tp 2 at stages 1 and 3 against FSDP2 + TP + pipelining (``three_d_checks``: a world of 8).

Tolerances: FSDP2 + pipelining's own deviation from the reference is ~2e-6 (relative L2 of the parameters after 3
AdamW steps: four micro-batch means added and divided instead of one mean over the batch). Ours must be within
``FACTOR`` times that; losses within ``LOSS_TOL``; the clip's returned norm within 1e-4 relative of torch's on the
whole model. Traffic: with ``zero.pipelining.PipelineStage`` one reduction per bucket per step, not one per
micro-batch (``comm_stats``).
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_world
from tests.distributed.pipeline_world import (
    FULL,
    MICRO,
    QUICK,
    SCHEDULES,
    STAGES,
    ZERO_BUBBLE,
    pipeline_checks,
    rel_l2,
    three_d_checks,
)
from tests.distributed.tensor_parallel_world import loss_gap, norm_gap
from tests.quick import full_only_beyond, is_quick

pytestmark = pytest.mark.heavy  # a module of a minute or more: run first (tests/conftest.py)

FACTOR, FLOOR = 3.0, 1e-6
LOSS_TOL = 1e-5
NORM_RTOL = 1e-4
RUNS = [(name, stage) for name in (*SCHEDULES, *ZERO_BUBBLE) for stage in STAGES]
QUICK_RUNS = [(name, stage) for name, stages in QUICK["schedules"].items() for stage in stages]
RUN_PARAMS = full_only_beyond(RUNS, QUICK_RUNS, lambda run: f"{run[0]}-stage{run[1]}")


@pytest.fixture(scope="module")
def world(request):
    return run_world(pipeline_checks, 4, QUICK if is_quick(request) else FULL)[0]


def _like_fsdp2(run: dict, anchor: dict, ref: dict, what: str) -> None:
    noise, diff = rel_l2(anchor, ref), rel_l2(run, ref)
    assert diff <= FACTOR * noise + FLOOR, f"{what}: parameters {diff:.3g} off, FSDP2 + pipelining {noise:.3g}"
    assert loss_gap(run, ref) <= LOSS_TOL, f"{what}: losses {run['losses']} vs {ref['losses']}"
    assert norm_gap(run, ref) <= NORM_RTOL, f"{what}: clip norms {run['norms']} vs {ref['norms']}"


@pytest.mark.parametrize("schedule, stage", RUN_PARAMS)
def test_trains_like_single_process(world, schedule, stage):
    """torch's schedules at their defaults over zero.pipelining.PipelineStage: exact, the clip over the pipeline."""
    _like_fsdp2(world[schedule, stage], world[schedule, "fsdp2"], world["reference"], f"{schedule} stage {stage}")


@pytest.mark.parametrize("stage", full_only_beyond(FULL["torch_stages"], QUICK["torch_stages"]))
def test_torch_own_stage_is_exact_with_the_pipeline_from_the_mesh(world, stage):
    """torch's own PipelineStage, ZeroOptimizer(..., mesh=mesh) with a "pp" dimension: scale_grads' p.grad.div_ on
    the guard is applied to the shards, the clip adds up over pp."""
    run = world["1f1b", stage, "torch_stage"]
    _like_fsdp2(run, world["1f1b", "fsdp2"], world["reference"], f"torch's stage, stage {stage}")


@pytest.mark.parametrize("schedule", full_only_beyond(FULL["blocks"], QUICK["blocks"]))
def test_stage3_units_kept_over_the_step_gather_less(world, schedule):
    """LlamaBlock units (each part owning the rest; with two parts per rank the ModuleList of parts has no forward
    to gather a root unit), resharded after each backward or kept gathered from their first backward to the step
    (set_reshard_after_backward(False), FSDP2's switch that torch's stage flips for FSDP): both exact, the second
    with fewer all-gathers."""
    for how in ("blocks", "blocks_kept"):
        run = world[schedule, 3, how]
        _like_fsdp2(run, world[schedule, "fsdp2"], world["reference"], f"{schedule} stage 3 {how}")
    gathers = {how: world[schedule, 3, how]["traffic"][-1]["all_gather"] for how in ("blocks", "blocks_kept")}
    assert gathers["blocks_kept"] < gathers["blocks"], gathers


def test_fsdp2_anchor_is_exact(world):
    """The noise floor itself is small (else the comparison proves nothing)."""
    for name in (*SCHEDULES, *ZERO_BUBBLE):
        assert rel_l2(world[name, "fsdp2"], world["reference"]) < 1e-4, name
        assert norm_gap(world[name, "fsdp2"], world["reference"]) < NORM_RTOL, name


@pytest.mark.parametrize("stage", (1, 2))
def test_one_reduction_per_bucket_per_step(world, stage):
    """4 micro-batches: zero's stage reduce-scatters each bucket once per step; torch's own stage once per
    micro-batch (what the drop-in saves)."""
    names = [name for name in SCHEDULES if stage in world["matrix"]["schedules"][name]]  # under --quick: one
    assert names
    for name in names:
        run = world[name, stage]
        assert [t["reduce_scatter"] for t in run["traffic"]] == [run["buckets"]] * 3, (name, run["traffic"])
    if stage in world["matrix"]["torch_stages"]:
        run = world["1f1b", stage, "torch_stage"]
        assert [t["reduce_scatter"] for t in run["traffic"]] == [MICRO * run["buckets"]] * 3, run["traffic"]


def test_stage0_all_reduces_once_per_bucket(world):
    """Stage 0: one all-reduce per bucket, plus the one of which parameters got gradients (the clip's is not
    needed: whole gradients)."""
    run = world["1f1b", 0]
    assert [t["all_reduce"] for t in run["traffic"]] == [run["buckets"] + 1] * 3, run["traffic"]


def test_refusals_name_the_cause(world):
    out = world["refusals"]
    assert "none manages them" in out["unmanaged"], out
    assert "dw_builder" in out["dw_builder"], out
    assert "two pipelines" in out["two_pipelines"], out


THREE_D_STAGES = (1, 3)


@pytest.fixture(scope="module")
def world_3d():
    return run_world(three_d_checks, 8, THREE_D_STAGES)[0]


@pytest.mark.full_only  # --quick: the 2-D world (each part's TP is test_tensor_parallel_world's)
@pytest.mark.parametrize("plan", ("plan1", "plan2"))
@pytest.mark.parametrize("stage", THREE_D_STAGES)
def test_dp_tp_pp_trains_like_single_process(world_3d, plan, stage):
    """Each part split by torch's TP over tp (plan 2: sequence parallel), zero over dp, pipelined over pp."""
    _like_fsdp2(world_3d[plan, stage], world_3d[plan, "fsdp2"], world_3d["reference"], f"3-D {plan} stage {stage}")
