"""Stage 3's gathered units, replayed from a traced step's module events as ``zero.runtime.gatherer`` runs them
(see :mod:`zero.estimator.schedule`): gather before a unit's forward and when backward reaches it, prefetch the
next unit in the previous pass's order, release a unit when the next one starts, when its backward is over (its
inputs' gradients computed and its parameters' gradients arrived) and at the end of backward, keep the root until
the step. It counts each unit's gathers and, of those, the ones backward issues while the unit's copy is current
(gathered since every unit was last released: hpZ's gathers from its secondary copies, ``zero.runtime.secondary``),
and what a quantized gather's packets hold (:mod:`zero.estimator.codec_memory`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from zero.estimator.codec_memory import CodecMemory
from zero.estimator.timeline import Point, Timeline
from zero.estimator.traffic import Wire


@dataclass
class Gathering:
    """Stage 3's gathered units, replayed from the trace's module events."""

    unit_bytes: dict[str, int]
    unit_params: dict[str, set[str]]
    unit_of: dict[str, str]  # parameter -> its unit
    forward_order: list[str]
    backward_order: list[str]
    prefetch: int
    codec: CodecMemory = CodecMemory()
    unit_wires: dict[str, list[Wire]] = field(default_factory=dict)
    copies: bool = False  # hpZ's secondary copies exist (backward's gathers from them are exact)
    gathered: set[str] = field(default_factory=set)
    prefetched: set[str] = field(default_factory=set)  # gathering, not yet waited for (the tracker's "communication")
    packets: dict[str, int] = field(default_factory=dict)  # what each unit's gather in flight holds (its codec's)
    transient: int = 0  # a gather being decoded: its packets and the decoding's slice
    finished: str | None = None
    got: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # forward calls whose inputs' gradients are not computed
    in_backward: set[str] = field(default_factory=set)
    gathers: dict[str, int] = field(default_factory=dict)  # all-gathers issued, by unit (zero.estimator.traffic)
    regathers: dict[str, int] = field(default_factory=dict)  # ... of which in backward, the unit's copy current
    current: set[str] = field(default_factory=set)  # units gathered since every unit was last released
    backward: bool = False  # the event being replayed runs inside autograd's backward

    @property
    def bytes(self) -> int:
        """Gathered and waited for."""
        return sum(self.unit_bytes[u] for u in self.gathered - self.prefetched)

    @property
    def in_flight(self) -> int:
        return sum(self.unit_bytes[u] + self.packets.get(u, 0) for u in self.prefetched)

    def _gather(self, units: set[str]) -> None:
        for unit in units - self.gathered:  # (a unit already gathered sends nothing)
            self.gathers[unit] = self.gathers.get(unit, 0) + 1
            regather = self.backward and unit in self.current
            if regather:
                self.regathers[unit] = self.regathers.get(unit, 0) + 1
            wires = self.unit_wires.get(unit, [])
            self.packets[unit] = 0 if regather and self.copies else sum(self.codec.gathering(w) for w in wires)
            self.current.add(unit)  # (a gather from the copies leaves the copy current)
        self.gathered |= units

    def _use(self, unit: str, on_peak: Callable[[], None]) -> None:
        self._gather({unit})
        self.prefetched.discard(unit)
        packets = self.packets.pop(unit, 0)
        if packets:  # decoded while every packet of the unit is still held
            self.transient = packets + max(self.codec.gather_decode(w) for w in self.unit_wires[unit])
            on_peak()
            self.transient = 0

    def _prefetch(self, order: list[str], unit: str) -> None:
        at = order.index(unit) + 1 if unit in order else len(order)
        started = set(order[at : at + self.prefetch]) - self.gathered
        self._gather(started)
        self.prefetched |= started

    def _release_finished(self, keep: str) -> None:
        finished, self.finished = self.finished, None
        if finished is not None and finished != keep and finished not in self.in_backward:
            self.gathered.discard(finished)

    def event(self, point: Point, on_peak: Callable[[], None]) -> None:
        """Replay ``point``; ``on_peak()`` is called at each transient moment (a gather decoded)."""
        name = point.name
        self.backward = point.phase == "backward"  # (the trace's phase is the runtime's test: a graph task runs)
        if point.kind == "enter" and name in self.unit_bytes and point.phase == "forward":
            self._release_finished(keep=name)
            self._use(name, on_peak)
            self._prefetch(self.forward_order, name)
        elif point.kind == "enter" and name in self.unit_bytes:  # recomputed in backward
            self._use(name, on_peak)
        elif point.kind == "leave" and name in self.unit_bytes and point.phase == "forward" and name:
            self._release_finished(keep=name)
            self.finished = name
        elif point.kind == "reach" and name in self.unit_bytes and name not in self.in_backward:
            self.in_backward.add(name)
            self._use(name, on_peak)
            self._prefetch(self.backward_order, name)
        elif point.kind == "hooked" and name in self.unit_bytes:
            self.pending[name] = self.pending.get(name, 0) + 1
        elif point.kind == "done" and name in self.unit_bytes:
            self.pending[name] = max(0, self.pending.get(name, 0) - 1)
            self._release_if_done(name)
        elif point.kind == "grad":
            unit = self.unit_of.get(name)
            if unit is None:  # (not a managed parameter)
                return
            self.got[unit] = self.got.get(unit, 0) + 1
            self._release_if_done(unit)

    def _release_if_done(self, unit: str) -> None:
        done = self.pending.get(unit, 0) == 0 and self.got.get(unit, 0) >= len(self.unit_params[unit])
        if done and unit in self.in_backward:
            if unit:
                self.gathered.discard(unit)
            self.in_backward.discard(unit)

    def end_backward(self) -> None:
        self.gathered &= {""}
        self.prefetched &= {""}
        self.current.clear()  # (every unit released, the root kept: ParamGatherer.reshard_all forgets the copies)

    def release_all(self) -> None:
        self.gathered.clear()
        self.prefetched.clear()
        self.current.clear()


def gathering(timeline: Timeline, buckets: tuple, prefetch: int, codec: CodecMemory) -> Gathering:
    """The replay of stage 3's units for ``buckets`` (``zero.estimator.schedule.BucketBytes``) over ``timeline``."""
    unit_bytes: dict[str, int] = {}
    unit_params: dict[str, set[str]] = {}
    unit_wires: dict[str, list[Wire]] = {}
    for b in buckets:
        unit = b.unit or ""
        unit_bytes[unit] = unit_bytes.get(unit, 0) + b.whole
        unit_params.setdefault(unit, set()).update(b.params)
        unit_wires.setdefault(unit, []).extend([b.wire] if b.wire is not None else [])

    def order(kind: str, phase: str) -> list[str]:  # the units in the order the trace first met them
        return list(dict.fromkeys(p.name for p in timeline.points if p.kind == kind and p.phase == phase
                                  and p.name in unit_bytes))

    unit_of = {p: unit for unit, params in unit_params.items() for p in params}
    return Gathering(unit_bytes, unit_params, unit_of, order("enter", "forward"), order("reach", "backward"),
                     prefetch, codec, unit_wires, copies=any(b.secondary for b in buckets))
