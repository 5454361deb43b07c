"""Hierarchical sharding (``ZeroConfig.communication.shard_size``, FSDP2's HSDP) in a real gloo world of 4 ranks laid
out as 2 shard groups of 2, and ZeRO++'s quantized codecs on top of it (see ``hierarchy_world`` for what each rank
runs).

Exact: stages 1-3 with ``shard_size=2`` train to the single-process reference's numbers with the tolerances of
``test_parity_world.py`` (losses 1e-5 relative, SGD parameters 1e-5 absolute, Adam within twice DDP's own distance), on
every rank alike. The layout is the device mesh's (groups of consecutive ranks); each rank holds 1/shard_size of the
model; parameters are never gathered across groups, and each reduce-scatter's shard is all-reduced across them. A
checkpoint saved by the hierarchical run is a 2-rank world's, and a flat 4-rank stage-2 run resumes from it exactly.
Quantized (lossy) on top: the gathers outside training (``gathered_parameters()``, ``close()``) stay exact. The
estimator's traffic equals ``opt.comm_stats`` (HSDP and hpZ), and it plans hpZ's secondary copies as the runtime does.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.hierarchy_world import (
    QUICK_MATRIX,
    QUICK_TRAFFIC,
    SCENARIOS,
    SHARD_SIZE,
    WORLD_SIZE,
    hierarchy_checks,
)
from tests.distributed.traffic_world import (
    BUCKET_MB,
    CFG,
    HIERARCHY_CASES,
    HPZ_CASES,
    estimated_stats,
    gpt_workload,
)
from tests.distributed.worlds import BUCKET_MB as LAYOUT_BUCKET_MB
from tests.distributed.worlds import build_model
from tests.quick import full_only_beyond, is_quick
from tests.readouts import max_diff
from zero.estimator import Workload

LOSS_RTOL = 1e-5
SGD_ATOL = 1e-5
QUANTIZED_LOSS_RTOL = 0.02  # six Adam steps on int8 weights and gradients: observed within 0.6%


@pytest.fixture(scope="module")
def hierarchy_world(request, tmp_path_factory):
    quick = (QUICK_MATRIX, QUICK_TRAFFIC) if is_quick(request) else ()  # (--quick: part of the matrix, tests/quick.py)
    return run_world(hierarchy_checks, WORLD_SIZE, str(tmp_path_factory.mktemp("hsdp")), *quick, timeout_s=600)


@pytest.mark.parametrize("kind,scenario", SCENARIOS, ids=lambda x: x)
def test_hierarchical_stages_train_like_single_process(hierarchy_world, kind, scenario):
    runs = hierarchy_world[0]["parity"]
    ref = runs[(kind, scenario, "reference")]
    stages = hierarchy_world[0]["matrix"][(kind, scenario)]  # stages 1-3 and hpZ's runs; fewer under --quick
    assert stages
    for stage in stages:
        ours = runs[(kind, scenario, stage)]
        for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"], strict=True)):
            assert a == pytest.approx(b, rel=LOSS_RTOL), f"stage {stage}, step {step}"
        if kind == "sgd":
            assert max_diff(ours["params"], ref["params"]) <= SGD_ATOL, stage
        else:
            ddp_noise = float((runs[(kind, scenario, "ddp")]["params"] - ref["params"]).norm())
            assert float((ours["params"] - ref["params"]).norm()) <= 2 * ddp_noise, stage
        assert ours["losses"][-1] < ours["losses"][0]  # it trained
        for rank, other in enumerate(hierarchy_world[1:], start=1):
            assert torch.equal(other["parity"][(kind, scenario, stage)]["params"], ours["params"]), (stage, rank)


def test_layout_follows_the_mesh(hierarchy_world):
    for rank, result in enumerate(hierarchy_world):
        layout = result["layout"]
        first = rank - rank % SHARD_SIZE
        assert layout["groups"][rank] == list(range(first, first + SHARD_SIZE))
        assert layout["group_rank"] == rank % SHARD_SIZE and layout["group_size"] == SHARD_SIZE
        assert layout["data_parallel_size"] == WORLD_SIZE
        assert layout["shard_numel"] * SHARD_SIZE == layout["padded_numel"]  # 1/shard_size, not 1/world_size


def test_parameters_never_cross_groups_and_each_gradient_shard_is_all_reduced_across_them(hierarchy_world):
    for result in hierarchy_world:
        stats = result["layout"]["stats"]
        assert "inter_all_gather" not in stats and "inter_reduce_scatter" not in stats
        assert stats["all_gather"]["numel"] > 0
        # one all-reduce across groups per reduce-scatter, of the chunk this rank keeps
        assert stats["inter_all_reduce"]["calls"] == stats["reduce_scatter"]["calls"] + 1  # + the agreement's flags
        flags = stats["all_reduce"]["numel"] // stats["all_reduce"]["calls"]
        assert stats["inter_all_reduce"]["numel"] == stats["reduce_scatter"]["numel"] // SHARD_SIZE + flags


def test_hpz_shards_over_every_rank_and_keeps_a_secondary_copy_over_the_group(hierarchy_world):
    for rank, result in enumerate(hierarchy_world):
        layout = result["layout_hpz"]
        first = rank - rank % SHARD_SIZE
        assert layout["groups"][rank] == list(range(WORLD_SIZE))  # the runtime shards over every rank
        assert layout["group_size"] == layout["data_parallel_size"] == WORLD_SIZE
        assert layout["shard_numel"] * WORLD_SIZE == layout["padded_numel"]
        assert layout["secondary_numel"] * SHARD_SIZE == layout["padded_numel"]  # the extra memory: 1/shard_size
        assert layout["secondary_group"] == list(range(first, first + SHARD_SIZE))
        assert result["layout"]["secondary_group"] is None  # (HSDP has none)
    # the estimator plans the same copies (fp32): what it adds to the parameters' memory
    work = Workload(build_model, lambda model: None, lambda micro: ())
    planned = work.layout(3, WORLD_SIZE, bucket_size_mb=LAYOUT_BUCKET_MB, secondary_shards=SHARD_SIZE)
    assert sum(b.secondary for b in planned.buckets) == 4 * hierarchy_world[0]["layout_hpz"]["secondary_numel"]


def test_hpz_gathers_for_backward_inside_the_group(hierarchy_world):
    for result in hierarchy_world:
        flat, hpz = result["flat_stats"], result["layout_hpz"]["stats"]
        assert "intra_all_gather" not in flat
        # forward gathers every unit across the groups once; backward's gathers (all but the root unit, which stays
        # gathered) move inside the group: together the flat layout's gathers, of which fewer cross groups
        assert hpz["all_gather"]["numel"] + hpz["intra_all_gather"]["numel"] == flat["all_gather"]["numel"]
        assert 0 < hpz["intra_all_gather"]["numel"] < hpz["all_gather"]["numel"]
        assert hpz["reduce_scatter"] == {**flat["reduce_scatter"], "wait_s": hpz["reduce_scatter"]["wait_s"]}


def test_hpz_over_groups_of_one_is_the_flat_layout(hierarchy_world):
    """As DeepSpeed's zero_hpz_partition_size=1 (off): no secondary copy, every gather over every rank."""
    for result in hierarchy_world:
        layout = result["layout_hpz1"]
        assert layout["secondary_group"] is None and layout["secondary_numel"] == 0
        assert layout["group_size"] == WORLD_SIZE
        assert {k: v["numel"] for k, v in layout["stats"].items()} == {
            k: v["numel"] for k, v in result["flat_stats"].items()}


