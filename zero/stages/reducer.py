"""Gradient hooks and the reduction round of one backward pass, shared by every stage.

Data flow in one synchronized backward pass (a *round*):

1. The first gradient hook of the pass opens the round and asks autograd to call
   ``_finish_round`` when the pass ends.
2. Each ``post_accumulate_grad`` hook hands its parameter's gradient to the stage
   (``stage.stage_grad``) and marks it ready.
3. Buckets are launched strictly in bucket order, each as soon as it and every bucket
   before it are ready. Note: the order is what keeps ranks in step. Collectives are
   matched by the order in which ranks issue them, so a bucket that is complete early
   on one rank (its parameters all used) but late on another (one of them unused there)
   still goes out in the same position everywhere.
4. At most ``max_in_flight`` reductions are outstanding; launching one more first
   completes the oldest (``stage.finish_reduce``), which bounds stage 2's memory.
5. When the pass ends, buckets not yet launched are completed with zeros for the
   gradients that never arrived and launched in order; then one small all-reduce tells
   every rank which parameters got a gradient on *any* rank. The optimizer gives the
   others no gradient at all, exactly as single-process PyTorch leaves ``p.grad = None``.
   At stage 3 the same all-reduce carries a fingerprint of the units each rank gathered,
   so ranks that ran different units are caught here (see ``zero.stages.gatherer``).

Inside ``no_sync()`` hooks only record that a gradient exists; the gradients stay local
and the next synchronized pass reduces their sum.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Callable

import torch

from zero.bucket import Bucket
from zero.comm import Communicator, Handle
from zero.stages.stage0 import Stage0
from zero.weak import weak_hook


class RoundState(enum.Enum):
    IDLE = "idle"  # no reduction in progress
    REDUCING = "reducing"  # inside a synchronized backward pass


class GradReducer:
    """Registers the gradient hooks and runs one reduction round per synchronized backward."""

    def __init__(
        self,
        buckets: list[Bucket],
        stage: Stage0,
        comm: Communicator,
        max_in_flight: int,
        fingerprint: Callable[[], int] | None = None,
    ):
        self.buckets = buckets  # launch order
        self.slots = [slot for bucket in buckets for slot in bucket.slots]
        self.stage = stage
        self.comm = comm
        self.max_in_flight = max_in_flight
        self.fingerprint = fingerprint  # stage 3: hash of this step's gathers, compared across ranks
        self.sync_enabled = True  # False inside no_sync()
        self.state = RoundState.IDLE
        self.has_reduced = False  # reduced gradients are available for step()
        self.has_unreduced_local = False  # gradients from no_sync() passes wait for a synced pass
        self._next = 0  # index of the next bucket to launch
        self._in_flight: deque[tuple[Bucket, Handle]] = deque()
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad, i))
            for i, slot in enumerate(self.slots)
        ]


    # ----- hooks ----------------------------------------------------------------------------------------

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        slot = self.slots[index]
        slot.used_here = True
        if not self.sync_enabled:
            self.has_unreduced_local = True
            return
        if self.state is RoundState.IDLE:
            self._open_round()
        if slot.ready:
            raise RuntimeError(
                f"zero: the gradient of {slot.name!r} arrived twice in one backward pass. This happens with "
                "reentrant activation checkpointing (use torch.utils.checkpoint with use_reentrant=False) or "
                "after an earlier backward pass was interrupted by an error (call opt.zero_grad() and retry)."
            )
        slot.ready = True
        bucket = slot.bucket
        self.stage.stage_grad(bucket, slot)
        bucket.num_ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].is_ready:
            self._launch(self.buckets[self._next])

    def _open_round(self) -> None:
        for bucket in self.buckets:
            bucket.start_round()
        self._next = 0
        self.state = RoundState.REDUCING
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_round)

    # ----- collectives -----------------------------------------------------------------------------------

    def _launch(self, bucket: Bucket) -> None:
        if len(self._in_flight) >= self.max_in_flight:
            self._complete_oldest()
        self._in_flight.append((bucket, self.stage.launch_reduce(bucket, self.comm)))
        self._next += 1

    def _complete_oldest(self) -> None:
        bucket, handle = self._in_flight.popleft()
        handle.wait()
        self.stage.finish_reduce(bucket)

    def _finish_round(self) -> None:
        """End of the backward pass: launch what is left, agree on used parameters, drain."""
        for bucket in self.buckets[self._next :]:
            for slot in bucket.slots:
                if not slot.ready:
                    self.stage.stage_grad(bucket, slot)
            self._launch(bucket)
        local = [int(slot.used_here) for slot in self.slots]
        if self.fingerprint is not None:
            value = self.fingerprint()
            local += [value, -value]  # MAX of both: equal to (value, -value) only if every rank had value
        flags = torch.tensor(local, dtype=torch.int32)
        self.comm.all_reduce(flags, op="max", what="all-reduce of which parameters got gradients").wait()
        while self._in_flight:
            self._complete_oldest()
        agreed = flags.tolist()
        for slot, used in zip(self.slots, agreed):
            slot.used_anywhere = bool(used)
        self.state = RoundState.IDLE
        self.has_unreduced_local = False
        if self.fingerprint is not None and agreed[-2] != -agreed[-1]:
            self.has_reduced = False  # step() must not use these gradients
            raise RuntimeError(
                "zero: ranks gathered different stage-3 units (or in a different order) in this forward/backward: "
                "their control flow diverged (e.g. a branch or loop count that depends on each rank's data), so "
                "parameters were exchanged between mismatched units and this step's gradients are wrong. Make "
                "every rank run the same modules in the same order."
            )
        self.has_reduced = True

    def reset(self) -> None:
        """Forget gradients (after ``zero_grad(set_to_none=True)``)."""
        assert self.state is RoundState.IDLE, "zero_grad() inside a backward pass"
        self.has_reduced = False
        self.has_unreduced_local = False
        for slot in self.slots:
            slot.used_here = False
            slot.used_anywhere = False
