"""Portable checkpoints of a tensor-parallel model across tp and dp degrees (issue 47, part 5;
``tensor_parallel_checkpoint_world``): saved at dp 2 x tp 2 (AdamW at stages 1 and 3, Muon + AdamW at stage 1),
loaded at dp 1 x tp 4 (the same plan, and plan 1 without sequence parallelism: plain norms where the checkpoint has
``Replicate()`` ones) and at dp 4 without tensor parallelism, at other stages, and in this process into a plain model
and through ``zero.consolidate``.

Every load gives the saved global values bit for bit: parameters, AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``
(the same boxes as the values), Muon's ``momentum_buffer`` (whole, in the global shape). The 2 AdamW steps after it
are held to the single-process run of 4 steps: losses within ``LOSS_TOL``; parameters within ``PARAM_RTOL`` (relative
L2, the suite's tolerance across world sizes: ``test_checkpoint_world.py``) and within ``FACTOR`` times the deviation
of the run that never stopped (dp 2 x tp 2 for 4 steps), and within ``RESUME_RTOL`` of that run. Parameters cannot be
held to 1e-5 of one process: AdamW turns rounding into whole steps where a gradient is zero in exact arithmetic (the
attention's key biases: softmax does not see them), so any run that sums in another order than one process, the one
that never stopped included, is ~2.4e-5 off (``test_tensor_parallel_world.py`` has the same noise floor for
FSDP2 + TP).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import zero
from tests.checkpoints import rewrite_metadata
from tests.distributed.harness import run_world
from tests.distributed.tensor_parallel_checkpoint_world import (
    LOADS,
    QUICK_LOADS,
    QUICK_SAVED,
    SAVED,
    STATE,
    _model,
    checkpoint_checks,
)
from tests.quick import full_only_beyond, is_quick

ADAMW = [name for name, (saved, *_) in LOADS.items() if not SAVED[saved][1]]  # the loads that train on

LOSS_TOL = 1e-5
PARAM_RTOL = 1e-4
FACTOR, FLOOR = 2.0, 1e-6
RESUME_RTOL = 1e-5  # from the run that never stopped (measured 5-7e-6: the 2 steps after the load, summed otherwise)


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_checkpoints")
    quick = (QUICK_SAVED, QUICK_LOADS) if is_quick(request) else ()
    return root, run_world(checkpoint_checks, 4, str(root), *quick)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("saved", full_only_beyond(SAVED, QUICK_SAVED))
def test_format_boxes_and_parts(world, saved):
    """Format 4, 4 parts named by rank over dp x tp; a sharded tensor is one box per tp rank, a replicated one (a
    Replicate() norm under sequence parallelism) one box, written by tp rank 0 only (even parts)."""
    root, _ = world
    meta = json.loads((root / str(saved) / "metadata.json").read_text())
    assert (meta["format"], meta["world_size"], meta["tensor_parallel"]) == ("zero.checkpoint/4", 4, 2)
    assert [f["name"] for f in meta["files"]] == [f"part-0000{r}-of-00004.safetensors" for r in range(4)]
    tensors = meta["tensors"]
    boxes = {name: [(b["offset"], b["size"]) for b in t["boxes"]] for name, t in tensors.items()}
    assert boxes["layers.0.attention.wq.weight"] == [([0, 0], [16, 32]), ([16, 0], [16, 32])]  # Shard(0)
    assert boxes["layers.0.attention.wo.weight"] == [([0, 0], [32, 16]), ([0, 16], [32, 16])]  # Shard(1)
    assert boxes["tok_embeddings.weight"] == [([0, 0], [32, 32]), ([32, 0], [32, 32])]
    for name in ("layers.0.attention_norm.weight", "norm.bias", "layers.1.attention.wo.bias"):  # Replicate()
        assert boxes[name] == [([0] * len(tensors[name]["shape"]), tensors[name]["shape"])]
        assert all(piece[0] % 2 == 0 for piece in tensors[name]["boxes"][0]["pieces"]), name
    piece = tensors["layers.0.attention.wq.weight"]["boxes"][1]["pieces"][0]
    assert piece[3] == f"v/layers.0.attention.wq.weight/16,0/{piece[1]}"
    if SAVED[saved][1]:  # Muon's state: whole, in the global shape, once (by a tp rank 0 owner: an even part)
        state = tensors["layers.0.attention.wq.weight"]["whole_state"]
        assert state["file"] % 2 == 0 and state["keys"] == ["o/layers.0.attention.wq.weight/momentum_buffer"]
        assert sum("whole_state" in t for t in tensors.values()) == 12  # wq, wk, wv, wo, the MLP's 2, in 2 blocks
    else:
        assert set(piece[4]) == {"step", *STATE}


@pytest.mark.parametrize("load", full_only_beyond(LOADS, QUICK_LOADS))
def test_loads_the_saved_values_bit_for_bit(world, load):
    _, out = world
    saved, loaded = out["saved"][LOADS[load][0]], out[load]["loaded"]
    for key in ("params", *STATE):
        assert torch.equal(loaded[key], saved[key]), f"{load}: {key}"
    assert loaded["step"] == saved["step"] == [2.0]
    assert loaded["whole"].keys() == saved["whole"].keys() and len(saved["whole"]) == (12 if "muon" in load else 0)
    for name, value in saved["whole"].items():
        assert value.shape == _model(0).get_parameter(name).shape and torch.equal(loaded["whole"][name], value), name
    if "weights" in out[load]:  # load_checkpoint(path, tp_model) without an optimizer
        assert torch.equal(out[load]["weights"], saved["params"])


@pytest.mark.parametrize("load", full_only_beyond(ADAMW, QUICK_LOADS))
def test_resumed_training_matches_single_process(world, load):
    _, out = world
    ref, never_stopped, run = out["reference"], out["saved"][LOADS[load][0]], out[load]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][2:])) <= LOSS_TOL, run["losses"]
    noise, diff = _rel(never_stopped["params4"], ref["params4"]), _rel(run["params4"], ref["params4"])
    assert diff <= PARAM_RTOL and diff <= FACTOR * noise + FLOOR, f"{load}: {diff:.3g} off, never stopped {noise:.3g}"
    assert _rel(run["params4"], never_stopped["params4"]) <= RESUME_RTOL
    assert max(abs(a - b) for a, b in zip(never_stopped["losses"], ref["losses"][2:])) <= LOSS_TOL


@pytest.mark.parametrize("saved", full_only_beyond(SAVED, QUICK_SAVED))
def test_one_process_plain_model_and_consolidate(world, saved, tmp_path):
    root, out = world
    values = out["saved"][saved]["params"]
    model = _model(1)
    zero.load_checkpoint(root / str(saved), model, progress=False)
    assert torch.equal(_params(model), values)
    zero.consolidate(root / str(saved), tmp_path / "export", progress=False)
    exported = zero.load_consolidated(tmp_path / "export")
    model = _model(1)
    model.load_state_dict(exported, strict=True)
    assert torch.equal(_params(model), values)


def _shift(meta: dict) -> None:
    meta["tensors"]["layers.0.attention.wq.weight"]["boxes"][1]["offset"] = [17, 0]


def _overlap(meta: dict) -> None:
    meta["tensors"]["layers.0.attention.wq.weight"]["boxes"][1]["offset"] = [8, 0]


def _drop(meta: dict) -> None:
    meta["tensors"]["layers.0.attention.wq.weight"]["boxes"].pop()


def _rename(meta: dict) -> None:
    piece = meta["tensors"]["layers.0.attention.wq.weight"]["boxes"][1]["pieces"][0]
    piece[3] = piece[3].replace("/16,0/", "/0,0/")


def _pieces(meta: dict) -> None:
    meta["tensors"]["norm.bias"]["pieces"] = []


def _degree(meta: dict) -> None:
    meta["tensor_parallel"] = 3


DAMAGE = {  # edit -> what the refusal says
    "outside": (_shift, "does not lie inside its shape"),
    "overlap": (_overlap, "overlap"),
    "gap": (_drop, "do not cover its 1024 elements"),
    "key": (_rename, "v/NAME/OFFSET/START"),
    "pieces": (_pieces, "must record boxes, and only them"),
    "degree": (_degree, "divides world_size (4), not 3"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_schema_refuses_bad_boxes(world, damage, tmp_path):
    """Boxes inside the global shape, tiling it, pieces naming their box's own entries: else the load is refused
    (the metadata's SHA-256 rewritten to match, as by someone who edits both)."""
    root, _ = world
    shutil.copytree(root / "1", tmp_path / "ckpt")
    edit, message = DAMAGE[damage]
    rewrite_metadata(tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match="is damaged or was edited") as err:
        zero.load_checkpoint(tmp_path / "ckpt", _model(1), progress=False)
    assert message in str(err.value)
