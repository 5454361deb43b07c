"""Checkpoints of several optimizers and of optimizers stepped on whole parameters (issue 42), in one process.

Per-rank ``opt.state_dict()`` and portable ``zero.save_checkpoint`` with Muon + AdamW and Adafactor: what they hold,
that resuming is exact, that another set of optimizers (classes, order, step path, groups) is refused naming the
cause and the fix and changes nothing, that any state a whole-parameter optimizer keeps (numbers, lists, tuples,
tensors in another memory layout) comes back as it was, and that a checkpoint written before this change (the
fixture ``tests/data/adamw_before_42``) still loads, value for value. Across world sizes see
``tests/distributed/test_checkpoint_world.py``.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import zero
from tests.checkpoints import rewrite_metadata
from tests.data import adamw_before_42 as before
from tests.distributed.checkpoint_world import Hidden, whole_missing, whole_optimizers
from tests.readouts import flat_params
from zero.checkpoint.portable.reader import Checkpoint

STAGES = (0, 1, 2, 3)
MUON = f"{getattr(torch.optim, 'Muon', object).__module__}.Muon"  # (torch.optim.Muon: torch says "torch.optim")
ADAFACTOR = f"{getattr(torch.optim, 'Adafactor', object).__module__}.Adafactor"
ADAMW = "torch.optim.adamw.AdamW"
needs_muon = pytest.mark.skipif(whole_missing("muon_adamw") is not None, reason=str(whole_missing("muon_adamw")))
needs_adafactor = pytest.mark.skipif(whole_missing("adafactor") is not None, reason=str(whole_missing("adafactor")))


def build(recipe: str = "muon_adamw", stage: int = 2, seed: int = 0, **overrides):
    """``Hidden`` and its ZeroOptimizer: ``recipe`` as in ``checkpoint_world``, ``"adamw"`` (one elementwise),
    ``"adamw_muon"`` (Muon + AdamW in the other order) or ``"muon_adamw_1"`` (AdamW with one group)."""
    torch.manual_seed(seed)
    model = Hidden()
    if recipe == "adamw":
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    elif recipe == "adamw_muon":
        optimizers = whole_optimizers("muon_adamw", model)[::-1]
    elif recipe == "muon_adamw_1":
        muon, adamw = whole_optimizers("muon_adamw", model)
        optimizers = [muon, torch.optim.AdamW([p for g in adamw.param_groups for p in g["params"]], lr=1e-2)]
    else:
        optimizers = whole_optimizers(recipe, model)
    return model, zero.ZeroOptimizer(optimizers, model, stage=stage, bucket_size_mb=0.0005, **overrides)


def train(model, opt, steps) -> None:
    for step in steps:
        model(torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step))).backward()
        opt.step()
        opt.zero_grad()


def states(opt) -> list[dict]:
    """Every wrapped optimizer's state dict (deep copies)."""
    return [copy.deepcopy(o.state_dict()) for o in opt.optimizers]


