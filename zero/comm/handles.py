"""What a :class:`~zero.comm.communicator.Communicator` returns and counts: the :class:`Handle` of an in-flight
collective (timeout, abort, time waited) and the per-kind counters of payload and bytes on the wire
(:class:`CommStats`)."""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class KindStats:
    calls: int = 0
    numel: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # seconds this rank spent in the handles' wait(): the part not hidden behind other work


@dataclass
class CommStats:
    """Payload counters and time waited per collective kind: ``current`` (this step) and ``last_step``."""

    current: dict[str, KindStats] = field(default_factory=lambda: defaultdict(KindStats))
    last_step: dict[str, KindStats] = field(default_factory=dict)

    def record(self, kind: str, tensor: torch.Tensor, *, sent: bool = True) -> KindStats:
        """Count one collective of payload ``tensor``; its handle adds the time waited for it to the returned
        entry. ``sent=False``: a codec sends it, and its :class:`GroupTransport` counts the bytes on the wire."""
        entry = self.current[kind]
        entry.calls += 1
        entry.numel += tensor.numel()
        if sent:
            entry.bytes += tensor.numel() * tensor.element_size()
        return entry

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        self.current = defaultdict(KindStats)

    def as_dict(self, which: str = "last_step") -> dict[str, dict[str, float]]:
        stats = self.last_step if which == "last_step" else self.current
        return {kind: vars(entry).copy() for kind, entry in sorted(stats.items())}


class Handle:
    """An in-flight collective; ``wait()`` raises a descriptive error on timeout.

    ``on_failure`` runs before that error is raised (the communicator aborts its group); the seconds spent
    waiting are added to ``stats`` (the collective's entry in ``CommStats``).
    """

    def __init__(
        self,
        work: Any,
        what: str,
        timeout: datetime.timedelta,
        on_failure: Callable[[], None] | None = None,
        stats: KindStats | None = None,
    ):
        self._work = work
        self.what = what
        self._timeout = timeout
        self._on_failure = on_failure
        self._stats = stats

    def advance(self) -> None:
        """Nothing: a collective of one phase is under way once started (see :meth:`Chain.advance`)."""

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        start = time.perf_counter()
        try:
            work.wait(timeout=self._timeout)
            if self._stats is not None:
                self._stats.wait_s += time.perf_counter() - start
        except RuntimeError as err:
            if self._on_failure is not None:
                self._on_failure()
            raise RuntimeError(
                f"zero: {self.what} did not complete within {self._timeout.total_seconds():g}s ({err}). "
                "A rank may have died, or ranks took different paths (a different number of backward "
                "passes, steps or clip_grad_norm_ calls, or different models). Check every rank's log; "
                "raise ZeroConfig.timeout_s if a step is simply slow. The process group was aborted so "
                "that this process can exit; later collectives on it will fail."
            ) from err


class Chain:
    """A collective in two phases (hierarchical sharding: inside the group, then across the groups): ``advance()``
    waits for ``first`` and starts the second phase (``then()``, returning its handle); ``wait()`` also waits for
    that. Every rank must advance and wait for its chains in the same order: it is the order in which the second
    phases go out on the group across."""

    def __init__(self, first: Handle, then: Callable[[], Handle]):
        self.first = first
        self._then: Callable[[], Handle] | None = then
        self._second: Handle | Chain | None = None

    def advance(self) -> None:
        if self._then is not None:
            self.first.wait()
            then, self._then = self._then, None
            self._second = then()

    def wait(self) -> None:
        self.advance()
        if self._second is not None:
            second, self._second = self._second, None
            second.wait()
