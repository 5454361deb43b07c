"""Which autograd backward pass a hook runs in: a new one, the one running, or one that died.

Note: a hook knows its pass only by the graph task id, and a new id means one of three things:
a new pass; a backward nested inside the running pass (reentrant activation checkpointing runs
one inside a node of the outer pass); or the previous pass died with an error and a new one
began. :meth:`BackwardPass.begin` queues the end-of-pass callback on the pass's graph task and
keeps only a weak reference to it. The engine holds the callback until it runs, and drops it
when the task dies with an error, so "the callback is still alive" means "the pass is still
running" (a new id then means a nested backward), and "begun but not ended, callback gone"
means it was interrupted.

A pass whose first hook ran inside a nested backward (reentrant checkpointing of a block whose
outputs get the first gradients, e.g. under a frozen head) has its callback queued on the nested
task, which ends first: the callback then hooks the outer node it ran in, whose hook queues it
again on the outer task, so the pass ends with the outermost one. The hook holds the callback,
so the pass stays running in between.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class BackwardPass:
    """Tracks one pass at a time for one set of hooks (see the module docstring)."""

    def __init__(self) -> None:
        self._open = False  # begun, and its end has not run
        self._end: weakref.ref | None = None  # the queued end-of-pass callback, while the engine holds it

    @property
    def running(self) -> bool:
        """A pass has begun and its graph task is alive (a hook with another task id runs nested in it)."""
        return self._open and self._end is not None and self._end() is not None

    @property
    def interrupted(self) -> bool:
        """A pass began but its graph task died before its end (an error inside backward)."""
        return self._open and not self.running

    def begin(self, on_end: Callable[[], None]) -> None:
        """Start a pass in the current graph task; ``on_end()`` runs when autograd finishes it."""

        def end() -> None:
            outer = torch._C._current_autograd_node()
            if outer is not None:  # a nested pass ended inside a node of an outer one: end with the outer pass
                # (the hook holds the callback, by a default argument: a reference from the callback's own
                # closure would be a cycle, keeping it alive after a pass that dies with an error)
                outer.register_hook(lambda grad_inputs, grad_outputs, again=self._end(): engine.queue_callback(again))
                return
            self._open, self._end = False, None
            on_end()

        engine = torch.autograd.Variable._execution_engine
        self._open, self._end = True, weakref.ref(end)
        engine.queue_callback(end)

    def forget(self) -> None:
        """Drop an interrupted pass."""
        self._open, self._end = False, None