def test_hpz_resumes_from_its_own_checkpoint(hierarchy_world):
    for result in hierarchy_world:
        assert max_diff(result["resume_hpz"]["straight"], result["resume_hpz"]["resumed"]) <= SGD_ATOL


def test_a_hierarchical_checkpoint_is_a_group_sized_world_and_resumes_flat(hierarchy_world):
    saved = {r["resume"]["saved"] for r in hierarchy_world}
    assert len(saved) == 1  # every rank returns the same path
    files = hierarchy_world[0]["resume"]["files"]
    assert [f for f in files if f.startswith("part-")] == [f"part-{r:05d}-of-{SHARD_SIZE:05d}.safetensors"
                                                           for r in range(SHARD_SIZE)]
    for result in hierarchy_world:
        assert max_diff(result["resume"]["straight"], result["resume"]["resumed"]) <= SGD_ATOL


def test_quantized_hierarchical_training_is_close_and_sends_int8(hierarchy_world):
    for result in hierarchy_world:
        q = result["quantized"]
        for a, b in zip(q["losses"], q["plain_losses"], strict=True):
            assert a == pytest.approx(b, rel=QUANTIZED_LOSS_RTOL)
        assert q["losses"] != q["plain_losses"]  # lossy indeed
        stats = q["stats"]
        for kind in ("all_gather", "reduce_scatter"):  # int8 plus a scale per 64 elements, some block padding
            assert 0.25 < stats[kind]["bytes"] / (4 * stats[kind]["numel"]) < 0.35, (kind, stats[kind])
        # across groups too: each shard's sum as int8 (an all-to-all, then an all-gather of the sums), and the flags
        assert 0.5 < stats["inter_all_reduce"]["bytes"] / (4 * stats["inter_all_reduce"]["numel"]) < 0.65


