"""The order of gradient reductions, one object shared by the reducer (``zero.runtime.reduction.reducer``) and the
estimator's replay of a step (``zero.estimator.schedule``), so that what is priced is what runs.

Buckets are launched strictly in bucket order, each once all of its gradients are in; at most ``max_in_flight``
reductions are outstanding (launching one more first completes the oldest); the end of backward launches every
bucket not launched yet (missing gradients count as zeros) and then completes the rest, oldest first.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

B = TypeVar("B")  # a bucket: the runtime's Bucket, or the estimator's priced one


class ReductionOrder(Generic[B]):
    """Which bucket launches or completes next; each in-flight bucket carries the caller's token (a handle)."""

    def __init__(self, buckets: Sequence[B], max_in_flight: int):
        self.buckets = list(buckets)  # launch order
        self.max_in_flight = max_in_flight
        self.next = 0  # index of the next bucket to launch
        self.in_flight: deque[tuple[B, Any]] = deque()

    def restart(self) -> None:
        """A new reduction round: every bucket is to be launched again."""
        assert not self.in_flight, "a round starts with no reduction outstanding"
        self.next = 0

    def ready(self, is_complete: Callable[[B], bool]) -> Iterator[B]:
        """The buckets to launch now, in order: from the next one on, each whose gradients are all in."""
        while self.next < len(self.buckets) and is_complete(self.buckets[self.next]):
            self.next += 1
            yield self.buckets[self.next - 1]

    def rest(self) -> Iterator[B]:
        """The end of backward: every bucket not launched yet, in order."""
        return self.ready(lambda bucket: True)

    @property
    def full(self) -> bool:
        """Launching one more must first complete the oldest."""
        return len(self.in_flight) >= self.max_in_flight

    def launched(self, bucket: B, token: Any = None) -> None:
        self.in_flight.append((bucket, token))

    def oldest(self) -> tuple[B, Any]:
        """The reduction to complete next (still outstanding until :meth:`completed`)."""
        return self.in_flight[0]

    def completed(self) -> None:
        self.in_flight.popleft()
