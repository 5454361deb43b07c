"""Weights tied across pipeline parts, the parts that run in one process (``zero.runtime.parallel.ties``): the
fingerprints that compare two copies of a tensor held under different shardings, and the plan each rank draws from
what every pp rank holds (which tie it takes part in, and the refusals). The tie trained over a real pipeline:
``tests/distributed/test_pipeline_ties_world.py``.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from zero.comm.communicator import Communicator
from zero.runtime.parallel.ties import Held, NoTie, Tie, fingerprints, plan_tie


def _pieces(slot, flat: torch.Tensor, cuts: list[int]) -> list[SimpleNamespace]:
    """``flat`` cut at ``cuts`` into pieces of ``slot`` (as a bucket's chunk boundaries cut a parameter)."""
    bounds = [0, *cuts, flat.numel()]
    return [SimpleNamespace(slot=slot, piece=SimpleNamespace(param_start=a), tensor=flat[a:b])
            for a, b in zip(bounds, bounds[1:])]


def _features(flat: torch.Tensor, cuts: list[int]) -> list[float]:
    slot = SimpleNamespace()
    bucket = SimpleNamespace(pieces=_pieces(slot, flat, cuts))
    return fingerprints([bucket], [slot], Communicator(), sharded=False)[0].tolist()


def _held(name: str, flat: torch.Tensor, cuts: list[int] = ()) -> Held:
    kind = {"embed": "Embedding", "head": "Linear"}.get(name, "LayerNorm")
    return Held(name, tuple(flat.shape), tuple(_features(flat, list(cuts))), "float32", kind)


def test_copies_agree_under_any_cut_and_other_tensors_do_not():
    torch.manual_seed(0)
    weight = torch.randn(4096)
    a, b = _held("embed", weight, [1000, 3000]), _held("head", weight.clone(), [7, 2048, 4000])
    assert a.same_values(b)
    assert not a.same_values(_held("other", torch.randn(4096)))
    nudged = weight.clone()
    nudged[123] += 1e-3  # one element off by a little: no longer the same tensor
    assert not a.same_values(_held("nudged", nudged))
    permuted = weight.flip(0)  # the same values in another order
    assert not a.same_values(_held("flipped", permuted))
    assert _held("ones", torch.ones(4096)).constant and not a.constant


def _plan(declared, held, mine, rank=0):
    return plan_tie(declared, held, mine, SimpleNamespace(rank=rank, device=torch.device("cpu")))


def test_plan_sets_up_the_declared_tie_and_counts_it_on_its_first_rank():
    w = torch.randn(64)
    held = [{"embed": _held("embed", w), "wq": _held("wq", torch.randn(64))},
            {"head": _held("head", w), "wk": _held("wk", torch.randn(64))}]
    slot = object()
    first = _plan([("embed", "head")], held, {"embed": slot}, rank=0)
    assert isinstance(first, Tie) and first.slot is slot and first.counted and first.numel == 64
    assert first.counts(slot) and first.counts(object())
    last = _plan([("embed", "head")], held, {"head": slot}, rank=1)
    assert isinstance(last, Tie) and not last.counts(slot) and last.counts(object())
    middle = _plan([("embed", "head")], held + [{"wv": _held("wv", torch.randn(64))}], {}, rank=2)
    assert isinstance(middle, Tie) and middle.slot is None  # holds no copy: adds zeros to the sum
    one_rank = [{"embed": _held("embed", w), "head": _held("head", w)}, {"wk": held[1]["wk"]}]
    assert isinstance(_plan([("embed", "head")], one_rank, {"embed": slot, "head": slot}), NoTie)  # one tensor


def _refusal(case: str) -> tuple[list, list[dict[str, Held]], dict]:
    """(declared, held, mine) of rank 0 for each refused case."""
    w, v = torch.randn(64), torch.randn(32)
    held = [{"embed": _held("embed", w), "pos": _held("pos", v)}, {"head": _held("head", w), "pos2": _held("pos2", v)}]
    mine = {"embed": object(), "pos": object()}
    if case == "two_on_a_rank":
        return ([("embed", "head", "head2")],
                [{"embed": _held("embed", w), "head": _held("head", w)}, {"head2": _held("head2", w)}],
                {"embed": object(), "head": object()})
    declared = {"undeclared": [], "unknown": [("embed", "lm_head")], "differ": [("embed", "pos2")],
                "two_ties": [("embed", "head"), ("pos", "pos2")]}[case]
    return declared, held, mine


@pytest.mark.parametrize("case, message", [
    ("undeclared", "'embed' (pp rank 0) and 'head' (pp rank 1) hold the same values"),
    ("unknown", "['lm_head'], which no part of the pipeline holds"),
    ("differ", "hold different values (or shapes): a tie is one tensor"),
    ("two_on_a_rank", "are separate tensors on one rank"),
    ("two_ties", "one such tie is built"),
])
def test_plan_refuses(case, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(*_refusal(case))


def test_constant_parameters_and_layers_alike_are_never_taken_for_a_tie():
    """Norm weights of ones on every part hold the same values without being one tensor, and so do layers of one kind
    at the same place in parts built from one seed; an embedding's copy is taken for a tie."""
    assert isinstance(_plan([], [{"a": _held("a", torch.ones(8))}, {"b": _held("b", torch.ones(8))}], {}), NoTie)
    w = torch.randn(8)
    assert isinstance(_plan([], [{"a": _held("a", w)}, {"b": _held("b", w)}], {}), NoTie)  # two LayerNorms
    with pytest.raises(ValueError, match="hold the same values"):
        _plan([], [{"embed": _held("embed", w)}, {"b": _held("b", w)}], {})
