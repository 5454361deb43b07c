"""Optimizers stepped on whole parameters (Muon + AdamW, Adafactor, LAMB, SOAP, an unknown one) at stages 0-3 and
world sizes 1-3, against single-process training on the global batch (what ``optimizers_world.optimizer_checks``
returned; one world per world size).

Tolerances: DDP's own deviation from the same reference, measured in the same world, is the noise floor.
Parameters: ``||ours - reference||_2 <= 2 * ||DDP - reference||_2 + 1e-6``; losses: each step within 5x DDP's
largest deviation + 1e-5 (1e-2 for SOAP). Muon orthogonalizes in bf16 (torch's Newton-Schulz), so a rounding-level
change of its input flips bf16 roundings: DDP's deviation is 1e-3 to 3e-2 (L2) at 2-3 ranks, against ~3e-7 for Adafactor
and ~1e-6 for LAMB; SOAP's eigendecompositions amplify rounding to ~0.5 (L2), and its losses by ~1e-3 at 3 ranks
even when DDP's happen not to move. The losses are the noisier statistic (observed up to 3.5x DDP's: Muon, clipped,
stage 3 at 3 ranks, where the clip's norm is summed in another order). So at two ranks, where a sum of two gradients
does not depend on its order, the runs without clipping must equal DDP's bit for bit (they do), which holds Muon and
SOAP to exactness too; at one rank they equal the reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.optimizers_world import CLIP, QUICK_MATRIX, STEPS, missing, optimizer_checks
from tests.distributed.worlds import build_model
from tests.quick import is_quick
from tests.readouts import flat_params

FACTOR, FLOOR = 2.0, 1e-6  # parameters: L2 within FACTOR x DDP's + FLOOR
LOSS_FACTOR, LOSS_FLOOR = 5.0, 1e-5  # losses (each step): a noisier statistic than the parameters' L2 norm
EIGEN_LOSS_FLOOR = 1e-2  # SOAP: one near-degenerate eigenbasis rounded otherwise moves a loss by ~1e-3
RUNS = [("muon_adamw", "plain"), ("adafactor", "plain"), ("lamb", "plain"), ("lamb_prenorm", "plain"),
        ("soap", "plain"), ("muon_adamw", "accum"), ("muon_adamw", "clip")]
ONE_OWNER = {"lamb_prenorm"}  # a global norm inside the step: all the optimizer's parameters on one owner


@pytest.fixture(scope="module", params=(1, 2, 3), ids=lambda n: f"world{n}")
def optimizers(request):
    world_size = request.param
    quick = (QUICK_MATRIX,) if is_quick(request) else ()  # (--quick: part of the matrix, tests/quick.py)
    return world_size, run_world(optimizer_checks, world_size, *quick)


def _stages(results: list, part: str, key: tuple | None = None) -> tuple[int, ...]:
    """The stages the world ran ``part`` at (``optimizers_world.MATRIX``; fewer under ``--quick``), never none."""
    stages = results[0]["matrix"][part] if key is None else results[0]["matrix"][part][key]
    assert stages
    return stages


def _norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm())


def _loss_gap(run: dict, ref: dict) -> float:
    return max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))


def _like_single_process(run: dict, ddp: dict, ref: dict, what: str, loss_floor: float = LOSS_FLOOR) -> None:
    """``run`` within twice DDP's deviation from the reference (parameters in L2, losses step by step)."""
    assert len(run["losses"]) == STEPS
    noise, diff = _norm(ddp["params"], ref["params"]), _norm(run["params"], ref["params"])
    assert diff <= FACTOR * noise + FLOOR, f"{what}: ||params - reference|| = {diff:.3g}, DDP's {noise:.3g}"
    loss_noise, loss_diff = _loss_gap(ddp, ref), _loss_gap(run, ref)
    assert loss_diff <= LOSS_FACTOR * loss_noise + loss_floor, f"{what}: losses off by {loss_diff:.3g}, DDP's " \
        f"{loss_noise:.3g}"


