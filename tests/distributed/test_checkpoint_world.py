"""Portable checkpoints across world sizes and stages, in real gloo worlds (``checkpoint_world``).

Saved at N=3, stage 2, after 6 steps; resumed at (N=3, stage 2), (N=3, stage 1), (N=2, stage 3, also with its
parameters and optimizer offloaded to disk) and (N=1, stage 0) with other initial weights, and trained 6 more
steps: each must equal the run
that went on without saving. At N=3 it is the same arithmetic, so the numbers are bit-identical.
At N=2 and N=1 the gradients are summed over other partitions of the batch, so they differ by
rounding; losses are held to the suite's fp32 tolerance (1e-5 relative), and parameters to the
noise that Adam makes of that rounding (see ``test_parity_world.py``'s docstring): relative L2 norm 1e-4.

Several optimizers and whole-parameter ones (Muon + AdamW, Adafactor, SOAP), at the end: saved at N=2, resumed per
rank at N=2 and through the portable checkpoint at N=1, 2 and 3, at other stages: bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.checkpoint_world import (
    MODELS,
    RESUMES,
    SAVED_AT,
    STAGE0,
    WHOLE_RECIPES,
    killed_mid_save,
    resume_whole_world,
    resume_world,
    save_and_continue,
    save_whole_world,
    whole_missing,
)
from tests.distributed.harness import run_world, run_world_outcomes
from tests.distributed.worlds import build_model
from tests.readouts import flat_params
from zero import load_checkpoint
from zero.checkpoint.portable.reader import Checkpoint

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("portable"))
    results = run_world(save_and_continue, 3, root)[0]
    results.update(run_world(resume_world, 2, root, 3, True)[0])
    results.update(run_world(resume_world, 1, root, 0)[0])
    return results


@pytest.mark.full_only  # --quick: checkpoints are covered by the unit tests
@pytest.mark.parametrize("kind", MODELS)
def test_same_world_size_resumes_bit_identical(resumed, kind):
    ref = resumed[(kind, "reference")]
    for mode in ("resumed2", "resumed1"):
        got = resumed[(kind, mode)]
        assert got["losses"] == ref["losses"], mode
        assert torch.equal(got["params"], ref["params"]), mode
        assert got["lr"] == ref["lr"], mode  # the LR schedule resumed where it was


@pytest.mark.full_only  # --quick: checkpoints are covered by the unit tests
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize(
    "mode", ["resumed3", "resumed3-disk", "resumed0"], ids=["N2-stage3", "N2-stage3-disk", "N1-stage0"]
)
def test_other_world_sizes_and_stages_resume(resumed, kind, mode):
    ref, got = resumed[(kind, "reference")], resumed[(kind, mode)]
    assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    assert got["lr"] == ref["lr"]
    rel = float((got["params"] - ref["params"]).norm() / ref["params"].norm())
    print(f"{kind} {mode}: relative L2 {rel:.2e}, "
          f"loss max rel {max(abs(a / b - 1) for a, b in zip(got['losses'], ref['losses'])):.1e}")
    assert rel <= PARAM_RTOL, rel
    assert not torch.equal(got["params"], torch.zeros_like(got["params"]))


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    outcomes = run_world_outcomes(killed_mid_save, 2, str(tmp_path), timeout_s=300)
    assert outcomes[1].get("exitcode") == 17 or "ok" not in outcomes[1], outcomes[1]
    rank0 = outcomes[0]["ok"]
    assert rank0["error"] is not None and "writing its part" in rank0["error"], rank0["error"]
    print("rank 0:", rank0["error"])
    path = tmp_path / "ckpt"
    assert (tmp_path / "ckpt.partial").is_dir()  # the unfinished save, never renamed into place
    with pytest.raises(ValueError, match="never finished"):
        Checkpoint(tmp_path / "ckpt.partial")
    model = build_model(seed=1)
    load_checkpoint(path, model, progress=False)  # the earlier checkpoint, whole
    got = flat_params(model)
    assert torch.equal(got, rank0["saved"])


# ----- several optimizers and whole-parameter ones (issue 42): saved at N=2, resumed at N=1, 2, 3 ----------------
#
# Every run below must equal the N=2 run that never stopped, bit for bit (``checkpoint_world``'s exact-share hooks
# make the reduced gradient the same bits at every world size; each world's own uninterrupted run checks that).


@pytest.fixture(scope="module")
def saved_whole(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    return root, run_world(save_whole_world, SAVED_AT, str(root))


@pytest.fixture(scope="module", params=[1, 3], ids=lambda n: f"world{n}")
def resumed_whole(request, saved_whole):
    root, _ = saved_whole
    return request.param, run_world(resume_whole_world, request.param, str(root))


def _recipes(results: list[dict]) -> list[str]:
    recipes = sorted({recipe for recipe, _ in results[0]} - {STAGE0})
    missing = [r for r in WHOLE_RECIPES if whole_missing(r)]
    print(f"recipes {recipes}" + (f"; left out: {missing}" if missing else ""))
    assert "muon_adamw" in recipes or whole_missing("muon_adamw")
    return recipes


def _same_run(got: dict, ref: dict, what: str) -> None:
    assert got["losses"] == ref["losses"], what
    assert torch.equal(got["params"], ref["params"]), (what, float((got["params"] - ref["params"]).abs().max()))
    assert got["lr"] == ref["lr"], what  # the LR schedule resumed where it was


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    return a == b


def test_per_rank_state_dicts_of_several_optimizers_resume_bit_for_bit(saved_whole):
    _, results = saved_whole
    for recipe in _recipes(results):
        ref = results[0][(recipe, "reference")]
        for rank, result in enumerate(results):
            assert torch.equal(result[(recipe, "reference")]["params"], ref["params"])  # the ranks agree
            _same_run(result[(recipe, "per-rank")], ref, f"{recipe} rank {rank}: per-rank state_dict")
            _same_run(result[(recipe, "uninterrupted")], ref, f"{recipe} rank {rank}: the run again")
            shard = result[(recipe, "saved")]["shard"]
            assert shard["format"] == "zero.shard/2" and [i["path"] for i in shard["inners"]] == (
                ["whole", "flat"] if recipe == "muon_adamw" else ["whole"])


def test_whole_state_is_written_by_its_owner_in_the_parameters_shape(saved_whole):
    root, results = saved_whole
    for recipe in _recipes(results):
        meta = json.loads((root / recipe / "metadata.json").read_text())
        owners = results[0][(recipe, "saved")]["owners"]
        states = {name: s for result in results for name, s in result[(recipe, "saved")]["states"].items()}
        assert set(owners) == set(states)  # every whole parameter got a gradient, so has state
        assert len(set(owners.values())) == SAVED_AT  # both ranks own some
        for name, owner in owners.items():
            record = meta["tensors"][name]["whole_state"]
            assert record["file"] == owner, (recipe, name)  # written by the rank that owns it
            entries = meta["files"][owner]["entries"]
            shapes = {key.split("/", 2)[2]: entries[key][1] for key in record["keys"]}
            saved = {k: list(v.shape) for k, v in states[name].items() if isinstance(v, torch.Tensor)}
            if recipe != "soap":  # (SOAP keeps lists of matrices: "Q[0]", ...)
                assert shapes == saved, (recipe, name)
            if recipe == "muon_adamw":
                assert shapes == {"momentum_buffer": list(meta["tensors"][name]["shape"])}
            if recipe == "adafactor" and len(meta["tensors"][name]["shape"]) == 2:
                m, n = meta["tensors"][name]["shape"]
                assert shapes == {"step": [], "row_var": [m, 1], "col_var": [1, n]}
        consolidated = Checkpoint(root / recipe)  # values only, as zero.consolidate reads them
        with consolidated:
            values = torch.cat([consolidated.read_whole(name).flatten() for name in consolidated.tensors
                                if consolidated.tensors[name].kind == "param"])
        assert torch.equal(values, results[0][(recipe, "saved")]["params"])


def test_resumed_at_another_stage_bit_for_bit(saved_whole):
    root, results = saved_whole
    for recipe in _recipes(results):
        for rank, result in enumerate(results):
            for stage in RESUMES[SAVED_AT]:
                _same_run(result[(recipe, f"resumed{stage}")], results[0][(recipe, "reference")],
                          f"{recipe} rank {rank}: N={SAVED_AT} stage {stage}")
    if whole_missing("muon_adamw") is None:  # saved at stage 0: rank i mod N wrote the i-th whole parameter
        meta = json.loads((root / STAGE0 / "metadata.json").read_text())
        files = [meta["tensors"][name]["whole_state"]["file"] for name in ("up.weight", "mid.weight", "down.weight")]
        assert files == [0, 1, 0]
        for rank, result in enumerate(results):
            _same_run(result[(STAGE0, "resumed1")], results[0][("muon_adamw", "reference")], f"stage 0 rank {rank}")


def test_resumed_at_another_world_size_bit_for_bit(saved_whole, resumed_whole):
    _, saved = saved_whole
    world_size, results = resumed_whole
    for recipe in _recipes(saved):
        ref = saved[0][(recipe, "reference")]
        states = {name: s for result in saved for name, s in result[(recipe, "saved")]["states"].items()}
        for rank, result in enumerate(results):
            _same_run(result[(recipe, "uninterrupted")], ref, f"{recipe} N={world_size} rank {rank}: the run again")
            if recipe == "muon_adamw":
                stage = RESUMES[world_size][-1]
                _same_run(result[(STAGE0, f"resumed{stage}")], ref, f"saved at stage 0, N={world_size} rank {rank}")
            for stage in RESUMES[world_size]:
                got = result[(recipe, f"resumed{stage}")]
                _same_run(got, ref, f"{recipe} N={world_size} stage {stage} rank {rank}")
                mine = {name for name, owner in got["owners"].items() if owner == (rank if stage else 0)}
                assert set(got["states"]) == mine, (recipe, stage, rank)  # loaded where it is owned now
                assert all(_same_state(got["states"][name], states[name]) for name in mine), (recipe, stage, rank)
        if world_size > 1:
            moved = [n for n, o in results[0][(recipe, f"resumed{RESUMES[world_size][-1]}")]["owners"].items()
                     if o != saved[0][(recipe, "saved")]["owners"][n]]
            print(f"{recipe}: {len(moved)} whole parameters changed owner from N={SAVED_AT} to N={world_size}")
            assert moved
