"""Stepping the wrapped optimizer one bucket at a time, with the kernel that suits the bucket.

The optimizer step is split by bucket so that each bucket's updated parameters can be shared while
the next one steps: the all-gather of stages 1-2 (launched by the caller) and, with CPU offload, the
copy of the low-precision parameters back up to the GPU run behind the next bucket's host step. A
bucket is stepped by giving only its pieces a ``.grad`` and calling each flat optimizer's ``step()``
(``zero.runtime.step.inner``): torch optimizers skip parameters without a gradient, and every optimizer
on this path acts element by element, so the split changes no number. The whole-parameter optimizers
have stepped before (``zero.runtime.step.owner_step``), writing their updates into the same master chunks.

``ZeroConfig.step_kernel`` chooses the kernel of mixed-precision Adam and AdamW on the device:

* ``"torch"``: the wrapped optimizer, then the master cast into the bf16 parameters (two passes);
* ``"triton"``: one Triton pass per bucket (``zero.runtime.step.flat_step``, ``zero.kernels.triton_adamw``) that
  reads the gradient, master, m and v and writes master, m, v and the bf16 parameter, with no host read of a
  device value; the optimizer's state keeps torch's format (``step``, ``exp_avg``, ``exp_avg_sq``), so
  checkpoints and schedulers are unaffected;
* ``"auto"`` (default): Triton where it applies (a CUDA device, Triton installed, bf16 parameters with fp32
  masters kept on the device, Adam/AdamW without ``amsgrad``, ``maximize`` or ``differentiable``),
  otherwise torch. The offloaded (host) step is always torch's, whose fused CPU kernel is at memory
  bandwidth (``benchmarks/optimizer_step.py``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from zero.config import StepKernel
from zero.runtime.buffers.bucket import Bucket, LocalPiece
from zero.runtime.buffers.plan import Role
from zero.runtime.offload.paging import Resident
from zero.runtime.step.flat_step import FlatAdamW
from zero.runtime.step.host_threads import HostThreads
from zero.runtime.step.inner import Inner
from zero.runtime.step.owner_step import OwnerStep


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_unsuitable(optimizer: torch.optim.Optimizer, bucket: Bucket) -> str | None:
    """Why the Triton step cannot step ``bucket`` (``None``: it can)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"it implements Adam and AdamW only (got {type(optimizer).__name__})"
    for key in ("amsgrad", "maximize", "differentiable"):
        if any(group.get(key) for group in optimizer.param_groups):
            return f"it does not implement {key}=True"
    if not bucket.plan.has(Role.MASTER) or bucket.dtypes.compute != torch.bfloat16:
        return "it steps fp32 masters into bf16 parameters (precision.param_dtype='bf16')"
    if bucket.offloaded:
        return "the offloaded step runs on the host (torch's fused CPU kernel)"
    device = bucket.master.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {device.type}, not CUDA (TRITON_INTERPRET=1 runs it on the CPU, for tests)"
    return None


