"""Gradient hooks, the gradient state machine, and the reduction round of a backward pass.

Gradient states (:class:`GradState`), checked on every transition::

    EMPTY ──no_sync pass──> ACCUMULATING ──synced pass, or reduce_accumulated()──> REDUCING ──end──> REDUCED
      └──────────────────────synced pass──────────────────────^                        │
    REDUCED ──another pass before step() (stage.reopen)──> ACCUMULATING or REDUCING <──┘
    any state outside a pass ──zero_grad(), or model.zero_grad() on every parameter──> EMPTY
    a pass that died with an error ──> INTERRUPTED ──zero_grad() / model.zero_grad()──> EMPTY

Life of one backward pass:

1. The first gradient *pre*-hook of the pass (before autograd accumulates anything) starts
   it: :meth:`GradReducer.apply_user_grad_edits` applies what the user did to ``p.grad`` since the last
   pass (``model.zero_grad()``, ``p.grad = None``, ``zero_grad(set_to_none=False)``); reduced
   gradients about to receive more are reopened (``stage.reopen``); each ``p.grad`` is pointed
   where autograd should accumulate (``stage.before_pass``); and ``_end_pass`` is queued to run
   when autograd finishes the pass.
2. Each ``post_accumulate_grad`` hook marks its parameter ready; the next gradient's pre-hook
   (or the end of the pass) hands the gradient to the stage (``stage.stage_grad``), so that hooks
   the user registered after ours have run on it first.
3. Buckets are launched strictly in bucket order, each as soon as it and every bucket
   before it are ready: the stage collects its gradients into the buffer to reduce
   (``stage.collect``), then starts the collective (``stage.launch_reduce``). Note: the order
   is what keeps ranks in step. Collectives are matched by the order in which ranks issue
   them, so a bucket that is complete early
   on one rank (its parameters all used) but late on another (one of them unused there)
   still goes out in the same position everywhere.
4. At most ``max_in_flight`` reductions are outstanding; launching one more first
   completes the oldest (``stage.finish_reduce``), which bounds stage 2's memory. With hierarchical
   sharding a launch also starts the sums across the groups of the buckets in flight (``Chain.advance``),
   in launch order on every rank, so that they run during backward rather than after it.
5. When the pass ends, buckets not yet launched are completed with zeros for the
   gradients that never arrived and launched in order; then one small all-reduce tells
   every rank which parameters got a gradient on *any* rank (and, with fp16 loss scaling,
   whether any rank's local gradients overflowed: each bucket is checked as it is collected
   for its reduction, see :mod:`zero.runtime.step.loss_scaler`). The optimizer gives the
   others no gradient at all, exactly as single-process PyTorch leaves ``p.grad = None``.
   At stage 3 the same all-reduce carries a fingerprint of the units each rank gathered,
   so ranks that ran different units are caught here (see ``zero.runtime.gathering.gatherer``).
6. Every parameter with a gradient gets its published ``p.grad`` back (``stage.published_grad``:
   the whole gradient at stage 0, a :class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard at stages 1-3),
   so that what the user does to it before the next pass can be seen.

Inside ``no_sync()`` hooks only record that a gradient exists; the gradients stay local
and the next synchronized pass reduces their sum, or :meth:`GradReducer.reduce_accumulated` does with no pass (a
pipeline schedule's gradient reduction after its last micro-batch, ``zero.pipelining``). A pass that dies with an
error (detected by :class:`~zero.runtime.gathering.backward_pass.BackwardPass`) leaves its gradients incomplete: its
collectives are drained and everything else is refused until the gradients are cleared.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.gathering.backward_pass import BackwardPass
from zero.runtime.gathering.gatherer import ParamGatherer
from zero.runtime.gathering.no_gatherer import NoGatherer
from zero.runtime.parallel.tensor_parallel import NoTensorParallel
from zero.runtime.parallel.ties import NoTie, Tie
from zero.runtime.reduction.agreement import RoundFlags
from zero.runtime.reduction.reduction_order import ReductionOrder
from zero.runtime.reduction.user_edits import apply_user_edit
from zero.runtime.stages.stage import Stage
from zero.runtime.step.loss_scaler import LossScaler, NoLossScaling
from zero.weak import weak_hook


class GradState(enum.Enum):
    EMPTY = "empty"  # no gradient since zero_grad()
    ACCUMULATING = "accumulating"  # local gradients from no_sync() passes, not reduced yet
    REDUCING = "reducing"  # inside a synchronized backward pass
    REDUCED = "reduced"  # reduced gradients, ready for clip_grad_norm_() and step()
    INTERRUPTED = "interrupted"  # a backward pass died with an error: gradients incomplete until cleared


_INTERRUPTED = (
    "the last backward pass failed part-way (an error was raised inside it), so the gradients are "
    "incomplete. Call opt.zero_grad() (or model.zero_grad()) before the next backward pass or step()."
)


class GradReducer:
    """Registers the gradient hooks and runs one reduction round per synchronized backward."""

    def __init__(
        self,
        buckets: list[Bucket],
        stage: Stage, comm: Communicator, max_in_flight: int,
        gatherer: ParamGatherer | NoGatherer,
        check: Callable[[], None], steps: Callable[[], int],
        scaler: LossScaler | NoLossScaling,
        tensor_parallel: NoTensorParallel = NoTensorParallel(),
    ):
        self.buckets = buckets  # launch order
        self.slots = [slot for bucket in buckets for slot in bucket.slots]
        self.stage = stage
        self.comm = comm
        self.gatherer = gatherer  # stage 3: its fingerprint of this step's gathers is compared across ranks
        self.check = check  # run as each pass starts (the model still uses the managed parameters)
        self.steps = steps  # optimizer steps taken so far, compared across ranks at each reduction
        self.scaler = scaler  # fp16: sees each bucket's local gradients; its overflow flag rides on our all-reduce
        self.tensor_parallel = tensor_parallel  # makes tp-partial gradients whole; checks plain ones agree over tp
        self.tie: Tie | NoTie = NoTie()  # a weight tied across pipeline parts: its local gradient summed over them
        self.sync_enabled = True  # False inside no_sync()
        self.divide_factor = 1  # the reduction divides by the dp size times this (a pipeline's micro-batches)
        self.state = GradState.EMPTY
        self._pass = BackwardPass()
        self._reopened = False  # this pass reopened reduced gradients (stage.reopen)
        self._pending: list[ParamSlot] = []  # ready, not yet handed to the stage
        self._order: ReductionOrder[Bucket] = ReductionOrder(buckets, max_in_flight)  # launch order, in flight
        self.hooks = []
        for i, slot in enumerate(self.slots):
            self.hooks.append(slot.param.register_hook(weak_hook(self._before_grad, i)))
            self.hooks.append(slot.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad, i)))

    def _to(self, new: GradState, *allowed: GradState) -> None:
        assert self.state in allowed, f"gradient state {self.state.value} -> {new.value}"
        self.state = new

    def require_reduced(self, what: str) -> None:
        """Raise unless reduced gradients are ready for ``what`` (``step()``, ``clip_grad_norm_()``; their callers
        handle an empty state: no gradient since ``zero_grad()``)."""
        self.drain_interrupted()
        messages = {
            GradState.ACCUMULATING: f"{what} called after a backward pass inside no_sync(): its gradients were "
            "never reduced across ranks. Run the last micro-batch's backward outside no_sync().",
            GradState.REDUCING: f"{what} called inside a backward pass (from a hook?); call it after backward()",
            GradState.INTERRUPTED: f"{what}: {_INTERRUPTED}",
        }
        if self.state in messages:
            raise ValueError(messages[self.state])

    # ----- what the user did to p.grad ------------------------------------------------------------------

    def apply_user_grad_edits(self) -> None:
        """Apply what the user did to the published ``p.grad`` since the last pass, as PyTorch would:
        ``None`` clears the gradient (``model.zero_grad()``), ``zero_()`` on a guard zeroes it, a
        replaced tensor is copied in (stage 0) or refused (stages 1-3)."""
        self.drain_interrupted()
        if self.state is GradState.REDUCING:
            return
        if self.state is GradState.INTERRUPTED:
            if any(slot.grad is not None for slot in self.slots):
                raise ValueError(_INTERRUPTED)
            self.clear()
            return
        for bucket in self.buckets:
            for slot in bucket.slots:
                apply_user_edit(self.stage, bucket, slot, reduced=self.state is GradState.REDUCED)
        if self.state is not GradState.EMPTY and not any(slot.has_grad for slot in self.slots):
            self.clear()  # every gradient was cleared: the same as opt.zero_grad()

    # ----- hooks ----------------------------------------------------------------------------------------

    def _before_grad(self, index: int, grad: torch.Tensor) -> None:
        if self._pass.running:  # (also a backward nested in it: reentrant checkpointing)
            self._hand_ready_to_stage()
        else:
            self._start_pass()

    def _start_pass(self) -> None:
        self.apply_user_grad_edits()
        if self.check is not None:
            self.check()
        self._reopened = self.state is GradState.REDUCED
        for bucket in self.buckets:
            if self._reopened:
                self.stage.reopen(bucket)
            for slot in bucket.slots:
                self.stage.before_pass(bucket, slot)
        self._pass.begin(weak_hook(self._end_pass))

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        slot = self.slots[index]
        slot.used_here = True
        self.tensor_parallel.make_whole(slot)
        if not self.sync_enabled:
            if self.state is not GradState.REDUCING:
                self._to(GradState.ACCUMULATING, GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCED)
            _widen(slot)
            return
        if self.state is not GradState.REDUCING:
            self._open_round()
        if slot.ready:
            raise RuntimeError(
                f"zero: the gradient of {slot.name!r} arrived twice in one backward pass. This happens with "
                "reentrant activation checkpointing (use torch.utils.checkpoint with use_reentrant=False) or "
                "after an earlier backward pass was interrupted by an error (call opt.zero_grad() and retry)."
            )
        slot.ready = True
        self._pending.append(slot)

    def _hand_ready_to_stage(self) -> None:
        """Hand the gradients marked ready to the stage; launch every bucket now complete, in order."""
        for slot in self._pending:
            self.stage.stage_grad(slot.bucket, slot)
            slot.bucket.num_ready += 1
        self._pending.clear()
        for bucket in self._order.ready(lambda b: b.is_ready):
            self._launch(bucket)

    def _open_round(self) -> None:
        self._to(GradState.REDUCING, GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCED)
        for bucket in self.buckets:
            bucket.start_round()
        self._order.restart()

    def _end_pass(self) -> None:
        """Autograd finished the pass: finish its reduction round, if it had one; publish ``p.grad``."""
        self._hand_ready_to_stage()
        reduced = self.state is GradState.REDUCING
        if reduced:
            self._finish_round()
        elif self.state is GradState.REDUCED and self._reopened:  # no gradient came (torch.autograd.grad)
            for bucket in self.buckets:
                self.stage.close(bucket)
        for bucket in self.buckets:
            for slot in bucket.slots:
                if reduced:  # the reduced gradients are in the stage's buffers now, whatever p.grad held
                    slot.grad = self.stage.published_grad(bucket, slot) if slot.used_anywhere else None
                elif slot.used_anywhere:  # a reduced gradient plus this pass's local one, not reduced
                    self.stage.publish_unreduced(bucket, slot)

    def accumulate_written(self, params: list[torch.Tensor]) -> None:
        """Under ``no_sync()``: gradients written into ``p.grad`` by hand, which no hook saw (torch's pipelining's
        weight pass: ``torch.autograd.grad``, then ``p.grad += dw``), recorded as arrived."""
        assert not self.sync_enabled, "gradients written by hand are taken in without a reduction only"
        index = {id(slot.param): i for i, slot in enumerate(self.slots)}
        for i in [index[id(p)] for p in params if id(p) in index and p.grad is not None]:
            self._on_grad(i, self.slots[i].param)

    def reduce_accumulated(self, divide_factor: int) -> None:
        """Reduce the gradients of ``no_sync()`` passes now, with no backward pass, divided by the dp size times
        ``divide_factor`` (a pipeline schedule's reduction after its last micro-batch, and its ``scale_grads``)."""
        self.apply_user_grad_edits()
        if self.state in (GradState.REDUCING, GradState.INTERRUPTED):
            raise ValueError("gradients reduced from inside a backward pass (from a hook?), or after one that failed "
                             "part-way; reduce them after the last micro-batch's backward")
        if self.state is not GradState.ACCUMULATING:
            return  # nothing since the last reduction, or no gradient at all: as a synced pass would leave them
        self._open_round()
        self.divide_factor = divide_factor
        try:
            self._end_pass()
        finally:
            self.divide_factor = 1

    # ----- collectives -----------------------------------------------------------------------------------

    def _launch(self, bucket: Bucket) -> None:
        if self._order.full:
            self._complete_oldest()
        for _, handle in self._order.in_flight:  # hierarchical sharding: the sums across the groups of the
            handle.advance()  # buckets launched before start now, during backward (by then inside is mostly done)
        grads = self.stage.collect(bucket)
        self.tie.sum_local(bucket, grads)
        self.scaler.observe(grads)
        self.tensor_parallel.observe(bucket, grads)
        handle = self.stage.launch_reduce(bucket, self.comm, self.divide_factor)
        bucket.staging.start_collective()
        self._order.launched(bucket, handle)

    def _complete_oldest(self) -> None:
        bucket, handle = self._order.oldest()
        self._order.completed()
        handle.wait()
        bucket.staging.end_collective()
        self.stage.finish_reduce(bucket)

    def _finish_round(self) -> None:
        """End of a synchronized pass: launch what is left, agree on used parameters, drain."""
        for bucket in self._order.rest():
            for slot in bucket.slots:
                if not slot.ready:
                    self.stage.stage_grad(bucket, slot)
            self._launch(bucket)
        mine = RoundFlags(used=[slot.used_here for slot in self.slots], steps=self.steps(),
                          gathers=self.gatherer.fingerprint_flags(), overflow=self.scaler.local_flags(self.comm.device))
        flags = mine.pack(self.comm.device)
        self.comm.all_reduce(flags, op="max", what="all-reduce of which parameters got gradients",
                             every_group=True).wait()
        while self._order.in_flight:
            self._complete_oldest()
        # Note: the one host read of a device value in a training step. The host waits here for backward and its
        # reductions to finish on the device; it decides which parameters get a gradient and refuses a step on
        # gradients of ranks that diverged before step() can use them (never a silent step).
        agreed = mine.unpack(flags.tolist())
        self.scaler.agree(agreed.overflow)
        for slot, used in zip(self.slots, agreed.used):
            slot.used_anywhere = used
        self._to(GradState.REDUCED, GradState.REDUCING)
        if not agreed.steps_agree:
            self.clear()
            raise RuntimeError(
                f"zero: ranks have taken different numbers of optimizer steps (this rank: {mine.steps}): a rank "
                "skipped step() (or took an extra one), e.g. under a condition on its own loss or data, so the "
                "ranks' models have diverged. Every rank must call step() at the same points."
            )
        if not self.gatherer.fingerprints_agree(agreed.gathers):
            self.clear()  # step() must not use these gradients
            raise RuntimeError(
                "zero: ranks gathered different stage-3 units (or in a different order) in this forward/backward: "
                "their control flow diverged (e.g. a branch or loop count that depends on each rank's data), so "
                "parameters were exchanged between mismatched units and this step's gradients are wrong. Make "
                "every rank run the same modules in the same order."
            )
        try:
            self.tensor_parallel.check_round(self.comm)
        except ValueError:
            self.clear()  # step() must not use these gradients
            raise

    # ----- clearing -----------------------------------------------------------------------------------

    def drain_interrupted(self) -> None:
        """If the last pass died with an error: drain its collectives (every rank issued them, or the
        wait times out) and mark the gradients incomplete."""
        if not self._pass.interrupted:
            return
        self._pass.forget()
        self._pending.clear()
        while self._order.in_flight:
            self._complete_oldest()
        self.state = GradState.INTERRUPTED

    def clear(self) -> None:
        """Drop every gradient (``zero_grad(set_to_none=True)``): the stage frees what it can."""
        self.drain_interrupted()
        for bucket in self.buckets:
            self.stage.zero_grad(bucket, set_to_none=True)
        self.scaler.reset()
        self.state = GradState.EMPTY
        for slot in self.slots:
            slot.used_here = False
            slot.used_anywhere = False
            slot.wide_grad = None

    def zero(self) -> None:
        """Zero every gradient in place (``zero_grad(set_to_none=False)``): parameters that had one keep it
        (after an interrupted pass, every gradient is dropped)."""
        self.drain_interrupted()
        if self.state is GradState.INTERRUPTED:
            self.clear()
            return
        self.apply_user_grad_edits()
        if self.state is not GradState.EMPTY:
            for bucket in self.buckets:
                self.stage.zero_grad(bucket, set_to_none=False)
        for slot in self.slots:
            slot.wide_grad = None
        self.scaler.reset()


def _widen(slot: ParamSlot) -> None:
    """Under ``no_sync()`` with a reduce dtype wider than the parameters' (bf16 parameters, fp32 reduction): the pass's
    gradient moved into an accumulator in the reduce dtype, where micro-batches add up (as FSDP2 does; the reduction
    adds it in, ``StagedGradients.collect``); ``p.grad`` zeroed in place for the next pass (``0 + g`` is exact)."""
    dtypes = slot.bucket.dtypes
    grad = slot.grad
    if grad is None or dtypes.reduce.itemsize <= dtypes.compute.itemsize:
        return
    if slot.wide_grad is None:
        slot.wide_grad = grad.to(dtypes.reduce)
    else:
        slot.wide_grad.add_(grad)
    grad.zero_()
