"""Stage 3's gathering schedule (``zero.runtime.gathering.gather_order``): its decisions on small sequences of
events, and the one object the runtime's gatherer and the estimator both drive (a change to it changes both)."""

from __future__ import annotations

import pytest
import torch

from tests.toy import Blocks
from zero import ZeroConfig, ZeroOptimizer
from zero.estimator import Workload, estimate
from zero.estimator.codec_memory import CodecMemory
from zero.estimator.gathering import gathering
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.runtime.gathering.gather_order import GatherOrder, UnitState

SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=3, num_heads=2)


class Log:
    """Records what the schedule decides."""

    def __init__(self) -> None:
        self.done: list[tuple] = []

    def start(self, unit, *, from_copies, exact):
        self.done.append(("copies" if from_copies else "gather", unit))

    def wait(self, unit):
        self.done.append(("wait", unit))

    def release(self, unit):
        self.done.append(("release", unit))

    def diverged(self, position, ran, first):
        self.done.append(("diverged", position, ran, first))

    def take(self) -> list[tuple]:
        done, self.done = self.done, []
        return done


def _schedule(prefetch: int = 1, params=(1, 1, 1)) -> tuple[GatherOrder, Log]:
    log = Log()
    return GatherOrder(["", "a", "b"], list(params), "", log, prefetch=prefetch), log


def _forward(order: GatherOrder, units=("", "a", "b")) -> None:
    order.pre_forward("")
    for unit in units[1:]:
        order.pre_forward(unit)
        order.inputs_hooked(unit)
        order.post_forward(unit, "hooked")
    order.post_forward("", "hooked")


def _backward(order: GatherOrder) -> None:
    for unit in ("b", "a"):
        order.pre_backward(unit)
        order.grad_arrived(unit)
        order.inputs_done(unit)
    order.pre_backward("")
    order.grad_arrived("")
    order.end_backward()


def test_the_first_step_gathers_on_demand_and_releases_each_unit_when_the_next_starts_or_its_backward_is_over():
    order, log = _schedule()
    _forward(order)
    assert log.take() == [("gather", ""), ("wait", ""), ("gather", "a"), ("wait", "a"), ("release", "a"),
                          ("gather", "b"), ("wait", "b")]  # b, forward's last unit, goes straight into backward
    order.pre_backward("b")
    order.grad_arrived("b")
    assert log.take() == []  # its inputs' gradients are not computed yet: its parameters are still read
    order.inputs_done("b")
    assert log.take() == [("release", "b")]
    order.pre_backward("a")
    order.inputs_done("a")
    assert log.take() == [("copies", "a"), ("wait", "a")]  # (backward, a's copy current) and its gradient to come
    order.grad_arrived("a")
    order.pre_backward("")
    order.grad_arrived("")
    assert log.take() == [("release", "a")]  # the root stays gathered
    order.end_backward()
    assert log.take() == [] and order.state("") is UnitState.GATHERED and order.current == set()
    order.release_all()  # the step
    assert log.take() == [("release", "")]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_later_steps_prefetch_in_the_previous_passes_order(prefetch):
    order, log = _schedule(prefetch)
    _forward(order)
    _backward(order)
    order.release_all()
    log.take()
    order.pre_forward("")
    assert log.take() == [("gather", ""), ("wait", ""), *[("gather", u) for u in ("a", "b")[:prefetch]]]
    assert order.state("a") is UnitState.GATHERING
    order.pre_forward("a")
    assert log.take() == [("wait", "a")] + ([("gather", "b")] if prefetch == 1 else [])
    order.post_forward("a", "hooked")
    order.pre_forward("b")
    order.post_forward("b", "hooked")
    order.post_forward("", "hooked")
    assert log.take() == [("release", "a"), ("wait", "b")]
    order.pre_backward("b")
    assert log.take() == [("copies", "a")]  # prefetched in backward's order, from the copies
    order.grad_arrived("b")
    order.pre_backward("a")
    assert log.take() == [("release", "b"), ("wait", "a")]