class BucketStepper:
    """Steps the flat optimizers bucket by bucket (see the module docstring)."""

    def __init__(self, inners: list[Inner], buckets: list[Bucket], kernel: StepKernel):
        self.inners = [inner for inner in inners if not inner.whole]
        self.triton: set[int] = set()  # indices of the buckets the Triton step takes
        optimizer = self.inners[0].optimizer if self.inners else None
        self.flat = FlatAdamW(optimizer)
        if kernel == "auto":
            buckets = [b for b in buckets if b.master.device.type == "cuda"]
        if kernel == "torch" or not buckets:
            return
        if len(inners) > 1 or optimizer is None:  # (the Triton step reads one optimizer's groups)
            if kernel == "triton":
                raise ValueError("step_kernel='triton' steps a single Adam or AdamW optimizer; with several "
                                 "optimizers, or one stepped on whole parameters, use step_kernel='auto' or 'torch'")
            return
        if not triton_available():
            if kernel == "triton":
                raise ValueError("step_kernel='triton' needs the triton package (pip install triton), or use 'auto'")
            return
        for bucket in buckets:
            reason = triton_unsuitable(optimizer, bucket)
            if reason is None:
                self.triton.add(bucket.index)
            elif kernel == "triton":
                raise ValueError(f"step_kernel='triton' cannot step {bucket}: {reason}. Use step_kernel='auto'.")

    @torch.no_grad()
    def step(self, bucket: Bucket, step_kwargs: dict[str, Any]) -> None:
        """Update the bucket's master chunk and this rank's chunk of its parameters (``step_kwargs``: what
        the user passed to ``step()``, for an optimizer whose ``step`` takes more than a closure)."""
        if bucket.index in self.triton and not step_kwargs:
            self.flat.step(bucket)
            return
        self.flat.forget_counts(bucket)  # (the torch step advances the counts the Triton step keeps)
        for inner in self.inners:
            pieces = [p for p in bucket.used_pieces if p.slot.group_index in inner.groups]
            if pieces:
                self.update_master(bucket, inner.optimizer, pieces=pieces, step_kwargs=step_kwargs)
        bucket.push_master()

    @staticmethod
    @torch.no_grad()
    def update_master(
        bucket: Bucket,
        optimizer: torch.optim.Optimizer,
        grads: torch.Tensor | None = None,
        pieces: list[LocalPiece] | None = None,
        step_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Step ``optimizer`` (the wrapped one, or a copy of it: ``zero.runtime.step.delayed``) over the bucket's
        ``pieces`` (default: those of parameters with a gradient), with the optimizer's gradients, or the pieces of
        ``grads`` (a chunk-sized tensor) if given."""
        if pieces is None:
            pieces = bucket.used_pieces
        for piece in pieces:
            piece.tensor.grad = (
                bucket.grad_piece(piece) if grads is None
                else grads.narrow(0, piece.piece.chunk_start, piece.piece.numel)
            )
        try:
            # the class's step: not a wrapper an LR scheduler set on the instance
            type(optimizer).step(optimizer, **(step_kwargs or {}))
        finally:
            for piece in pieces:
                piece.tensor.grad = None


class ImmediateUpdate:
    """The synchronous update (without ``offload.delayed_step``): each bucket takes the edits made to its parameters,
    is stepped, then its parameters are shared (stages 1-2) while the next one steps, one bucket after the other in a
    walk of ``paging`` (``zero.runtime.offload.paging``: on disk, read ahead and written back around its turn).
    Nothing is ever pending (the interface of ``DelayedStep``)."""

    pending = False

    def __init__(self, stepper: BucketStepper, whole_parameter_step: OwnerStep, stage: Any, comm: Any,
                 paging: Resident, threads: HostThreads):
        self.stepper, self.whole_parameter_step, self.stage, self.comm = stepper, whole_parameter_step, stage, comm
        self.paging, self.threads = paging, threads

    def update(self, buckets: list[Bucket], step_kwargs: dict[str, Any], adopt: bool = True) -> list:
        """Step the whole parameters, then every bucket (first taking the edits into its master with ``adopt``); the
        handles of the parameters' all-gathers (``None`` where nothing is gathered)."""
        handles = []
        with self.threads.scope():
            if self.whole_parameter_step.active:  # (the owners read the masters: every edit taken first)
                for bucket in buckets if adopt else []:
                    bucket.adopt_edits()
                adopt = False
                self.whole_parameter_step.step(step_kwargs)
            for bucket in self.paging.walk(buckets):
                if adopt:
                    bucket.adopt_edits()
                self.stepper.step(bucket, step_kwargs)
                handles.append(self.stage.gather_params(bucket, self.comm))
        return handles

    def remember(self, buckets: list[Bucket]) -> None:
        pass

    def check_unedited(self, buckets: list[Bucket]) -> None:
        pass

    def finish(self) -> bool:
        return False