def test_gathers_outside_training_are_exact_under_quantized_weights(hierarchy_world):
    for result in hierarchy_world:
        q = result["quantized"]
        assert torch.equal(q["before"], q["initial"])  # after a forward left int8 copies gathered
        assert torch.equal(q["closed"], q["after"])  # close() gives back the masters, not int8 copies


def _case_id(i: int) -> str:
    stage, precision, communication = HIERARCHY_CASES[i]
    return "-".join([f"stage{stage}", precision, *(f"{k}={v}" for k, v in communication.items())])


@pytest.mark.parametrize("case", full_only_beyond(range(len(HIERARCHY_CASES)), QUICK_TRAFFIC, _case_id))
def test_the_estimator_prices_each_levels_traffic_exactly(hierarchy_world, case):
    """``zero.estimate``'s traffic (``traffic_world``): calls, elements and bytes on the wire of every kind, inside
    the groups and across them (``inter_<kind>``), equal ``opt.comm_stats``' of a steady step on every rank."""
    stage, precision, communication = HIERARCHY_CASES[case]
    expected = estimated_stats(gpt_workload(CFG), stage=stage, world_size=WORLD_SIZE, precision=precision,
                               bucket_size_mb=BUCKET_MB, communication=communication)
    if communication.get("shard_size"):
        assert {"inter_all_reduce", "all_gather", "reduce_scatter"} <= set(expected)  # both levels priced
    for rank, result in enumerate(hierarchy_world):
        assert result["traffic"][case] == expected, (rank, HIERARCHY_CASES[case])


@pytest.mark.parametrize("case", range(len(HPZ_CASES)), ids=lambda i: "-".join(
    [HPZ_CASES[i][0], *(f"{k}={v}" for k, v in HPZ_CASES[i][1].items()), *(["checkpointed"] * HPZ_CASES[i][2])]))
def test_the_estimator_prices_hpz_traffic_exactly(hierarchy_world, case):
    """hpZ (``traffic_world.HPZ_CASES``): forward's gathers over every rank (plain ``all_gather``, quantized when
    asked), backward's and recomputation's inside the group from the secondary copies (``intra_all_gather``, exact),
    gradients and flags over every rank: the estimate equals ``opt.comm_stats`` of a steady step on every rank."""
    precision, communication, checkpointing = HPZ_CASES[case]
    expected = estimated_stats(gpt_workload(CFG), stage=3, world_size=WORLD_SIZE, precision=precision,
                               bucket_size_mb=BUCKET_MB, communication=communication, checkpointing=checkpointing)
    assert {"all_gather", "intra_all_gather", "reduce_scatter", "all_reduce"} == set(expected)
    for rank, result in enumerate(hierarchy_world):
        assert result["traffic_hpz"][case] == expected, (rank, HPZ_CASES[case])



def test_an_error_on_one_rank_is_heard_in_every_group_when_asked(hierarchy_world):
    """The Trainer's export runs on rank 0 and its failure must reach every rank of every shard group (each group
    would otherwise go on, and wait for the failed rank in its next collective)."""
    for rank, result in enumerate(hierarchy_world):
        heard = result["heard"]
        assert heard["False"] == (rank if rank < 2 else "rank 1 failed while exporting: no space left" if rank == 2
                                  else "no space left")  # (inside a group: rank 1 of the second group)
        assert heard["True"] == ("no space left" if rank == 3 else "rank 3 failed while exporting: no space left")
        assert heard["shared"] == [0, 1, 2, 3]
