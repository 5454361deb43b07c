"""What stage 3 adds, at world sizes 1, 2 and 3 (``stage3_world.stage3_checks``, on the parity world's model): its
traffic per step, a model built on meta, inference under ``no_grad``, ``torch.compile`` and Hugging Face models."""

from __future__ import annotations

import pytest

from tests.distributed.harness import world_fixture
from tests.distributed.stage3_world import stage3_checks

# --quick: all but torch.compile, most of the world's time (tests/unit/test_user_paths.py compiles at stage 3)
world = world_fixture(stage3_checks, quick_args=(False,))


def test_stage3_traffic_is_three_psi_or_two_when_kept_for_backward(world):
    """Stage 3 gathers every unit for forward and again for backward (3Ψ with the reduce-scatter),
    except the two that backward needs as soon as forward ends, which stay gathered: the root
    unit and the unit that ran last (ParityNet's ``twice``, called twice in a row, gathered once).
    With reshard_after_forward=False every unit is gathered once (2Ψ). The frozen parameter is
    sharded too (a frozen bucket of the root unit): gathered with its unit, never reduced."""
    world_size, results = world
    for rank_result in results:
        for reshard in (True, False):
            run = rank_result["traffic3"][reshard]
            stats, padded, units = run["comm_stats"], run["padded_numel"], run["unit_numel"]
            gathered, buckets = run["gathered_numel"], run["unit_buckets"]
            assert buckets[""] == 2 and gathered > padded  # the root's trainable and frozen buckets
            if world_size == 1:
                assert "all_gather" not in stats and "reduce_scatter" not in stats
                continue
            assert stats["reduce_scatter"]["numel"] == padded
            assert stats["reduce_scatter"]["calls"] == len(units)
            if reshard:
                assert stats["all_gather"]["numel"] == 2 * gathered - units[""] - units["twice.0"]
                assert stats["all_gather"]["calls"] == 2 * sum(buckets.values()) - buckets[""] - buckets["twice.0"]
            else:
                assert stats["all_gather"]["numel"] == gathered
                assert stats["all_gather"]["calls"] == sum(buckets.values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models_train_at_stage3_like_single_process(world, family):
    pytest.importorskip("transformers")
    _, results = world
    for r in results:
        assert r[family] is not None, "transformers is installed but the world could not import it"
        assert r[family]["zero"] <= 2 * r[family]["ddp"]


def test_meta_built_model_gets_the_weights_of_a_normal_build(world):
    _, results = world
    for r in results:
        assert r["meta_init"] == 0.0


def test_stage3_inference_under_no_grad(world):
    _, results = world
    for r in results:
        assert r["inference"]["max_diff"] == 0.0
        assert r["inference"]["gathered_after"] == 0  # nothing stays gathered after a no_grad forward


@pytest.mark.full_only  # (--quick: test_user_paths.py's test_torch_compile_at_stage_3, one process, compiles)
def test_stage3_under_torch_compile_trains_like_eager(world):
    """``torch.compile(model)`` at stage 3: the gathering hooks run eagerly, the units compile (at 2 ranks: see
    ``stage3_world.stage3_checks``)."""
    world_size, results = world
    if world_size != 2:
        pytest.skip("compiled at 2 ranks")
    for r in results:
        assert r["compiled3"] <= 1e-6
