"""The configuration goes down the layers: while ``ZeroOptimizer`` is built, every call that hands on a policy
(``ZeroConfig`` or one of its parts: offload, precision, communication, activation checkpointing) goes from a module
to one below it in the import graph, never back up to a module that imports the caller (a callback into a higher
layer, or a lower layer reaching for a policy object it should have been given). Traced with ``sys.setprofile`` on
the configurations that take the most paths (stage 3 with mixed precision, offload, checkpointing and hpZ-style
communication settings at world size 1; stage 1 with disk offload)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.repo.test_architecture import import_graph
from tests.toy import Net
from zero import ZeroConfig, ZeroOptimizer
from zero.activations import ActivationCheckpointing
from zero.comm.policy import Communication
from zero.offload import Offload
from zero.precision import MixedPrecision

POLICIES = (ZeroConfig, Offload, MixedPrecision, Communication, ActivationCheckpointing)


def _below(graph: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    """Every module's transitive imports."""
    out: dict[str, set[str]] = {}

    def visit(module: str) -> set[str]:
        if module not in out:
            out[module] = set()
            for target in graph.get(module, {}):
                out[module] |= {target} | visit(target)
        return out[module]

    for module in graph:
        visit(module)
    return out


def policy_calls(build) -> list[tuple[str, str, str]]:
    """``(caller module, callee module, callee function)`` of every call inside ``zero`` given a policy object."""
    calls = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_globals.get("__name__", "").startswith("zero"):
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
        if any(isinstance(a, POLICIES) for a in args) and frame.f_back is not None:
            calls.append((frame.f_back.f_globals.get("__name__", ""), frame.f_globals["__name__"], code.co_name))

    sys.setprofile(profile)
    try:
        build()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.filterwarnings("ignore:offloaded AdamW")
@pytest.mark.parametrize("settings", [
    {"stage": 3, "precision": {"param_dtype": "bf16"}, "offload": {"optimizer": "cpu", "params": "cpu"},
     "activation_checkpointing": {}},
    {"stage": 2, "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"}, "offload": {"optimizer": "cpu",
                                                                                          "ratio": 0.5}},
    {"stage": 1, "offload": {"optimizer": "disk", "path": "{tmp}"}},
], ids=["stage3-offload-checkpointing", "stage2-partial", "stage1-disk"])
def test_the_config_goes_down_the_layers(settings, tmp_path):
    if "path" in settings["offload"]:
        settings = {**settings, "offload": {**settings["offload"], "path": str(tmp_path)}}
    model = Net()
    calls = policy_calls(lambda: ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, **settings))
    below = _below(import_graph())
    visited = {callee for _, callee, _ in calls}
    assert {"zero.runtime.build", "zero.offload", "zero.precision"} <= visited, visited  # (the trace sees the walk)
    found = climbs(calls, below)
    assert not found, "calls handing a policy up the import graph:\n" + "\n".join(found)


def climbs(calls: list[tuple[str, str, str]], below: dict[str, set[str]]) -> list[str]:
    """The calls whose callee imports (transitively) their caller."""
    return [f"{caller} -> {callee}.{function}" for caller, callee, function in calls
            if caller != callee and caller in below.get(callee, set())]


def test_a_call_up_the_graph_is_a_climb():
    below = _below({"top": {"mid": ""}, "mid": {"low": ""}, "low": {}})
    assert below == {"top": {"mid", "low"}, "mid": {"low"}, "low": set()}
    calls = [("top", "mid", "f"), ("mid", "low", "g"), ("low", "top", "h"), ("mid", "mid", "i"), ("x", "top", "j")]
    assert climbs(calls, below) == ["low -> top.h"]
