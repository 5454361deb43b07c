"""Portable checkpoints across world sizes and stages, in real gloo worlds (``checkpoint_world``).

Saved at N=3, stage 2, after 6 steps; resumed at (N=3, stage 2), (N=3, stage 1), (N=2, stage 3, also with its
parameters and optimizer offloaded to disk) and (N=1, stage 0) with other initial weights, and trained 6 more
steps: each must equal the run
that went on without saving. At N=3 it is the same arithmetic, so the numbers are bit-identical.
At N=2 and N=1 the gradients are summed over other partitions of the batch, so they differ by
rounding; losses are held to the suite's fp32 tolerance (1e-5 relative), and parameters to the
noise that Adam makes of that rounding (see ``test_world.py``'s docstring): relative L2 norm 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_world import MODELS, killed_mid_save, resume_world, save_and_continue
from tests.distributed.harness import run_world, run_world_outcomes
from tests.distributed.worlds import build_model
from tests.readouts import flat_params
from zero import load_checkpoint
from zero.checkpoint.files import Checkpoint

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
