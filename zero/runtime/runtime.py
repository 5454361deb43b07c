"""``Runtime``: the assembled parts of one ``ZeroOptimizer`` (see ``zero.runtime.build``) and the training
operations over them: clipping, the step, clearing gradients, closing.

Absent parts are null objects, so each operation reads as one straight line: below stage 3 the gatherer is a
``NoGatherer``, without fp16 the scaler is ``NoLossScaling``, without ``offload.delayed_step`` the update is an
``ImmediateUpdate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from zero.comm.communicator import Communicator
from zero.config import ZeroConfig
from zero.kernels.grad_norm import scale_, tensor_norms, total_norm
from zero.precision import DTYPES
from zero.runtime.buffers.bucket import Bucket, LocalPiece
from zero.runtime.buffers.partition import Partition
from zero.runtime.buffers.placement import Placements
from zero.runtime.gathering.gatherer import ParamGatherer
from zero.runtime.gathering.no_gatherer import NoGatherer
from zero.runtime.gathering.release import ModelRelease
from zero.runtime.guards.ddp import check_not_called_by_ddp
from zero.runtime.guards.ownership import OwnershipMarker, check_model
from zero.runtime.offload.paging import Resident
from zero.runtime.parallel.pipeline import NoPipelineRanks, PipelineRanks
from zero.runtime.parallel.tensor_parallel import NoTensorParallel
from zero.runtime.parallel.ties import report
from zero.runtime.precision.casts import cast_inputs
from zero.runtime.reduction.reducer import GradReducer, GradState
from zero.runtime.reduction.user_edits import refuse_hand_written
from zero.runtime.stages import Stage
from zero.runtime.step.delayed import DelayedStep
from zero.runtime.step.inner import Inner
from zero.runtime.step.loss_scaler import LossScaler, NoLossScaling
from zero.runtime.step.owner_step import OwnerStep
from zero.runtime.step.stepper import BucketStepper, ImmediateUpdate


@dataclass(eq=False)
class Runtime:
    """One rank's optimizer runtime; built once by :func:`zero.runtime.build.build_runtime`."""

    config: ZeroConfig
    module: torch.nn.Module
    comm: Communicator
    stage: Stage
    partition: Partition
    placements: Placements
    marker: OwnershipMarker  # what the managed parameters are marked with (zero.runtime.guards.ownership)
    inners: list[Inner]  # the wrapped optimizers, each rebuilt over this rank's share (zero.runtime.step.inner)
    stepper: BucketStepper
    whole_parameter_step: OwnerStep  # the whole-parameter optimizers' owners and exchange (inert without one)
    update: ImmediateUpdate | DelayedStep
    scaler: LossScaler | NoLossScaling
    gatherer: ParamGatherer | NoGatherer
    paging: Resident  # how passes over the optimizer side walk the buckets (WindowPaging: through host memory)
    tensor_parallel: NoTensorParallel  # the model's tp dimension (zero.runtime.parallel.tensor_parallel)
    pipeline: NoPipelineRanks | PipelineRanks = field(default_factory=NoPipelineRanks)  # its pp dimension (joined)
    checkpointed: Any = None  # the activation checkpointing applied (None without a policy)
    reducer: GradReducer = field(init=False)
    release: ModelRelease = field(init=False)
    first_forward_hook: Any = field(init=False)
    steps: int = 0  # step() calls so far (compared across ranks at each gradient reduction)
    grads_prepared: bool = False  # the optimizer's gradients of this step are made (see master_grads)

    @property
    def buckets(self) -> list[Bucket]:
        return self.partition.buckets

    @property
    def trainable_buckets(self) -> list[Bucket]:
        return self.partition.trainable_buckets

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, rebuilt over this rank's share (when there is one: see :attr:`inners`)."""
        if len(self.inners) != 1:
            raise ValueError(f"this ZeroOptimizer wraps {len(self.inners)} optimizers; use its .optimizers (each one "
                             "rebuilt over this rank's share)")
        return self.inners[0].optimizer

    # ----- checks ------------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.release.done:
            raise ValueError("this ZeroOptimizer was closed (close()); build a new one over the model to train it")

    def check_model(self) -> None:
        """As each backward pass starts and before a step: see :func:`zero.runtime.guards.ownership.check_model`."""
        check_model(self.module, self.buckets, whole=not self.gatherer.sharded)

    def before_backward(self) -> None:
        """As each backward pass starts: the model check, (fp16) that its loss was scaled, and that the
        optimizer's gradients of this step were not made yet (or are dropped, to be made again)."""
        self.check_model()
        if self.scaler.enabled and self.grads_prepared:
            raise ValueError(
                "a backward pass after clip_grad_norm_() and before step(): with fp16 loss scaling, clipping "
                "unscaled this step's gradients, and this pass would add scaled ones to them. Run every "
                "backward pass of a step before clipping."
            )
        self.scaler.begin_pass()
        self.release_master_grads()

    def before_first_forward(self, module: torch.nn.Module, args: tuple) -> None:
        """Once: a DDP wrapper built around the model after this optimizer is refused (see zero.runtime.guards.ddp)."""
        check_not_called_by_ddp(self.module)
        self.first_forward_hook.remove()

    def cast_forward_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Cast the root forward's floating-point inputs to ``param_dtype``; first check the model (a cast
        after wrapping would otherwise surface as torch's dtype mismatch, not as our error naming the fix)."""
        self.check_model()
        dtype = DTYPES[self.config.precision.param_dtype]
        return cast_inputs(dtype, args), cast_inputs(dtype, kwargs)

    def check_frozen_unchanged(self) -> None:
        frozen = self.partition.frozen + [(slot.name, slot.param) for slot in self.partition.frozen_slots]
        for name, p in frozen:
            if p.grad is not None:
                raise ValueError(
                    f"parameter {name!r} was frozen (requires_grad=False) when ZeroOptimizer was built but now "
                    "has a gradient; ZeroOptimizer does not manage it. Rebuild the optimizer after unfreezing."
                )

    # ----- gradients --------------------------------------------------------------------------------------

    def before_step(self) -> bool:
        """Common to clipping and stepping: finish an interrupted pass, check the model, release what stage 3
        still holds gathered; whether there are gradients to use (the same on every rank)."""
        self.check_open()
        self.reducer.apply_user_grad_edits()
        self.check_model()
        if self.reducer.state is GradState.EMPTY:  # then a p.grad is one no backward pass gave
            refuse_hand_written([slot for slot in self.reducer.slots if slot.grad is not None])
        return self.reducer.state is not GradState.EMPTY

    def master_grads(self) -> list[torch.Tensor]:
        """The optimizer's gradients for this step, made once per step (so that clipping them is what the
        step uses): in the master dtype, unscaled (fp16), for this rank's pieces of parameters that have
        a gradient, in model order."""
        if not self.grads_prepared:
            inv_scale = self.scaler.inv_scale
            for bucket in self.paging.walk([b for b in self.trainable_buckets if b.makes_master_grads(inv_scale)],
                                           grads_only=True):
                bucket.make_master_grads(inv_scale)
            self.placements.wait()  # offload: the gradients copied down have landed
            self.grads_prepared = True
        return [p.slot.bucket.grad_piece(p) for p in self.used_pieces_in_model_order]

    @cached_property
    def pieces_in_model_order(self) -> list[LocalPiece]:
        return sorted((p for b in self.buckets for p in b.pieces), key=lambda p: (p.slot.order, p.piece.param_start))

    @property
    def used_pieces_in_model_order(self) -> list[LocalPiece]:
        """The pieces of parameters that have a gradient, in model order (the optimizer's gradients, the norm)."""
        return [p for p in self.pieces_in_model_order if p.slot.used_anywhere]

    def release_master_grads(self) -> None:
        for bucket in self.buckets:
            bucket.release_master_grads()
        self.grads_prepared = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        if not self.before_step():
            return torch.zeros((), device=self.comm.device)
        self.reducer.require_reduced("clip_grad_norm_()")
        self.master_grads()
        norm_type = float(norm_type)
        norms = {}  # per piece, one bucket at a time (on disk, each bucket's gradients are paged in for it)
        for bucket in self.paging.walk(self.trainable_buckets, grads_only=True):
            pieces = bucket.used_pieces
            norms.update(zip(map(id, pieces), tensor_norms([bucket.grad_piece(p) for p in pieces], norm_type)))
        used = self.used_pieces_in_model_order
        if self.tensor_parallel.size == 1 and self.pipeline.size == 1:
            total = total_norm([norms[id(p)] for p in used], norm_type, self.comm.device)  # offload: on the host
            total = self._norm_over_dp(total, norm_type)
        else:  # tp-sharded pieces and replicated ones apart: the first add up over tp, the second count once
            used = [p for p in used if self.pipeline.counts(p.slot)]  # a tied weight's copies once
            kinds = [[norms[id(p)] for p in used if p.slot.local.tp_sharded == sharded] for sharded in (True, False)]
            partial = self._norm_over_dp(torch.stack([total_norm(k, norm_type, self.comm.device) for k in kinds]),
                                         norm_type, partial=True)
            partial = self.pipeline.sum_over_pp(self.tensor_parallel.sum_over_tp(partial[:1], partial[1:], norm_type),
                                                norm_type)  # then over the pipeline's other parts
            total = (partial if norm_type == math.inf else partial.pow(1.0 / norm_type)).to(torch.float32)[0]
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"zero: the total gradient norm (order {norm_type}) is {total.item()}")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for bucket in self.paging.walk(self.trainable_buckets, grads_only=True):
            scale_([bucket.grad_piece(p) for p in bucket.used_pieces], coef)
        return total

    def _norm_over_dp(self, norm: torch.Tensor, norm_type: float, partial: bool = False) -> torch.Tensor:
        """This rank's ``norm`` of its shards made the norm over every dp rank's (one small all-reduce when the
        gradients are sharded); ``partial``: left as the sum of ``norm ** p`` (fp64; the maximum for the inf-norm)."""
        reduced = self.stage.num_shards(self.comm.world_size) > 1 or self.comm.force_collectives
        what = "all-reduce of the gradient norm"
        if norm_type == math.inf:
            if reduced:
                self.comm.all_reduce(norm, op="max", what=what).wait()
            return norm.to(torch.float64) if partial else norm
        if not reduced and not partial:
            return norm
        powered = norm.to(torch.float64).pow(norm_type)
        if reduced:
            self.comm.all_reduce(powered, what=what).wait()
        return powered if partial else powered.pow(1.0 / norm_type).to(torch.float32)

    # ----- the step ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, step_kwargs: dict[str, Any]) -> None:
        has_grads = self.before_step()
        self.gatherer.reshard_all()  # a copy still gathered now would be stale after the step
        if has_grads:
            self.reducer.require_reduced("step()")
            self.check_frozen_unchanged()
            self._update(step_kwargs)
        else:  # no backward since zero_grad(): nothing to update, as torch's optimizers skip p.grad None
            self.flush()
        self.steps += 1
        self.comm.end_step()

    def _update(self, step_kwargs: dict[str, Any]) -> None:
        # the buckets that step on the device first: their kernels run while the host steps the offloaded ones
        # (partial offload, offload.ratio); every rank orders them alike
        buckets = sorted(self.trainable_buckets, key=lambda bucket: bucket.offloaded)
        shared = self.update.pending  # the update started by the previous step(), shared now: nothing to adopt
        self.flush()
        self.master_grads()
        if self.scaler.found_inf:  # an fp16 overflow skips the update; the masters take the edits and then match
            for bucket in [] if shared else self.paging.walk(buckets):
                bucket.adopt_edits()
            handles = []
        else:
            handles = self.update.update(buckets, step_kwargs, adopt=not shared)
        self.release_master_grads()
        wait_all(handles)
        self.scaler.update()

    def flush(self) -> None:
        """With ``offload.delayed_step``: wait for the update in flight and share it; else nothing."""
        if not self.update.pending:
            return
        buckets = self.trainable_buckets
        self.update.check_unedited(buckets)
        self.update.finish()
        self.share_masters(buckets)
        self.update.remember(buckets)

    def share_masters(self, buckets: list[Bucket]) -> None:
        """Cast each bucket's master into this rank's chunk of its parameters and share it (stages 1-2)."""
        for bucket in buckets:
            bucket.push_master()
        wait_all([self.stage.gather_params(bucket, self.comm) for bucket in buckets])

    def use_pipeline(self, group: Any) -> PipelineRanks:
        """This optimizer's model is a part of a pipeline over ``group`` (its pp group): the clip norm adds up over
        ``group`` from now on."""
        if isinstance(self.pipeline, NoPipelineRanks):
            self.pipeline = PipelineRanks(Communicator(group, self.config.timeout_s, device=self.comm.device))
        elif self.pipeline.group is not group:
            raise ValueError("this ZeroOptimizer's model was put in two pipelines (different pp groups); every part "
                             "on a rank is in one pipeline (its pp group, mesh['pp'])")
        return self.pipeline

    def pipeline_from_mesh(self, group: Any) -> None:
        """torch's own ``PipelineStage``, the pipeline given by the mesh's ``"pp"`` dimension: no tie across parts can
        be declared there, so the ranks compare their parameters now and refuse copies of one tensor."""
        self.use_pipeline(group)
        self.connect_pipeline([self.module])

    def join_pipeline(self, group: Any, stage_index: int, part: torch.nn.Module,
                      tied_weights: tuple[tuple[str, ...], ...]) -> PipelineRanks:
        """A pipeline stage over ``part`` of this optimizer's model joins: see :meth:`use_pipeline`; the gradient
        reduction waits for every joined part's last backward of a step."""
        pipeline = self.use_pipeline(group)
        pipeline.join(stage_index, part, tied_weights)
        return pipeline

    def connect_pipeline(self, parts: list[torch.nn.Module]) -> None:
        """Compare what the pipeline's ranks hold (collective over pp and dp): the declared tie across parts set up
        (its gradient summed as each reduction collects it), copies of a tensor undeclared refused."""
        slots = [slot for bucket in self.trainable_buckets for slot in bucket.slots]
        sharded = self.stage.num_shards(self.comm.world_size) > 1 or self.comm.force_collectives
        held, mine = report(parts, slots, self.paging.walk(self.trainable_buckets), self.comm, sharded)
        self.reducer.tie = self.pipeline.connect(held, mine)

    def zero_grad(self, set_to_none: bool) -> None:
        self.check_open()
        if set_to_none:
            self.reducer.clear()
        else:
            self.reducer.zero()
        self.release_master_grads()

    def quiesce(self) -> None:
        """Before checkpoint state is read or written, or the model given back: the delayed update shared,
        nothing gathered (stage 3), and edits made since the step in the masters."""
        self.flush()
        self.gatherer.reshard_all()
        for bucket in self.trainable_buckets:
            bucket.adopt_edits()

    def close(self) -> None:
        self.flush()
        self.gatherer.reshard_all()
        self.release.close()
        self.placements.close()  # the offload file, if any

    def steps_taken(self) -> int:
        return self.steps


def wait_all(handles: list) -> None:
    for handle in handles:
        if handle is not None:
            handle.wait()

