"""Stage 3's gathered units, priced over a traced step (see :mod:`zero.estimator.schedule`).

What is gathered, prefetched and released, and when, is decided by the runtime's own schedule,
``zero.runtime.gathering.gather_order.GatherOrder``: this module tells it the trace's module events, as the
gatherer's hooks do at run time (a unit's forward starts or ends, backward reaches it, its inputs' gradients are
computed, a parameter's gradient arrives, backward ends, the step), and prices what it decides: the units gathered
and waited for, those in flight (the tracker's "communication"), what a quantized gather's packets hold and the slice
it decodes through (:mod:`zero.estimator.codec_memory`), and how many times each unit is gathered and, of those, how
many from hpZ's secondary copies (``zero.runtime.gathering.secondary``; :mod:`zero.estimator.traffic` counts them).

The runtime prefetches in the order units ran on the previous pass, so the trace is told to the schedule twice: the
first time unpriced (the first step, which gathers on demand), then priced (every later step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from zero.estimator.codec_memory import CodecMemory
from zero.estimator.timeline import Point, Timeline
from zero.estimator.traffic import Wire
from zero.runtime.gathering.gather_order import GatherOrder


def _nothing() -> None:
    pass


@dataclass
class Gathering:
    """Prices the gathering schedule's decisions (``zero.runtime.gathering.gather_order.Gathers``) over the trace's
    events."""

    unit_bytes: dict[str, int]
    unit_params: dict[str, set[str]]  # each unit's trainable parameters
    prefetch: int
    codec: CodecMemory = CodecMemory()
    unit_wires: dict[str, list[Wire]] = field(default_factory=dict)
    copies: bool = False  # hpZ's secondary copies exist (backward's gathers from them are exact)
    reshard_after_forward: bool = True  # ZeroConfig's: False keeps each unit gathered from its forward to its backward
    gathered: set[str] = field(default_factory=set)  # gathered and waited for
    prefetched: set[str] = field(default_factory=set)  # gathering, not yet waited for (the tracker's "communication")
    packets: dict[str, int] = field(default_factory=dict)  # what each unit's gather in flight holds (its codec's)
    transient: int = 0  # a gather being decoded: its packets and the decoding's slice
    gathers: dict[str, int] = field(default_factory=dict)  # all-gathers issued, by unit (zero.estimator.traffic)
    regathers: dict[str, int] = field(default_factory=dict)  # ... of which from the copies (backward, copy current)
    on_peak: Callable[[], None] = _nothing  # called at each transient moment (a gather decoded)

    def __post_init__(self) -> None:
        units = list(self.unit_bytes)
        self.unit_of = {p: unit for unit, params in self.unit_params.items() for p in params}
        self.order: GatherOrder[str] = GatherOrder(units, [len(self.unit_params.get(u, ())) for u in units],
                                                   "" if "" in self.unit_bytes else None, self, prefetch=self.prefetch,
                                                   reshard_after_forward=self.reshard_after_forward)

    @property
    def bytes(self) -> int:
        """Gathered and waited for."""
        return sum(self.unit_bytes[u] for u in self.gathered)

    @property
    def in_flight(self) -> int:
        return sum(self.unit_bytes[u] + self.packets.get(u, 0) for u in self.prefetched)

    # ----- the schedule's decisions, priced -------------------------------------------------------------

    def start(self, unit: str, *, from_copies: bool, exact: bool) -> None:
        self.gathers[unit] = self.gathers.get(unit, 0) + 1
        if from_copies:
            self.regathers[unit] = self.regathers.get(unit, 0) + 1
        wires = self.unit_wires.get(unit, [])
        self.packets[unit] = 0 if from_copies and self.copies else sum(self.codec.gathering(w) for w in wires)
        self.prefetched.add(unit)

    def wait(self, unit: str) -> None:
        self.prefetched.discard(unit)
        self.gathered.add(unit)
        packets = self.packets.pop(unit, 0)
        if packets:  # decoded while every packet of the unit is still held
            self.transient = packets + max(self.codec.gather_decode(w) for w in self.unit_wires[unit])
            self.on_peak()
            self.transient = 0

    def release(self, unit: str) -> None:
        self.gathered.discard(unit)

    def diverged(self, position: int, ran: str | None, first: str | None) -> None:
        """(Every pass replays the same trace.)"""

    # ----- the trace's events, told to the schedule ------------------------------------------------------

    def event(self, point: Point, on_peak: Callable[[], None]) -> None:
        """Replay ``point``; ``on_peak()`` is called at each transient moment (a gather decoded)."""
        self.on_peak = on_peak
        name, forward = point.name, point.phase == "forward"  # (the trace's phase is the runtime's test)
        if point.kind == "grad":
            if name in self.unit_of:  # (a managed trainable parameter)
                self.order.grad_arrived(self.unit_of[name])
        elif name not in self.unit_bytes:
            return
        elif point.kind == "enter":
            self.order.pre_forward(name) if forward else self.order.recompute(name)
        elif point.kind == "leave" and forward:
            self.order.post_forward(name, point.outputs or "hooked")
        elif point.kind == "reach":
            self.order.pre_backward(name)
        elif point.kind == "hooked":
            self.order.inputs_hooked(name)
        elif point.kind == "done":
            self.order.inputs_done(name)

    def end_backward(self, on_peak: Callable[[], None] = _nothing) -> None:
        self.on_peak = on_peak
        self.order.end_backward()

    def release_all(self) -> None:
        """The step."""
        self.on_peak = _nothing
        self.order.release_all()


def gathering(timeline: Timeline, buckets: tuple, prefetch: int, codec: CodecMemory,
              reshard_after_forward: bool = True, reshard_after_backward: bool = True) -> Gathering:
    """Stage 3's units for ``buckets`` (``zero.estimator.schedule.BucketBytes``), their schedule told ``timeline``'s
    step once (unpriced): ready for the priced replay of a step after the first. ``prefetch`` and
    ``reshard_after_forward`` are ``ZeroConfig``'s; ``reshard_after_backward=False`` is
    ``ZeroOptimizer.set_reshard_after_backward(False)``'s (a pipeline's units kept gathered from backward to the
    step)."""
    unit_bytes: dict[str, int] = {}
    unit_params: dict[str, set[str]] = {}
    unit_wires: dict[str, list[Wire]] = {}
    for b in buckets:
        unit = b.unit or ""
        unit_bytes[unit] = unit_bytes.get(unit, 0) + b.whole
        unit_params.setdefault(unit, set()).update(b.params)
        unit_wires.setdefault(unit, []).extend([b.wire] if b.wire is not None else [])
    replay = Gathering(unit_bytes, unit_params, prefetch, codec, unit_wires, copies=any(b.secondary for b in buckets),
                       reshard_after_forward=reshard_after_forward)
    replay.order.reshard_after_backward = reshard_after_backward
    for point in timeline.points:
        if point.kind != "op":
            replay.event(point, _nothing)
        elif point.name == "<end of backward>":
            replay.end_backward()
    replay.release_all()
    replay.gathers.clear()
    replay.regathers.clear()
    return replay