def _skip_missing(recipe: str) -> None:
    reason = missing(recipe)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("recipe,scenario", RUNS, ids=lambda x: x)
def test_whole_parameter_optimizers_train_like_single_process(optimizers, recipe, scenario):
    """Muon + AdamW as one ZeroOptimizer, Adafactor, LAMB, SOAP; Muon + AdamW also accumulating 4 micro-batches of 2
    under no_sync() against 1 micro-batch of 8 in one process, and clipped with clip_grad_norm_."""
    _skip_missing(recipe)
    world_size, results = optimizers
    runs = results[0]["runs"][(recipe, scenario)]
    ref, ddp = runs["reference"], runs["ddp"]
    for stage in _stages(results, "runs", (recipe, scenario)):
        ours = runs[f"stage{stage}"]
        _like_single_process(ours, ddp, ref, f"stage {stage}", EIGEN_LOSS_FLOOR if recipe == "soap" else LOSS_FLOOR)
        if world_size <= 2 and scenario != "clip":  # (a sum of two numbers does not depend on the order)
            assert torch.equal(ours["params"], ddp["params"]), f"stage {stage}: not DDP's numbers bit for bit"
        if world_size == 1 and scenario != "accum":  # (accumulation adds micro-batches' gradients: other rounding)
            assert torch.equal(ours["params"], ref["params"]), f"stage {stage}"
        for rank, other in enumerate(results[1:], start=1):  # every rank's view of the parameters agrees
            assert torch.equal(other["runs"][(recipe, scenario)][f"stage{stage}"]["params"], ours["params"]), rank
    assert _norm(ref["params"], flat_params(build_model())) > 1e-2  # (the steps moved the parameters)


@pytest.mark.parametrize("recipe,scenario", RUNS, ids=lambda x: x)
def test_each_whole_parameter_update_runs_once_per_step(optimizers, recipe, scenario):
    """Stages 1-3: every whole parameter with a gradient is updated by exactly one rank per step (the updates
    summed over ranks are the single-process count, under accumulation too: once per step, not per micro-batch),
    and each whole parameter has exactly one owner (spread over the ranks; all on one rank for a rule that reads
    several parameters at once); stage 0: every rank updates every one."""
    _skip_missing(recipe)
    world_size, results = optimizers
    expected = results[0]["runs"][(recipe, scenario)]["reference"]["whole_updates"]
    assert expected > 0
    stage0 = results[0]["runs"][(recipe, scenario)].get("stage0")  # (--quick runs most at one stage, not 0)
    for stage in _stages(results, "runs", (recipe, scenario)):
        updates = [r["runs"][(recipe, scenario)][f"stage{stage}"]["updates"] for r in results]
        owned = [r["runs"][(recipe, scenario)][f"stage{stage}"]["owned"] for r in results]
        if stage == 0:
            assert updates == [expected] * world_size
            assert len(set(owned)) == 1
        else:
            assert sum(updates) == expected, f"stage {stage}: {updates}"
            if stage0 is not None:  # (the owners' count, recipe-blind: Muon + AdamW's runs check it under --quick)
                assert sum(owned) == stage0["owned"]
            if world_size > 1 and recipe in ONE_OWNER:
                assert sorted(updates) == [0] * (world_size - 1) + [expected], f"stage {stage}: {updates}"
            elif world_size > 1:
                assert all(u > 0 for u in updates), f"stage {stage}: a rank computed no update {updates}"
                # pieces travelled to owners and back (small buckets split parameters over ranks)
                assert all(r["runs"][(recipe, scenario)][f"stage{stage}"]["all_to_all"] > 0 for r in results)
        if stage == 0 or world_size == 1:  # (one shard: nothing to exchange)
            assert all(r["runs"][(recipe, scenario)][f"stage{stage}"]["all_to_all"] == 0 for r in results)


