"""Progress of long byte-moving work (checkpoint saves, loads and exports), printed or handed to a callback."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO, Union

ProgressCallback = Callable[[int, int], None]  # (bytes done, bytes in all)
ProgressArg = Union[bool, ProgressCallback]


class ByteMeter:
    """Counts bytes done out of ``total``.

    ``report`` is ``True`` (print to stderr: a line every ``interval_s`` while the work lasts, and a
    closing line with the throughput), ``False`` (silent) or a callable, called with ``(done, total)``
    as the work advances.
    """

    def __init__(self, what: str, total: int, report: ProgressArg = True, *, interval_s: float = 5.0,
                 stream: TextIO | None = None):
        self.what = what
        self.total = total
        self.done = 0
        self.report = report
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self._last_print = self.started

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if callable(self.report):
            self.report(self.done, self.total)
        elif self.report and time.perf_counter() - self._last_print >= self.interval_s:
            self._last_print = time.perf_counter()
            share = 100.0 * self.done / self.total if self.total else 100.0
            self._print(f"{self.what}: {_gb(self.done)} of {_gb(self.total)} ({share:.0f}%)")

    def finish(self, outcome: str) -> None:
        """The closing line, e.g. ``finish("saved ckpt/ (3 files)")``."""
        if self.report is True:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self._print(f"{outcome}: {_gb(self.done)} in {elapsed:.1f} s ({self.done / elapsed / 1e9:.2f} GB/s)")

    def _print(self, text: str) -> None:
        print(f"zero: {text}", file=self.stream, flush=True)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
