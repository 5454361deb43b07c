"""The delayed step of CPU offload (``offload.delayed_step=True``, opt-in): ZeRO-Offload's one-step delayed
parameter update, which hides the host step behind the next forward and backward.

Synchronous training computes ``w[t+1] = update(w[t], grad(w[t]))``. Here ``step()`` hands this step's
gradients to a background thread that steps the host masters while the caller runs the next forward and
backward, and the next ``step()`` first waits for it and shares the result. The forward of step ``t+1``
therefore still uses ``w[t]`` without the update from ``grad(w[t])`` (one step stale):
``w[t+1] = update(w[t], grad(w[t-1]))``. It is **not** synchronous training, and its numbers differ from
it (``benchmarks/delayed_step.py`` measures by how much); everything else (clipping, accumulation, loss
scaling and skipped steps) works as without it, applied to the gradients being handed over.

The rules that keep it safe:

* the thread steps a copy of the wrapped optimizer's parameter groups taken at ``step()`` (an LR scheduler
  may change the real ones meanwhile) and a copy of the gradients (``zero_grad()`` and the next backward
  may reuse theirs); it shares the optimizer's state, which nothing else touches until it is done;
* ``flush()`` (called by ``state_dict()``, ``load_state_dict()`` and ``gathered_parameters()``) waits and
  shares the last update; call it after the last step before evaluating or saving the model;
* parameters edited in place between steps (``model.load_state_dict()`` outside
  ``gathered_parameters()``) would be overwritten by the masters: the next step detects it and raises.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zero.runtime.buffers.bucket import Bucket
from zero.runtime.step.host_threads import HostThreads
from zero.runtime.step.stepper import BucketStepper


class DelayedStep:
    """One host step in flight at a time, in a background thread (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, threads: HostThreads):
        self.optimizer, self.threads = optimizer, threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-delayed-step")
        self._pending: Future | None = None
        self._fingerprints: dict[int, torch.Tensor] = {}  # per bucket: its parameters as last shared

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def update(self, buckets: list[Bucket], step_kwargs: dict[str, Any], adopt: bool = True) -> list:
        """This step's update (the edits made to the parameters first taken into the masters with ``adopt``),
        started in the background and shared by the next ``step()`` or ``flush()`` (nothing to wait for now)."""
        if adopt:
            for bucket in buckets:
                bucket.adopt_edits()
        self.launch(buckets, step_kwargs)
        self.remember(buckets)
        return []

    def launch(self, buckets: list[Bucket], step_kwargs: dict[str, Any]) -> None:
        """Start stepping the masters of ``buckets`` with the optimizer's gradients of this step (and the
        keyword arguments given to ``step()``)."""
        assert self._pending is None, "finish() the previous step first"
        grads = [b.step_grads.clone() for b in buckets]
        used = [b.used_pieces for b in buckets]  # as of now, not of the next pass
        frozen = copy.copy(self.optimizer)  # same state; groups copied with their hyperparameters of now
        frozen.param_groups = [dict(group) for group in self.optimizer.param_groups]
        self._pending = self._executor.submit(self._run, frozen, buckets, grads, used, dict(step_kwargs))

    def _run(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket], grads: list[torch.Tensor], used: list,
             step_kwargs: dict[str, Any]) -> None:
        with self.threads.scope():  # (in this thread: the main thread's count is its own)
            for bucket, grad, pieces in zip(buckets, grads, used):
                BucketStepper.update_master(bucket, optimizer, grad, pieces, step_kwargs)

    def finish(self) -> bool:
        """Wait for the step in flight (its error, if any, is raised here); whether there was one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        pending.result()
        return True

    def remember(self, buckets: list[Bucket]) -> None:
        """The parameters were just shared: note them, to detect edits before the next share."""
        self._fingerprints = {b.index: _fingerprint(b) for b in buckets}

    def check_unedited(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            seen = self._fingerprints.get(bucket.index)
            if seen is not None and _fingerprint(bucket).view(torch.int64) != seen.view(torch.int64):  # NaN-safe
                raise ValueError(
                    f"the parameters of {bucket} were changed in place while a delayed step was in flight "
                    "(offload.delayed_step=True); the step would overwrite the change. Call opt.flush() before "
                    "editing parameters (or edit them inside opt.gathered_parameters(), which flushes)."
                )


def _fingerprint(bucket: Bucket) -> torch.Tensor:
    """A float64 sum of this rank's parameter chunk: changes with any edit but a contrived one."""
    return torch.sum(bucket.shard, dtype=torch.float64)