def test_clipping_is_torch_clip_over_both_optimizers(optimizers):
    """clip_grad_norm_ clips the global norm over Muon's and AdamW's parameters, as torch's clip does over the
    single-process model: the first step's norm (the same gradients) to 1e-6, later ones within DDP's drift (as the
    losses: 5x, Muon's bf16 roundings)."""
    _skip_missing("muon_adamw")
    _, results = optimizers
    runs = results[0]["runs"][("muon_adamw", "clip")]
    ref, ddp = runs["reference"]["norms"], runs["ddp"]["norms"]
    assert len(ref) == STEPS and min(ref) > CLIP  # (it clipped every step)
    drift = max(abs(a - b) for a, b in zip(ddp, ref))
    for stage in _stages(results, "runs", ("muon_adamw", "clip")):
        ours = runs[f"stage{stage}"]["norms"]
        assert ours[0] == pytest.approx(ref[0], rel=1e-6)
        assert max(abs(a - b) for a, b in zip(ours, ref)) <= LOSS_FACTOR * drift + 1e-6, f"stage {stage}: {ours}"
        for other in results[1:]:
            assert other["runs"][("muon_adamw", "clip")][f"stage{stage}"]["norms"] == ours


def test_stage3_prefetch_and_optimizer_offload(optimizers):
    """Muon + AdamW with stage 3 prefetching 2 units, and with the optimizer offloaded (the owner's step on the host),
    train like single-process training (and like DDP bit for bit at two ranks)."""
    _skip_missing("muon_adamw")
    world_size, results = optimizers
    runs = results[0]["runs"][("muon_adamw", "plain")]
    variants = {"prefetch": results[0]["prefetch"], **{f"offload stage {s}": results[0]["offload"][s]
                                                        for s in _stages(results, "offload")}}
    for what, ours in variants.items():
        _like_single_process(ours, runs["ddp"], runs["reference"], what)
        if world_size <= 2:
            assert torch.equal(ours["params"], runs["ddp"]["params"]), what
    for other in results[1:]:
        assert torch.equal(other["prefetch"]["params"], results[0]["prefetch"]["params"])


def test_bf16_parameters_over_fp32_masters_like_the_hand_built_recipe(optimizers):
    """Muon + AdamW with bf16 parameters: the fp32 masters within twice DDP's deviation from the hand-built
    single-process recipe (bit for bit at one rank)."""
    _skip_missing("muon_adamw")
    world_size, results = optimizers
    bf16 = results[0]["bf16"]
    ref = bf16["reference"]
    noise = _norm(bf16["ddp"], ref)
    for stage in _stages(results, "bf16"):
        if world_size == 1:
            assert torch.equal(bf16[stage], ref), f"stage {stage}"
        else:
            assert _norm(bf16[stage], ref) <= FACTOR * noise, f"stage {stage}: {_norm(bf16[stage], ref)}, DDP's {noise}"
        for other in results[1:]:
            assert torch.equal(other["bf16"][stage], bf16[stage])


def test_unknown_optimizer_is_exact_and_silent_unless_declared_elementwise(optimizers):
    """An optimizer zero does not know (a per-tensor norm) is stepped on whole parameters: single-process numbers,
    no warning. Declared in ZeroConfig.elementwise_optimizers it steps flat slices, as declared: at several ranks
    the slices of a split parameter are normalized apart, so it trains to other numbers (at one rank a rank's
    slices are whole parameters, and the numbers are the same)."""
    world_size, results = optimizers
    unknown = results[0]["unknown"]
    runs = unknown["whole"]
    ref, ddp = runs["reference"], runs["ddp"]
    for stage in _stages(results, "unknown"):
        _like_single_process(runs[f"stage{stage}"], ddp, ref, f"stage {stage}")
    assert [r["unknown"]["warnings"] for r in results] == [[]] * world_size
    noise = _norm(ddp["params"], ref["params"])
    for stage in _stages(results, "declared"):
        declared = unknown["declared"][stage]
        assert declared["updates"] == 0  # (the flat path: nothing stepped whole)
        if world_size == 1:
            assert torch.equal(declared["params"], ref["params"])
        else:
            diff = _norm(declared["params"], ref["params"])
            assert diff > 1000 * noise + 1e-3, f"stage {stage}: declared elementwise, yet {diff:.3g} from the reference"
