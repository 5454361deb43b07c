"""Checkpoints of a pipeline (issue 48, part 8; ``pipeline_checkpoint_world``): every rank of a dp 2 x pp 2 pipeline
saves into one checkpoint of the whole model, under the whole model's names (one part per rank at stage 1, two parts
per rank under one optimizer at stage 3); it loads into the whole model in this process and continues, into pp 4 x
dp 1, into two parts per rank at dp 2 x pp 2, and into the whole model at dp 4; ``zero.consolidate`` gives one file.

Every load gives the saved values bit for bit. The 2 steps after it are held to single-process training of the whole
model for 4 steps (the run that never stopped): losses within ``LOSS_TOL``, parameters within ``PARAM_RTOL`` (relative
L2; the micro-batches sum the gradient in another order than one process: test_pipeline_world.py's noise floor,
~2e-6 after 3 steps).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import zero
from tests.distributed.harness import run_world
from tests.distributed.pipeline_checkpoint_world import (
    CLIP,
    LOADS,
    LR,
    MORE_STEPS,
    SAVED_STEPS,
    SAVES,
    batch,
    checkpoint_checks,
    model,
    reference,
    state,
)

LOSS_TOL = 1e-5
PARAM_RTOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_checkpoints")
    return root, run_world(checkpoint_checks, 4, str(root))[0]


@pytest.fixture(scope="module")
def uninterrupted():
    return reference(SAVED_STEPS + MORE_STEPS)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b))
    return num / math.sqrt(sum(float(b[k].pow(2).sum()) for k in b))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _close(run: dict, ref: dict, what: str) -> None:
    diff = rel_l2(run["params"], ref["params"])
    assert diff <= PARAM_RTOL, f"{what}: parameters {diff:.3g} off single-process training"
    gap = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][SAVED_STEPS:]))
    assert gap <= LOSS_TOL, f"{what}: losses {run['losses']} vs {ref['losses']}"


@pytest.mark.parametrize("saved", list(SAVES))
def test_one_checkpoint_of_the_whole_model(world, saved):
    """4 parts, named by rank over pp x dp; the whole model's names (no ModuleList index), each tensor written by the
    dp ranks of the pp rank holding it (format 2: AdamW, no TP)."""
    root, out = world
    meta = json.loads((root / saved / "metadata.json").read_text())
    assert (meta["format"], meta["world_size"]) == ("zero.checkpoint/2", 4)
    assert [f["name"] for f in meta["files"]] == [f"part-0000{r}-of-00004.safetensors" for r in range(4)]
    whole = model(0).state_dict()
    assert list(meta["tensors"]) == list(whole), "the whole model's names, in its order"
    per_rank = SAVES[saved][1]
    for name, record in meta["tensors"].items():
        stage = 0 if name.startswith("tok_") else 3 if not name.startswith("layers.") else int(name.split(".")[1])
        pp_rank = stage % 2 if per_rank == 2 else stage // 2
        assert {piece[0] // 2 for piece in record["pieces"]} == {pp_rank}, (name, record["pieces"])
    assert same({k: v for k, v in zero.load_consolidated(_export(root, saved)).items()}, out["saved"][saved]["params"])


def _export(root, saved: str):
    out = root / f"{saved}-export"
    if not out.exists():
        files = zero.consolidate(root / saved, out, progress=False)
        assert [f.name for f in files] == ["model.safetensors"]
    return out


def test_saves_train_like_single_process(world, uninterrupted):
    """The saved runs themselves (2 steps at dp 2 x pp 2) are single-process training."""
    _, out = world
    ref = reference(SAVED_STEPS)
    for name, run in out["saved"].items():
        assert rel_l2(run["params"], ref["params"]) <= PARAM_RTOL, name
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= LOSS_TOL, name


@pytest.mark.parametrize("load", list(LOADS))
def test_loads_at_other_pp_and_dp_degrees_and_continues(world, uninterrupted, load):
    """The saved values bit for bit, then 2 steps equal to the run that never stopped."""
    _, out = world
    run = out[load]
    assert same(run["loaded"], out["saved"][LOADS[load][0]]["params"]), load
    _close(run, uninterrupted, load)


@pytest.mark.parametrize("stage", (0, 2))
@pytest.mark.parametrize("saved", list(SAVES))
def test_loads_into_the_whole_model_in_one_process_and_continues(world, uninterrupted, saved, stage):
    """Saved under pp 2, loaded at pp 1 into the whole model (one process, a ZeroOptimizer of one rank) and trained
    on: single-process training within 1e-5."""
    root, out = world
    whole = model(1)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(whole.parameters(), lr=LR), whole, stage=stage)
    zero.load_checkpoint(root / saved, whole, opt, progress=False)
    assert same(state(whole), out["saved"][saved]["params"])
    losses = []
    for step in range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS):
        loss = whole.loss(*batch(step))
        loss.backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    _close({"params": state(whole), "losses": losses}, uninterrupted, f"{saved} at stage {stage}")


def test_weights_only_into_a_plain_model_and_its_parts(world):
    """``load_checkpoint(path, plain_model)`` in one process; and into the whole model's parts, given as a list."""
    root, out = world
    plain = model(2)
    zero.load_checkpoint(root / "interleaved", plain, progress=False)
    assert same(state(plain), out["saved"]["interleaved"]["params"])
    parts = zero.models.pipeline_parts(model(3), 3)
    zero.load_checkpoint(root / "1f1b", parts, progress=False)
    assert same({k: v for part in parts for k, v in state(part).items()}, out["saved"]["1f1b"]["params"])


def test_refusals(world):
    """A buffer every part keeps is written once; one parameter on two pp ranks, a shared buffer of other values, and
    parts under other param groups are refused at save, naming the cause; a part loaded before its optimizer knows
    the pipeline is refused, saying how to tell it."""
    root, out = world
    refused = out["refusals"]
    assert refused["shared_buffer"] == ""
    meta = json.loads((root / "shared" / "metadata.json").read_text())
    assert sorted(meta["tensors"]) == ["freqs", "layers.0.bias", "layers.0.weight", "layers.1.bias",
                                       "layers.1.weight"]
    assert "pp ranks 0 and 1 both hold 'layers.0." in refused["same_parameter"], refused["same_parameter"]
    assert "hold different values of 'freqs'" in refused["other_buffer"], refused["other_buffer"]
    assert "other optimizers or param groups" in refused["other_optimizer"], refused["other_optimizer"]
    assert "build its zero.pipelining.PipelineStage, before loading" in refused["part_without_pipeline"]
    assert not (root / "same").exists() and not (root / "same.partial").exists()