def same_tree(a, b) -> bool:
    """The same structure, types, values (bits) and tensor strides."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ----- per-rank state dicts ---------------------------------------------------------------------------------


def test_one_elementwise_optimizer_keeps_the_shard_format():
    _, opt = build("adamw")
    saved = opt.state_dict()
    assert saved["format"] == "zero.shard/2" and saved["inner"]["class"] == "torch.optim.adamw.AdamW"
    assert "optimizer" in saved and "inners" not in saved and "optimizers" not in saved


@needs_muon
@pytest.mark.parametrize("stage", STAGES)
def test_several_optimizers_round_trip_through_the_per_rank_state_dict(stage):
    model, opt = build(stage=stage)
    train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    muon, adamw = saved["inners"]
    assert (muon["class"], muon["path"], muon["groups"]) == (MUON, "whole", 1)
    assert (adamw["class"], adamw["path"], adamw["groups"]) == (ADAMW, "flat", 2)
    assert [tuple(r) for r in muon["pieces"][0]] == [("up.weight", 0, 192), ("mid.weight", 0, 576),
                                                     ("down.weight", 0, 192)]
    momentum = [s["momentum_buffer"].shape for s in saved["optimizers"][0]["state"].values()]
    assert momentum == [(24, 8), (24, 24), (8, 24)]  # in the parameter's own shape
    assert all(v.dim() <= 1 for s in saved["optimizers"][1]["state"].values() for v in s.values())  # flat pieces
    weights = copy.deepcopy(flat_params(model, opt))
    fresh_model, fresh = build(stage=stage, seed=1)
    with fresh.gathered_parameters(), torch.no_grad():  # (the weights travel apart from the optimizer's shard)
        for p, value in zip(fresh_model.parameters(), weights.split([p.numel() for p in fresh_model.parameters()])):
            p.copy_(value.view_as(p))
    fresh.load_state_dict(saved)
    assert all(same_tree(a, b) for a, b in zip(states(fresh), states(opt)))
    train(model, opt, range(2, 4))
    train(fresh_model, fresh, range(2, 4))
    assert torch.equal(flat_params(fresh_model, fresh), flat_params(model, opt))


M, A = re.escape(MUON), re.escape(ADAMW)
REFUSALS = [
    ("muon_adamw", "adamw_muon", rf"holds the state of 2 optimizers \[{M}, {A}\] but this ZeroOptimizer wraps 2 "
     rf"optimizers \[{A}, {M}\]; build the same optimizers, in the same order, to resume from it "
     r"\(ZeroOptimizer\(\[Muon\(\.\.\.\), AdamW\(\.\.\.\)\], model\)\)"),
    ("muon_adamw", "adamw", rf"state of 2 optimizers \[.*\] but this ZeroOptimizer wraps a {A}"),
    ("adamw", "muon_adamw", rf"state of a {A} but this ZeroOptimizer wraps 2 optimizers"),
    ("muon_adamw", "muon_adamw_1", rf"optimizer #1 \({A}\) had 2 param groups when .* was saved but has 1 now"),
]


@needs_muon
@pytest.mark.parametrize("saved_with,loaded_with,match", REFUSALS, ids=["order", "fewer", "more", "groups"])
def test_another_set_of_optimizers_is_refused_per_rank(saved_with, loaded_with, match):
    model, opt = build(saved_with)
    train(model, opt, range(2))
    _, other = build(loaded_with)
    before_load = states(other)
    with pytest.raises(ValueError, match=match.replace(r"when .* was", "when this shard was")):
        other.load_state_dict(opt.state_dict())
    assert all(same_tree(a, b) for a, b in zip(states(other), before_load))


@needs_muon
@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda sd: sd["optimizers"].pop(), "this shard holds 1 optimizer states for 2 optimizers"),
        (lambda sd: sd.update(inners=5), r"'inners' entry is not a list of \{class, path, groups, pieces\}"),
        (lambda sd: sd["inners"][0].update(path="sideways"), "'inners' entry is not a list"),
        (lambda sd: sd.pop("optimizers"), r"lacks \['optimizers'\]"),
        (lambda sd: sd["optimizers"][0]["state"].__setitem__(99, {}), "tensor index 99, which no param group lists"),
        (lambda sd: sd["optimizers"][0]["state"].__setitem__(0, [1]), "tensor index 0 is a list, not a dict"),
        (lambda sd: sd["inners"][0]["pieces"][0].reverse(),
         r"param group 0 of optimizer #0 held the pieces \[down\.weight\[0:192\], mid\.weight"),
        (lambda sd: sd["optimizers"][1]["state"][0].update(exp_avg=torch.zeros(3)), "'exp_avg' of parameter"),
    ],
)
def test_an_edited_shard_of_several_optimizers_is_refused(edit, match):
    model, opt = build()
    train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    edit(saved)
    before_load = states(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert all(same_tree(a, b) for a, b in zip(states(opt), before_load))


@needs_adafactor
def test_a_whole_optimizer_declared_elementwise_is_refused_naming_the_setting(tmp_path):
    model, opt = build("adafactor")
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    flat_model, flat = build("adafactor", elementwise_optimizers=["Adafactor"])
    match = (rf"optimizer #0 \({re.escape(ADAFACTOR)}\) stepped on whole parameters, each by its owner, but this run "
             r"steps it on flat pieces .* same ZeroConfig\.elementwise_optimizers")
    with pytest.raises(ValueError, match=match):
        flat.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        zero.load_checkpoint(tmp_path / "ckpt", flat_model, flat, progress=False)


# ----- portable checkpoints -----------------------------------------------------------------------------------


@needs_muon
@pytest.mark.parametrize("saved_with,loaded_with,match", REFUSALS, ids=["order", "fewer", "more", "groups"])
def test_another_set_of_optimizers_is_refused_by_load_checkpoint(tmp_path, saved_with, loaded_with, match):
    model, opt = build(saved_with)
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    other_model, other = build(loaded_with, seed=1)
    weights, before_load = flat_params(other_model, other), states(other)
    with pytest.raises(ValueError, match=match):
        zero.load_checkpoint(tmp_path / "ckpt", other_model, other, progress=False)
    assert torch.equal(flat_params(other_model, other), weights)  # a refused load changes nothing
    assert all(same_tree(a, b) for a, b in zip(states(other), before_load))


def test_one_elementwise_optimizer_keeps_the_checkpoint_format(tmp_path):
    model, opt = build("adamw")
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["format"] == "zero.checkpoint/2" and meta["optimizer_class"] == ADAMW and "optimizers" not in meta
    assert not any("whole_state" in t for t in meta["tensors"].values())


@pytest.mark.parametrize("recipe", ["muon_adamw", "adafactor"])
@pytest.mark.parametrize("saved_at,loaded_at", [(2, 0), (2, 3), (0, 1), (3, 2)])
def test_whole_state_is_saved_in_the_parameters_shape_and_resumes_exactly(tmp_path, recipe, saved_at, loaded_at):
    if whole_missing(recipe):
        pytest.skip(whole_missing(recipe))
    model, opt = build(recipe, stage=saved_at)
    train(model, opt, range(3))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["format"] == "zero.checkpoint/3"
    entries = meta["files"][0]["entries"]
    whole = {name: t["whole_state"] for name, t in meta["tensors"].items() if "whole_state" in t}
    if recipe == "muon_adamw":
        assert meta["optimizers"] == [{"class": MUON, "path": "whole", "groups": 1},
                                      {"class": ADAMW, "path": "flat", "groups": 2}]
        assert meta["optimizer_class"] == f"{MUON} + {ADAMW}"
        assert sorted(whole) == ["down.weight", "mid.weight", "up.weight"]
        for name, shape in (("up.weight", [24, 8]), ("down.weight", [8, 24])):
            assert whole[name]["keys"] == [f"o/{name}/momentum_buffer"]
            assert entries[f"o/{name}/momentum_buffer"][1] == shape
            assert not any(piece[4] for piece in meta["tensors"][name]["pieces"])  # no state per piece
    else:
        assert meta["optimizers"] == [{"class": ADAFACTOR, "path": "whole", "groups": 2}]
        assert len(whole) == 10 and meta["step"] == 3
        up = {key.rsplit("/", 1)[1]: entries[key][1] for key in whole["up.weight"]["keys"]}
        assert up == {"step": [], "row_var": [24, 1], "col_var": [1, 8]}
        assert {key.rsplit("/", 1)[1] for key in whole["up.bias"]["keys"]} == {"step", "variance"}
    reference = states(opt)
    fresh_model, fresh = build(recipe, stage=loaded_at, seed=1)
    zero.load_checkpoint(tmp_path / "ckpt", fresh_model, fresh, progress=False)
    whole_index = 0  # the whole-parameter optimizer: its state as saved (one rank owns everything here)
    assert same_tree(states(fresh)[whole_index]["state"], reference[whole_index]["state"])
    train(model, opt, range(3, 6))
    train(fresh_model, fresh, range(3, 6))
    assert torch.equal(flat_params(fresh_model, fresh), flat_params(model, opt))


@needs_muon
def test_consolidate_reads_the_values_of_a_checkpoint_of_several_optimizers(tmp_path):
    model, opt = build(stage=3)
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    written = zero.consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors", progress=False)
    exported = zero.load_consolidated(written[0])
    with opt.gathered_parameters():
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


class Keeper(torch.optim.Optimizer):
    """A whole-parameter optimizer zero does not know, keeping what third-party ones keep (SOAP: lists of matrices,
    Python numbers): a step count, a list with a transposed matrix, a tuple, nested dicts, ``None``. (Not a string:
    ``torch.optim.Optimizer.load_state_dict`` turns one into the text of a generator, per-rank state dicts too.)"""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(count=0, history=[], note=None, pair=(torch.zeros(()), 0.5), nested={"best": None})
                state["count"] += 1
                state["history"] = [p.grad.clone(), (p.grad.reshape(p.shape[0], -1).T @ p.grad.reshape(p.shape[0], -1))
                                    .T if p.dim() > 1 else p.grad.square()]  # (a column-major matrix)
                state["pair"] = (state["pair"][0] + p.grad.norm(), state["pair"][1] * 2)
                state["nested"] = {"best": float(p.grad.abs().max()), 3: [1, 2.5, None]}
                p.sub_(p.grad / (1 + state["history"][1].norm()), alpha=group["lr"])


def test_any_state_a_whole_optimizer_keeps_comes_back_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = Hidden()
    opt = zero.ZeroOptimizer(Keeper(model.parameters()), model, stage=2, bucket_size_mb=0.0005)
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    record = meta["tensors"]["up.weight"]["whole_state"]
    assert record["keys"] == ["o/up.weight/history[0]", "o/up.weight/history[1]", "o/up.weight/pair[0]"]
    assert record["layouts"] == {"o/up.weight/history[1]": [1, 0]}  # the transposed matrix, column-major
    torch.manual_seed(1)
    fresh_model = Hidden()
    fresh = zero.ZeroOptimizer(Keeper(fresh_model.parameters()), fresh_model, stage=3, bucket_size_mb=0.0005)
    zero.load_checkpoint(tmp_path / "ckpt", fresh_model, fresh, progress=False)
    assert same_tree(states(fresh), states(opt))  # numbers, None, tuples, int keys, layouts: as they were
    train(model, opt, range(2, 4))
    train(fresh_model, fresh, range(2, 4))
    assert torch.equal(flat_params(fresh_model, fresh), flat_params(model, opt))


def test_state_that_cannot_be_saved_is_refused_naming_the_optimizer_and_parameter(tmp_path):
    torch.manual_seed(0)
    model = Hidden()
    opt = zero.ZeroOptimizer(Keeper(model.parameters()), model, stage=1)
    train(model, opt, range(1))
    opt.optimizers[0].state[opt.optimizers[0].param_groups[0]["params"][0]]["note"] = object()
    match = (r"the tests\.unit\.test_checkpoint_optimizers\.Keeper state of 'embed\.weight' cannot be saved in a "
             r"portable checkpoint \(cannot save object at note: .*\); save this optimizer with the per-rank")
    with pytest.raises(ValueError, match=match):
        zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    assert not (tmp_path / "ckpt").exists()


@needs_muon
@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m.update(format="zero.checkpoint/2"), "holds one elementwise optimizer's state: no 'optimizers'"),
        (lambda m: m.pop("optimizers"), "lists the optimizers it was saved with in 'optimizers'"),
        (lambda m: m["optimizers"][1].update(groups=1), "have 2 param groups in all, but state.param_groups holds 3"),
        (lambda m: m.update(optimizer_class="torch.optim.adamw.AdamW"), "not the optimizers'"),
        (lambda m: m["optimizers"][0].update(path="flat"), "has whole-parameter optimizer state but is not a"),
        (lambda m: m["optimizers"][1].update(path="whole"), "has optimizer state per piece but is not a parameter of"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"]["keys"].__setitem__(0, "o/down.weight/momentum_buffer"),
         r"names 'o/down\.weight/momentum_buffer', which is not one entry o/up\.weight/\.\.\."),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(tree={"momentum_buffer": {"__tensor__": 1}}),
         r"refers to tensor 1, which is not one of its 1 keys"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(tree={}), "does not refer to each of its 1 keys"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(tree={"momentum": {"__tensor__": 0}}),
         r"holds entry 'o/up\.weight/momentum_buffer' at 'momentum', not its own \(o/up\.weight/momentum\)"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(tree=[{"__tensor__": 0}]), "is not a dict"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(layouts={"o/up.weight/momentum_buffer": [0, 0]}),
         r"lays out 'o/up\.weight/momentum_buffer' as \[0, 0\]"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"].update(file=5), "is in file 5, but there are 1"),
        (lambda m: m["tensors"]["up.weight"]["whole_state"]["keys"].append("o/up.weight/momentum_buffer"),
         r"names 'o/up\.weight/momentum_buffer', which is not one entry"),  # (read twice)
    ],
)
def test_edited_metadata_of_several_optimizers_is_refused(tmp_path, edit, match):
    model, opt = build()
    train(model, opt, range(2))
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    rewrite_metadata(tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=match):
        Checkpoint(tmp_path / "ckpt")


# ----- a checkpoint saved before several optimizers and whole-parameter ones --------------------------------------


def _recomputed(stage: int) -> tuple[torch.nn.Module, zero.ZeroOptimizer]:
    """The fixture's run, made now with today's zero."""
    model, opt = before.build(stage=stage)
    before.train(model, opt, range(before.STEPS))
    return model, opt


@pytest.mark.parametrize("stage", [1, 3])
def test_a_checkpoint_saved_before_several_optimizers_still_loads(stage):
    meta = json.loads((before.CHECKPOINT / "metadata.json").read_text())
    assert meta["format"] == "zero.checkpoint/2" and meta["zero_version"] == "0.2.0"  # written by the old code
    model, opt = _recomputed(stage)
    fresh_model, fresh = before.build(seed=1, stage=stage)
    extra = zero.load_checkpoint(before.CHECKPOINT, fresh_model, fresh, progress=False)
    assert extra == {"steps": before.STEPS}
    assert torch.equal(flat_params(fresh_model, fresh), flat_params(model, opt))
    assert same_tree(states(fresh), states(opt))  # exp_avg, exp_avg_sq and step of every piece, value for value
    before.train(model, opt, range(before.STEPS, before.STEPS + 2))
    before.train(fresh_model, fresh, range(before.STEPS, before.STEPS + 2))
    assert torch.equal(flat_params(fresh_model, fresh), flat_params(model, opt))


def test_a_per_rank_shard_saved_before_several_optimizers_still_loads():
    saved = torch.load(before.SHARD, weights_only=True)
    assert saved["format"] == "zero.shard/2" and "inner" in saved
    _, opt = _recomputed(stage=1)
    _, fresh = before.build(seed=1, stage=1)
    fresh.load_state_dict(saved)
    assert same_tree(states(fresh), states(opt))


@needs_muon
def test_a_checkpoint_saved_before_is_refused_by_several_optimizers_naming_both():
    torch.manual_seed(0)
    model = before.Small()
    weights = [model.first.weight, model.second.weight]
    opt = zero.ZeroOptimizer([torch.optim.Muon(weights), torch.optim.AdamW([model.first.bias, model.second.bias])],
                             model, stage=1)
    match = rf"state of a {A} but this ZeroOptimizer wraps 2 optimizers \[{M}, {A}\]"
    with pytest.raises(ValueError, match=match):
        zero.load_checkpoint(before.CHECKPOINT, model, opt, progress=False)
    with pytest.raises(ValueError, match=match.replace("state of", "this shard holds the state of")):
        opt.load_state_dict(torch.load(before.SHARD, weights_only=True))
