"""Hugging Face Trainer and Accelerate with ZeroOptimizer at stages 0-3 in a real 2-rank gloo world, against the
same Trainer / Accelerate loop with DDP (``integrations_world``): GPT-2 from a config, AdamW with weight-decay
groups, a linear or step LR schedule, clipping at 0.5 and 2 accumulation micro-batches per step. And both at
stage 3 with hierarchical sharding (HSDP and ZeRO++'s hpZ), 4 ranks in 2 groups of 2, against DDP at 4 ranks.

Tolerances as in ``test_parity_world.py``: losses 1e-5 relative, gradient norms 1e-6 relative (the same gradients,
summed in another order). ``--quick`` runs part of each world (``integrations_world.QUICK_STAGES`` and
``QUICK_HIERARCHICAL``; the other stages' tests are ``full_only``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.integrations_world import (
    QUICK_HIERARCHICAL,
    QUICK_STAGES,
    STAGES,
    STEPS,
    accelerate_runs,
    hierarchical_runs,
    trainer_runs,
)
from tests.quick import full_only_beyond, is_quick

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-6


# (--quick: each world runs part of its matrix, tests/quick.py)
@pytest.fixture(scope="module")
def trainer(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    quick = (QUICK_STAGES["trainer"],) if is_quick(request) else ()
    return run_world(trainer_runs, 2, str(root), *quick)[0], root


@pytest.fixture(scope="module")
def hierarchical(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("hierarchical")
    quick = (QUICK_HIERARCHICAL,) if is_quick(request) else ()
    return run_world(hierarchical_runs, 4, str(root), *quick), root


@pytest.fixture(scope="module")
def accelerated(request, tmp_path_factory):
    quick = (QUICK_STAGES["accelerate"],) if is_quick(request) else ()
    return run_world(accelerate_runs, 2, str(tmp_path_factory.mktemp("accelerate")), *quick)[0]


@pytest.mark.parametrize("stage", full_only_beyond(STAGES, QUICK_STAGES["trainer"]))
def test_trainer_equals_the_ddp_trainer(trainer, stage):
    runs, _ = trainer
    assert stage in runs["stages"]
    ours, ddp = runs[f"stage{stage}"], runs["ddp"]
    assert runs["ddp_wrapped"] == "DistributedDataParallel"
    assert runs[f"stage{stage}_wrapped"] == "GPT2LMHeadModel"  # never wrapped in DDP
    assert len(ours["loss"]) == len(ours["grad_norm"]) == STEPS
    assert ours["loss"] == pytest.approx(ddp["loss"], rel=LOSS_RTOL)
    assert ours["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=NORM_RTOL)  # the global norm, logged
    assert max(ours["grad_norm"]) > 0.5  # clipping at 0.5 was active
    assert runs[f"stage{stage}_eval"] == pytest.approx(runs["ddp_eval"], rel=LOSS_RTOL)  # trainer.evaluate()


def test_trainer_checkpoint_resumes_at_another_stage_and_exports(trainer):
    runs, root = trainer
    saving, resumed = runs["saving"], runs["resumed"]  # saved at step 2 by stage 2; resumed by stage 3
    assert resumed["loss"][2:] == pytest.approx(saving["loss"][2:], rel=LOSS_RTOL)
    assert resumed["grad_norm"][2:] == pytest.approx(saving["grad_norm"][2:], rel=NORM_RTOL)
    assert (root / "ckpt" / "checkpoint-2" / "zero_checkpoint" / "metadata.json").is_file()
    assert not (root / "final" / "zero_checkpoint").exists()  # save_model keeps only the export
    loaded = transformers.GPT2LMHeadModel.from_pretrained(root / "final")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    state = loaded.state_dict()
    for name, value in runs["gathered"].items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("stage", full_only_beyond(STAGES, QUICK_STAGES["accelerate"]))
def test_accelerate_helper_equals_ddp(accelerated, stage):
    assert stage in accelerated["stages"]
    ours, ddp = accelerated[f"stage{stage}"], accelerated["ddp"]
    assert ddp["wrapped"] == "DistributedDataParallel" and ours["wrapped"] == "GPT2LMHeadModel"
    assert len(ours["norms"]) == STEPS and len(ours["losses"]) == 2 * STEPS
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL)
    assert ours["norms"] == pytest.approx(ddp["norms"], rel=NORM_RTOL)


def test_accelerate_save_state_and_load_state(accelerated):
    saving, resumed = accelerated["saving"], accelerated["resumed"]  # saved after step 2 at stage 2; stage 3 resumes
    assert resumed["losses"] == pytest.approx(saving["losses"][4:], rel=LOSS_RTOL)
    assert resumed["norms"] == pytest.approx(saving["norms"][2:], rel=NORM_RTOL)


def test_trainer_and_accelerate_with_hierarchical_sharding_equal_ddp(hierarchical):
    """4 ranks in 2 shard groups of 2 through the user's paths: the Trainer (with its export) and Accelerate, with
    HSDP and with hpZ (under --quick: the Trainer with HSDP, Accelerate with hpZ)."""
    results, root = hierarchical
    assert [r["shard_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    runs = results[0]
    baselines = {"trainer": ("trainer_ddp", STEPS),  # (the Trainer runs 2 epochs of 2 steps at 4 ranks,
                 "accelerate": ("accelerate_ddp", STEPS // 2),  # the Accelerate loop one)
                 "trainer_hpz": ("trainer_ddp", STEPS),  # hpZ
                 "accelerate_hpz": ("accelerate_ddp", STEPS // 2)}
    ran = runs["paths"]  # every path; two under --quick (integrations_world.QUICK_HIERARCHICAL)
    assert ran
    for path in ran:
        baseline, steps = baselines[path]
        ours, ddp = runs[path], runs[baseline]
        losses, norms = ("loss", "grad_norm") if "loss" in ours else ("losses", "norms")
        assert len(ours[norms]) == steps and max(ours[norms]) > 0.5  # clipping at 0.5 was active
        assert ours[losses] == pytest.approx(ddp[losses], rel=LOSS_RTOL)
        assert ours[norms] == pytest.approx(ddp[norms], rel=NORM_RTOL)
    assert all(r[path] == runs[path] for r in results for path in ran)
    if "trainer_hpz" in ran:
        assert runs["hpz_gathers_inside"] > 0  # hpZ's backward gathered from the group's copies
    loaded = transformers.GPT2LMHeadModel.from_pretrained(root / "final").state_dict()
    for name, value in runs["gathered"].items():
        assert torch.equal(loaded[name], value), name