def test_outputs_decide_when_forward_releases_and_the_root_keeps_backward_waiting():
    order, log = _schedule(prefetch=0)
    order.pre_forward("")
    order.pre_forward("a")
    order.post_forward("a", "none")  # no output needs a gradient: no backward will reach it
    order.pre_forward("b")
    order.post_forward("b", "unseen")  # outputs it cannot look into: kept until the end of backward
    assert log.take()[-3:] == [("release", "a"), ("gather", "b"), ("wait", "b")]
    order.pre_forward("a")
    order.post_forward("a", "hooked")
    order.post_forward("", "hooked")
    assert ("release", "b") not in log.take()
    order.end_backward()
    assert log.take() == [("release", "a"), ("release", "b")] and order.state("") is UnitState.GATHERED
    order.pre_forward("")
    order.pre_forward("a")
    order.post_forward("a", "hooked")
    order.post_forward("", "no_grad")  # grad mode off: every unit released at the root's end
    assert [u for what, u, *_ in log.take() if what == "release"] == ["", "a"]


def test_a_unit_called_twice_is_released_once_both_calls_backward_is_over():
    order, log = _schedule(prefetch=0)
    order.pre_forward("")
    for unit in ("a", "b", "a"):
        order.pre_forward(unit)
        order.inputs_hooked(unit)
        order.post_forward(unit, "hooked")
    assert log.take()[-4:] == [("wait", "b"), ("release", "b"), ("gather", "a"), ("wait", "a")]  # (a runs again)
    order.pre_backward("a")
    order.grad_arrived("a")
    order.inputs_done("a")
    assert log.take() == []  # a's first call's backward is still to come
    order.pre_backward("b")
    order.grad_arrived("b")
    order.inputs_done("b")
    order.inputs_done("a")
    assert log.take() == [("copies", "b"), ("wait", "b"), ("release", "b"), ("release", "a")]


def test_a_backward_pass_that_builds_a_graph_releases_nothing_until_the_backward_through_that_graph_ends():
    """A gradient penalty (issue 41): ``torch.autograd.grad(out, x, create_graph=True)`` records a graph that reads
    every unit it passed through; the backward through the penalty reads them again, so they stay gathered (in
    forward too) until a pass that builds no graph ends, or the step."""
    order, log = _schedule(prefetch=0)
    _forward(order)
    log.take()
    for unit in ("b", "a"):  # autograd.grad with respect to the input: no parameter gradient arrives
        order.pre_backward(unit, builds_graph=True)
        order.inputs_done(unit)
    order.pre_backward("", builds_graph=True)
    order.end_backward()
    assert log.take() == [("copies", "a"), ("wait", "a")]  # a, released after forward, is gathered again ...
    assert all(order.state(u) is UnitState.GATHERED for u in ("", "a", "b"))  # ... and nothing is released
    _forward(order)  # a forward in between keeps them too
    assert log.take() == []
    _backward(order)  # the backward through the penalty (builds no graph) releases all but the root at its end
    assert log.take() == [("release", "a"), ("release", "b")] and order.state("") is UnitState.GATHERED
    _forward(order)
    log.take()
    for unit in ("b", "a"):
        order.pre_backward(unit, builds_graph=True)
    assert log.take() == [("copies", "a"), ("wait", "a")]
    order.release_all()  # the step releases what a graph-building pass held
    assert log.take() == [("release", ""), ("release", "a"), ("release", "b")]


def test_a_gather_of_written_shards_or_an_exact_one_never_reads_the_copies():
    order, log = _schedule(prefetch=0)
    order.wait("a", backward=False)
    order.release("a")
    order.forget("a")  # its shards written (gathered_parameters())
    order.wait("a", backward=True)
    order.release("a")
    order.gather("a", backward=True, exact=True)
    assert [what for what, *_ in log.take()] == ["gather", "wait", "release", "gather", "wait", "release", "gather"]


def test_a_forward_leaving_the_first_passes_order_is_reported_once():
    order, log = _schedule()
    _forward(order)
    _backward(order)
    order.release_all()
    log.take()
    order.pre_forward("")
    order.pre_forward("b")
    order.pre_forward("a")
    assert [d for d in log.take() if d[0] == "diverged"] == [("diverged", 1, "b", "a")]


# ----- the runtime and the estimator drive the same object ----------------------------------------------------------


class Twice(Blocks):
    """Units called twice per forward (and one a second time after another unit ran)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x, [0, 1, 0, 2])


def _gpt_workload() -> tuple[Workload, callable]:
    def step(model, micro):
        x, y = synthetic_batch(0, micro, SMALL)
        return model.loss(x, y)

    return Workload(lambda: GPT(SMALL), lambda m, x, y: m.loss(x, y), lambda m: synthetic_batch(0, m, SMALL)), step


def _twice_workload() -> tuple[Workload, callable]:
    x = lambda micro: (torch.linspace(-1, 1, 8 * micro).view(micro, 8),)  # noqa: E731
    return Workload(lambda: Twice(3), lambda m, x: m(x), x), lambda model, micro: model(*x(micro))


def _logged(gathers, name=lambda unit: unit) -> list[tuple]:
    """Wrap ``gathers``' actions so that they are also logged (by unit name)."""
    log = []
    for action in ("start", "wait", "release"):
        def logged(unit, *args, _do=getattr(gathers, action), _action=action, **kwargs):
            log.append((_action, name(unit)))
            return _do(unit, *args, **kwargs)

        setattr(gathers, action, logged)
    return log


def _runtime_decisions(workload, step, prefetch: int, checkpointing: bool) -> list[tuple]:
    """What the gatherer does in a training step after the first."""
    torch.manual_seed(0)
    model = workload.build()
    config = ZeroConfig(stage=3, prefetch_units=prefetch, activation_checkpointing={} if checkpointing else None)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=config)
    log = _logged(opt.runtime.gatherer.gathers, lambda unit: "" if unit.is_root else unit.name)
    for _ in range(2):
        log.clear()
        step(model, 2).backward()
        opt.step()
        opt.zero_grad()
    return log


def _estimated_decisions(workload, prefetch: int, checkpointing: bool) -> list[tuple]:
    """What the estimator prices for the same step."""
    timeline = workload.timeline(2, checkpointing=checkpointing)
    replay = gathering(timeline, workload.layout(3, 1).buckets, prefetch, CodecMemory())
    log = _logged(replay)
    for point in timeline.points:
        replay.event(point, lambda: None)
        if point.name == "<end of backward>":
            replay.end_backward()
    replay.release_all()
    return log


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("model", ["gpt", "twice"])
def test_the_estimator_prices_the_gathers_the_runtime_does(model, prefetch, checkpointing):
    workload, step = _gpt_workload() if model == "gpt" else _twice_workload()
    runtime = _runtime_decisions(workload, step, prefetch, checkpointing)
    assert runtime and any(what == "start" for what, _ in runtime)
    assert _estimated_decisions(workload, prefetch, checkpointing) == runtime


def test_a_change_to_the_schedule_changes_both_the_runtime_and_the_estimate(monkeypatch):
    workload, step = _gpt_workload()
    with_prefetch = estimate(workload, stage=3, world_size=2, micro_batch=2, prefetch_units=1)
    runtime = _runtime_decisions(workload, step, 1, False)
    monkeypatch.setattr(GatherOrder, "_prefetch", lambda self, order, previous, backward: None)  # no prefetching
    assert _runtime_decisions(workload, step, 1, False) != runtime
    assert _runtime_decisions(workload, step, 1, False) == _runtime_decisions(workload, step, 0, False)
    without = estimate(workload, stage=3, world_size=2, micro_batch=2, prefetch_units=1)
    assert without.peak != with_prefetch.peak
    assert without.peak == estimate(workload, stage=3, world_size=2, micro_batch=2, prefetch_units=0).peak
