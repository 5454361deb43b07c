"""``ZeroOptimizer``: the user-facing wrapper over any elementwise ``torch.optim`` optimizer."""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from zero.activations import checkpoint_activations
from zero.checkpoint import shard_header
from zero.comm import Communicator
from zero.config import ZeroConfig
from zero.kernels.grad_norm import local_norm, scale_
from zero.memory import MemoryItem, ModelStateBytes, storage_bytes
from zero.offload import Placement, check_host_memory, warn_unfused_host_step
from zero.precision import (
    DTYPES,
    UnitInputCast,
    cast_inputs,
    cast_unmanaged_parameters,
    check_device_supports,
    full_precision_parameters,
)
from zero.runtime.bucket import Bucket
from zero.runtime.delayed import DelayedStep
from zero.runtime.gatherer import ParamGatherer
from zero.runtime.inner import check_optimizer, rebuild_optimizer
from zero.runtime.loss_scaler import LossScaler
from zero.runtime.materialize import InitFn, materialize, replace_meta_parameters
from zero.runtime.ownership import check_model, claim_parameters, managed_elsewhere
from zero.runtime.partition import build_partition
from zero.runtime.reducer import GradReducer, GradState
from zero.runtime.release import ModelRelease, gather_dropped_shards
from zero.runtime.stages import Stage3, make_stage
from zero.runtime.stepper import BucketStepper
from zero.runtime.units import plan_units
from zero.runtime.wrappers import check_not_called_by_ddp, check_not_ddp
from zero.weak import weak_hook


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard an optimizer's state (stage 1) and gradients (stage 2) over data-parallel ranks.

    Example::

        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, stage=2)
        loss_fn(model(x), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    The wrapped optimizer must not have stepped yet; its class, parameter groups and
    per-group hyperparameters are kept, and it is rebuilt over this rank's shard (its
    ``param_groups`` are shared with this object, so LR schedulers work as usual).
    Every stage, at every world size, computes the same update as single-process
    training on the global batch (the mean of the per-rank mean losses): gradients are
    averaged over ranks, and parameters that got no gradient on any rank are skipped,
    exactly as PyTorch skips ``p.grad is None``.

    Gradients follow PyTorch's rules whatever clears them: ``model.zero_grad()`` (both
    modes) is the same as :meth:`zero_grad`, no clearing accumulates into the next step, and
    several backward passes before :meth:`step` add up. At stage 0 ``p.grad`` is the whole
    averaged gradient; at stages 1-3 no rank holds it, so ``p.grad`` is a guard
    (:class:`zero.runtime.sharded_grad.ShardedGrad`) that refuses any use of its values: clip with
    :meth:`clip_grad_norm_`, not ``torch.nn.utils.clip_grad_norm_``. Changing the model's
    dtype or device after wrapping is refused.

    Args:
        optimizer: an instance of an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW,
            Adagrad, RMSprop, ...) over parameters of ``model``.
        model: the module being trained. Its trainable parameters become views into flat
            buffers owned by this optimizer; buffers are left alone, and so are frozen
            parameters at stages 0-2 (stage 3 shards them too, gathered with their unit).
        config: a :class:`ZeroConfig`; keyword ``overrides`` (``stage=2``, ``bucket_size_mb=...``)
            are applied on top of it.
        process_group: the data-parallel group; defaults to the default group if one is
            initialized, else runs as world size 1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        *,
        config: ZeroConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        init_fn: InitFn | None = None,
        device: torch.device | str | None = None,
        **overrides: Any,
    ):
        self.config = _resolve_config(config, overrides)
        if isinstance(optimizer, ZeroOptimizer):
            raise ValueError("this optimizer is already a ZeroOptimizer; wrap the plain torch.optim optimizer once")
        check_optimizer(optimizer)
        check_not_ddp(model)
        self.module = model
        self.comm = Communicator(
            process_group,
            self.config.timeout_s,
            device=_model_device(model, device),
            force_collectives=self.config.force_collectives,
        )
        gather_dropped_shards(model)  # parameters a dropped stage-3 optimizer left sharded (see zero.runtime.release)
        precision = self.config.precision
        check_device_supports(precision, self.comm.device)
        self.zero_stage = make_stage(self.config.stage, precision)
        self._init_device = self.comm.device  # where parameters built on ``meta`` are materialized
        meta = self._replace_meta_parameters(optimizer, init_fn)
        if self.config.sync_module_states:
            self._broadcast_module_states(skip=meta)
        num_shards = self.zero_stage.num_shards(self.comm.world_size)
        full = full_precision_parameters(model) if precision.enabled else set()
        offload = self.config.offload
        trainable = sum(p.numel() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
        param_bytes = DTYPES[precision.param_dtype].itemsize if precision.enabled else 4
        check_host_memory(offload, -(-trainable // num_shards), param_bytes)
        self._placement = Placement.of(offload, self.comm.device)
        self.partition = build_partition(
            optimizer,
            model,
            bucket_size_bytes=self.config.bucket_size_bytes,
            num_shards=num_shards,
            shard_index=self.comm.rank if num_shards > 1 else 0,
            plan=self._unit_plan(),
            device=self._init_device,
            dtypes_of=lambda p: precision.dtypes(p.dtype, full=p in full),
            placement=self._placement,
        )
        claim_parameters(self, self.buckets)
        for bucket in self.buckets:
            self.zero_stage.init_params(bucket)
            if bucket.trainable:
                self.zero_stage.init_grads(bucket)
            bucket.build_pieces()
        if meta:
            slots = {slot.param: slot for bucket in self.buckets for slot in bucket.slots}
            materialize(model, meta, slots, init_fn, self._init_device)
        managed = {slot.param for bucket in self.buckets for slot in bucket.slots}
        cast_unmanaged_parameters(model, precision, keep=managed | full)
        self._inner = rebuild_optimizer(optimizer, self.buckets)
        self._stepper = BucketStepper(self._inner, self.partition.trainable_buckets, self.config.step_kernel)
        self._delayed = DelayedStep(self._inner) if offload.delayed_step else None
        if offload.optimizer_on_host:
            warn_unfused_host_step(self._inner)
        self._pieces_in_model_order = sorted(
            (p for b in self.buckets for p in b.pieces), key=lambda p: (p.slot.order, p.piece.param_start)
        )
        super().__init__(self._inner.param_groups, self._inner.defaults)
        self.state = self._inner.state
        policy = self.config.activation_checkpointing
        self.checkpointed = checkpoint_activations(model, policy) if policy is not None else None
        self._gatherer = None
        if isinstance(self.zero_stage, Stage3):
            self._gatherer = ParamGatherer(
                self.partition.units,
                self.buckets,
                self.zero_stage,
                self.comm,
                reshard_after_forward=self.config.reshard_after_forward,
                prefetch=self.config.prefetch_units,
            )
        self._grads_prepared = False  # the optimizer's gradients of this step are made (see _master_grads)
        self._steps = 0  # step() calls so far (compared across ranks at each gradient reduction)
        scaling = precision.scaling
        self.loss_scaler = LossScaler(scaling, self.comm.device) if scaling is not None else None
        fingerprint = self._gatherer.take_fingerprint if self._gatherer is not None else None
        self._reducer = GradReducer(
            self.partition.trainable_buckets,
            self.zero_stage,
            self.comm,
            self.config.max_in_flight_buckets,
            fingerprint,
            check=weak_hook(self._before_backward),
            steps=weak_hook(self._steps_taken),
            scaler=self.loss_scaler,
        )
        hooks = self._reducer.hooks + (self._gatherer.hooks if self._gatherer is not None else [])
        if precision.enabled and precision.cast_forward_inputs:
            hooks.append(model.register_forward_pre_hook(weak_hook(self._cast_forward_inputs), with_kwargs=True))
            cast = UnitInputCast(DTYPES[precision.param_dtype])
            hooks += [module.register_forward_pre_hook(cast, with_kwargs=True) for module in self._unit_modules()]
        first_forward = torch.compiler.disable(weak_hook(self._before_first_forward))  # (it reads the call stack)
        self._first_forward_hook = model.register_forward_pre_hook(first_forward)
        hooks.append(self._first_forward_hook)
        sharded = self._gatherer is not None
        self._release = ModelRelease(hooks, self.buckets, self.zero_stage, self.comm, sharded=sharded)
        finalizer = weakref.finalize(self, self._release.dropped)
        finalizer.atexit = False  # (no collective, no hook removal at interpreter exit)
        self.comm.stats.end_step()  # construction traffic is not a step's

    # ----- properties -------------------------------------------------------------------------------------

    @property
    def buckets(self):
        return self.partition.buckets

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, rebuilt over this rank's shard."""
        return self._inner

    @property
    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Payload counters of the last completed step, per collective kind, and the seconds this rank waited for
        them (what overlap did not hide).

        ``{"reduce_scatter": {"calls": .., "numel": .., "bytes": .., "wait_s": ..}, "all_gather": {...}, ...}``;
        a step's traffic runs from the end of the previous ``step()`` to the end of this one.
        """
        return self.comm.stats.as_dict("last_step")

    # ----- training -------------------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication.

        The next backward pass outside reduces the accumulated sum, so ``k - 1`` micro-batches
        inside ``no_sync()`` and the last one outside equal one batch ``k`` times larger
        (with each micro-batch loss scaled by ``1/k``). At stage 2 the accumulated
        gradients are whole until then.
        """
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the global gradient norm, as ``torch.nn.utils.clip_grad_norm_`` on the whole model.

        Computes the norm over every rank's shard (one small all-reduce), scales the
        gradients by ``min(1, max_norm / (norm + 1e-6))`` and returns the norm (same on every rank); with
        no gradient since :meth:`zero_grad` the norm is 0, as torch's.
        """
        self._check_open()
        self._reducer.take_back()
        self._check_model()
        if self._reducer.state is GradState.EMPTY:  # the same on every rank: a backward pass is collective
            return torch.zeros((), device=self.comm.device)
        self._reducer.require_reduced("clip_grad_norm_()")
        grads = self._master_grads()
        norm_type = float(norm_type)
        total = local_norm(grads, norm_type, self.comm.device)  # offload: computed on the host, moved
        if self.zero_stage.num_shards(self.comm.world_size) > 1 or self.comm.force_collectives:
            what = "all-reduce of the gradient norm"
            if norm_type == math.inf:
                self.comm.all_reduce(total, op="max", what=what).wait()
            else:
                partial = total.to(torch.float64).pow(norm_type)
                self.comm.all_reduce(partial, what=what).wait()
                total = partial.pow(1.0 / norm_type).to(torch.float32)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"zero: the total gradient norm (order {norm_type}) is {total.item()}")
        scale_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shard with the wrapped optimizer, then share it with every rank.

        ``closure`` (re-evaluates the model and returns the loss) runs first, as in ``torch.optim``;
        other keyword arguments go to the wrapped optimizer's ``step``. With no gradient since
        :meth:`zero_grad` (no backward pass), nothing is updated, as torch's optimizers skip parameters
        without a gradient.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reducer.take_back()
        self._check_model()
        if self._gatherer is not None:  # a copy still gathered now would be stale after the step
            self._gatherer.reshard_all()
        if self._reducer.state is GradState.EMPTY:  # the same on every rank: a backward pass is collective
            self.flush()
            self._steps += 1
            self.comm.end_step()
            return loss
        self._reducer.require_reduced("step()")
        self._check_frozen_unchanged()
        buckets = self.partition.trainable_buckets
        delayed = self._delayed
        if delayed is not None and delayed.pending:  # share the update started by the previous step()
            self.flush()
        else:
            for bucket in buckets:
                bucket.adopt_edits()
        self._master_grads()
        # an fp16 overflow skips the update: the masters (edits adopted above) already match the parameters
        skip = self.loss_scaler is not None and self.loss_scaler.found_inf
        handles = []
        if not skip and delayed is not None:  # this step's update is shared by the next step() or flush()
            delayed.launch(buckets, kwargs)
            delayed.remember(buckets)
        elif not skip:
            for bucket in buckets:  # each bucket's parameters are shared while the next one steps
                self._stepper.step(bucket, kwargs)
                handles.append(self.zero_stage.gather_params(bucket, self.comm))
        self._release_master_grads()
        self._wait_all(handles)
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        self._steps += 1
        self.comm.end_step()
        return loss

    def _check_frozen_unchanged(self) -> None:
        frozen = self.partition.frozen + [(slot.name, slot.param) for slot in self.partition.frozen_slots]
        for name, p in frozen:
            if p.grad is not None:
                raise ValueError(
                    f"parameter {name!r} was frozen (requires_grad=False) when ZeroOptimizer was built but now "
                    "has a gradient; ZeroOptimizer does not manage it. Rebuild the optimizer after unfreezing."
                )

    def flush(self) -> None:
        """With ``offload.delayed_step``: wait for the update started by the last :meth:`step` and share it
        (call it after the last step, before evaluating or saving the model). Otherwise nothing to do."""
        delayed = self._delayed
        if delayed is None or not delayed.pending:
            return
        buckets = self.partition.trainable_buckets
        delayed.check_unedited(buckets)
        delayed.finish()
        self._share_masters(buckets)
        delayed.remember(buckets)

    def close(self) -> None:
        """Give the model back: remove every hook this optimizer put on it, drop gradients that no rank holds
        whole (stages 1-3: ``p.grad`` becomes ``None``) and, at stage 3, gather every parameter into a whole
        ``nn.Parameter`` of its own (a collective: call it on every rank). The model can then be trained
        plainly or wrapped by a new ``ZeroOptimizer``; this one can no longer be used."""
        self.flush()
        if self._gatherer is not None:
            self._gatherer.reshard_all()
        self._release.close()

    def _steps_taken(self) -> int:
        return self._steps

    def _check_open(self) -> None:
        if self._release.done:
            raise ValueError("this ZeroOptimizer was closed (close()); build a new one over the model to train it")

    @contextmanager
    def gathered_parameters(
        self,
        targets: torch.nn.Module | torch.nn.Parameter | Iterable[torch.nn.Module | torch.nn.Parameter] | None = None,
        modifier_rank: int | None = None,
    ) -> Iterator[None]:
        """Whole parameters outside forward, for inspection, custom initialization or edits.

        Inside the block the parameters of ``targets`` (modules, parameters, or ``None`` for
        the whole model) are whole on every rank; ``model.state_dict()`` and
        ``model.load_state_dict()`` work on them, and tensors taken from them inside (a
        ``state_dict()``) keep their values after the block, as a snapshot. On exit, edits
        are written back to each rank's shard. With ``modifier_rank=r`` rank ``r``'s values are first broadcast to
        every rank (edit on one rank only); with ``None`` every rank must make the same edits.
        Call it on every rank, with the same targets, outside forward and backward. At stages
        0-2 parameters are always whole and only ``modifier_rank`` has an effect.
        """
        self._check_open()
        self._reducer.settle()
        self.flush()
        if self._reducer.state is GradState.REDUCING or (self._gatherer is not None and self._gatherer.in_forward):
            raise ValueError("gathered_parameters() cannot be used inside forward or backward")
        buckets = self._buckets_of(targets)
        units = self._gatherer.units_of(s.param for b in buckets for s in b.slots) if self._gatherer else []
        for unit in units:
            self._gatherer.unshard(unit)
        for unit in units:
            self._gatherer.wait(unit)
        try:
            yield
        finally:
            if modifier_rank is not None and not self.comm.skips_collectives:
                what = f"broadcast of rank {modifier_rank}'s edited parameters"
                for handle in [self.comm.broadcast(b.param_buffer.data, modifier_rank, what=what) for b in buckets]:
                    handle.wait()
            if self._gatherer is not None:
                for unit in units:
                    for bucket in unit.buckets:
                        bucket.check_attached(whole=True)
                        self.zero_stage.write_back(bucket)
                        self.zero_stage.hand_over(bucket)
                    self._gatherer.reshard(unit)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients. With ``set_to_none`` (the default) parameters count as having no
        gradient until the next backward, as in PyTorch; stages 0-1 keep their gradient
        buckets allocated (zeroed), as DDP does, while stages 2-3 release their gradient shards.
        ``model.zero_grad()`` is equivalent (the optimizer sees it at the next backward or step)."""
        self._check_open()
        if set_to_none:
            self._reducer.clear()
        else:
            self._reducer.zero()
        self._release_master_grads()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_reducer"):
            raise NotImplementedError(
                "ZeroOptimizer cannot add parameter groups after construction; add the group to the "
                "optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    # ----- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (call on every rank; save one file per rank). Under
        mixed precision it holds this rank's fp32 master weights, and with fp16 the loss scale."""
        self.flush()
        state = {**self._checkpoint_header(), "optimizer": self._inner.state_dict()}
        masters = [b for b in self.partition.trainable_buckets if b.master_buffer is not None]
        if masters:
            for bucket in masters:
                bucket.adopt_edits()
            state["master"] = [bucket.master_buffer.data.clone() for bucket in masters]
        if self.loss_scaler is not None:
            state["loss_scale"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by :meth:`state_dict` on the same rank, world size, stage, precision and model
        (call on every rank: the parameters are then cast from the loaded master weights and shared)."""
        shard_header.check_loadable(state_dict, self._checkpoint_header())
        self.flush()
        masters = [b for b in self.partition.trainable_buckets if b.master_buffer is not None]
        with torch.no_grad():
            for bucket, saved in zip(masters, state_dict["master"] if masters else []):
                bucket.master_buffer.data.copy_(saved)
        self.finish_load(state_dict["optimizer"], state_dict.get("loss_scale"), masters)

    def settle_for_checkpoint(self) -> None:
        """Before a portable checkpoint (``zero.save_checkpoint``/``load_checkpoint``) reads or writes the shards:
        the delayed update shared, nothing gathered (stage 3), and edits made since the step in the masters."""
        self.flush()
        if self._gatherer is not None:
            self._gatherer.reshard_all()
        for bucket in self.partition.trainable_buckets:
            bucket.adopt_edits()

    def finish_load(self, inner_state: dict[str, Any], loss_scale: dict[str, Any] | None,
                    buckets: list[Bucket] | None = None) -> None:
        """After this rank's masters or shards were written (:meth:`load_state_dict`, ``zero.load_checkpoint``):
        load the wrapped optimizer's state (a ``torch.optim`` state dict over this rank's pieces), then cast and
        share the parameters of ``buckets`` (default: every trainable bucket)."""
        self._inner.load_state_dict(inner_state)
        self.param_groups = self._inner.param_groups  # load_state_dict made new group dicts
        self.state = self._inner.state
        self._share_masters(self.partition.trainable_buckets if buckets is None else buckets)
        if self.loss_scaler is not None and loss_scale is not None:
            self.loss_scaler.load_state_dict(loss_scale)

    # ----- mixed precision --------------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the fp16 loss scale (unchanged without loss scaling); backward on the result.
        The gradients are divided by the scale again before :meth:`clip_grad_norm_` and :meth:`step` see them."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``self.scale_loss(loss).backward(**kwargs)``: the backward call that works with every precision."""
        self.scale_loss(loss).backward(**kwargs)

    # ----- memory -------------------------------------------------------------------------------------

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state (unique storages; fp32 master
        weights count as optimizer state, as in the ZeRO paper)."""
        kinds: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer_state": []}
        for bucket in self.buckets:
            for kind, item in bucket.roles():
                kinds[kind].append(item.tensor)
        for kind, item in self._unbucketed_memory():
            kinds[kind].append(item.tensor)
        return ModelStateBytes(*(storage_bytes(kinds[k]) for k in ("parameters", "gradients", "optimizer_state")))

    def named_memory(self) -> list[MemoryItem]:
        """Every tensor this optimizer owns, named for the memory profiler (``zero.profile``): each bucket
        buffer by its role (parameters, master weights, gradient buffers and shards, buffers of collectives
        in flight), frozen parameters, the wrapped optimizer's state. Views of one storage may appear more
        than once; the first name wins."""
        gathering = self._gatherer.gathering_buckets() if self._gatherer is not None else set()
        items = [item for b in self.buckets for _, item in b.roles(gathering=b in gathering)]
        return items + [item for _, item in self._unbucketed_memory()]

    def _unbucketed_memory(self) -> Iterator[tuple[str, MemoryItem]]:
        """Frozen parameters kept whole (stages 0-2) and the wrapped optimizer's state."""
        for name, p in self.partition.frozen:
            yield "parameters", MemoryItem("parameters", "frozen", p, name.rpartition(".")[0])
        host = " (host)" if self.config.offload.optimizer_on_host else ""
        for state in self._inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield "optimizer_state", MemoryItem("optimizer_state", key + host, value)

    # ----- helpers ------------------------------------------------------------------------------------

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient pieces of parameters that have a gradient, in model order."""
        return [p.slot.bucket.grad_piece(p) for p in self._pieces_in_model_order if p.slot.used_anywhere]

    def _check_model(self) -> None:
        """As each backward pass starts and before a step: see :func:`zero.runtime.ownership.check_model`."""
        check_model(self.module, self.buckets, whole=self._gatherer is None)

    def _before_backward(self) -> None:
        """As each backward pass starts: the model check, (fp16) that its loss was scaled, and that the
        optimizer's gradients of this step were not made yet (or are dropped, to be made again)."""
        self._check_model()
        if self.loss_scaler is not None:
            if self._grads_prepared:
                raise ValueError(
                    "a backward pass after clip_grad_norm_() and before step(): with fp16 loss scaling, clipping "
                    "unscaled this step's gradients, and this pass would add scaled ones to them. Run every "
                    "backward pass of a step before clipping."
                )
            self.loss_scaler.begin_pass()
        self._release_master_grads()

    def _before_first_forward(self, module: torch.nn.Module, args: tuple) -> None:
        """Once: a DDP wrapper built around the model after this optimizer is refused (see zero.runtime.wrappers)."""
        check_not_called_by_ddp(self.module)
        self._first_forward_hook.remove()

    def _cast_forward_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Cast the root forward's floating-point inputs to ``param_dtype``; first check the model (a cast
        after wrapping would otherwise surface as torch's dtype mismatch, not as our error naming the fix)."""
        self._check_model()
        dtype = DTYPES[self.config.precision.param_dtype]
        return cast_inputs(dtype, args), cast_inputs(dtype, kwargs)

    def _master_grads(self) -> list[torch.Tensor]:
        """The optimizer's gradients for this step, made once per step (so that clipping them is what the
        step uses): in the master dtype, unscaled (fp16), for this rank's pieces of parameters that have
        a gradient, in model order."""
        if not self._grads_prepared:
            inv_scale = self.loss_scaler.inv_scale if self.loss_scaler is not None else 1.0
            for bucket in self.partition.trainable_buckets:
                bucket.make_master_grads(inv_scale)
            self._placement.wait()  # offload: the gradients copied down have landed
            self._grads_prepared = True
        return self._local_grads()

    def _share_masters(self, buckets: list[Bucket]) -> None:
        """Cast each bucket's master into this rank's chunk of its parameters and share it (stages 1-2)."""
        for bucket in buckets:
            bucket.push_master()
        self._wait_all([self.zero_stage.gather_params(bucket, self.comm) for bucket in buckets])

    @staticmethod
    def _wait_all(handles: list) -> None:
        for handle in handles:
            if handle is not None:
                handle.wait()

    def _release_master_grads(self) -> None:
        for bucket in self.buckets:
            bucket.release_master_grads()
        self._grads_prepared = False

    def _broadcast_module_states(self, skip: set) -> None:
        """Rank 0's parameters and buffers everywhere, except those built on ``meta`` (``skip`` and meta
        buffers: every rank initializes them alike, from the same seed) and parameters another live
        ZeroOptimizer manages (a part of the model trained apart)."""
        if self.comm.skips_collectives:
            return
        params = [p for p in self.module.parameters() if not managed_elsewhere(p)]  # (broadcast by their owner)
        tensors = [t for t in [*params, *self.module.buffers()] if t not in skip and not t.is_meta]
        what = "broadcast of rank 0's module states"
        for handle in [self.comm.broadcast(t.data, 0, what=what) for t in tensors]:
            handle.wait()

    def _replace_meta_parameters(self, optimizer: torch.optim.Optimizer, init_fn: InitFn | None) -> set:
        """Stage 3 with a meta model: swap meta parameters for placeholders on the target device."""
        if not any(p.is_meta for p in self.module.parameters()):
            if init_fn is not None:
                raise ValueError("init_fn is used only to initialize a model built on the meta device")
            return set()
        if not isinstance(self.zero_stage, Stage3):
            raise ValueError(
                f"the model has parameters on the meta device; only stage 3 materializes them shard by shard "
                f"(got stage {self.config.stage}). Use stage=3, or build the model on a real device."
            )
        return replace_meta_parameters(self.module, optimizer, self._init_device)

    def _unit_modules(self) -> list[torch.nn.Module]:
        """The modules below the root that form units: stage 3's, or the same plan at stages 0-2."""
        units = self.partition.units or self._plan_units(list(self.module.parameters()))
        return [unit.module for unit in units if unit.name]

    def _unit_plan(self) -> Callable[[list[torch.nn.Parameter]], list] | None:
        return self._plan_units if isinstance(self.zero_stage, Stage3) else None

    def _plan_units(self, params: list[torch.nn.Parameter]) -> list:
        size = self.config.unit_size_mb
        return plan_units(self.module, params, unit_classes=self.config.unit_classes,
                          unit_size_bytes=None if size is None else int(size * 2**20))

    def _buckets_of(self, targets) -> list[Bucket]:
        """The buckets holding the parameters of ``targets`` (see ``gathered_parameters``)."""
        if targets is None:
            return list(self.buckets)
        items = [targets] if isinstance(targets, torch.nn.Module | torch.Tensor) else list(targets)
        wanted: set[int] = set()
        for item in items:
            params = item.parameters() if isinstance(item, torch.nn.Module) else [item]
            wanted.update(id(p) for p in params)
        known = {id(p) for p in self.module.parameters()}
        if not wanted <= known:
            raise ValueError("gathered_parameters() got parameters that are not in the model this ZeroOptimizer wraps")
        return [b for b in self.buckets if any(id(s.param) in wanted for s in b.slots)]

    def _checkpoint_header(self) -> dict[str, Any]:
        return shard_header.header(
            stage=self.config.stage,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            partition=self.partition,
            optimizer=self._inner,
            precision=self.config.precision.model_dump(include={"param_dtype", "reduce_dtype"}),
        )


def _model_device(model: torch.nn.Module, device: torch.device | str | None) -> torch.device | None:
    """The device the model's parameters live on (the communicator's): ``device`` if given, else that of
    the first parameter not on ``meta``; ``None`` lets the communicator choose (the backend's device)."""
    if device is not None:
        return torch.device(device)
    return next((p.device for p in model.parameters() if not p.is_meta), None)


def _resolve_config(config: ZeroConfig | None, overrides: dict[str, Any]) -> ZeroConfig:
    if config is None:
        return ZeroConfig(**overrides)
    if not isinstance(config, ZeroConfig):
        raise ValueError(f"config must be a zero.ZeroConfig, got {type(config).__name__}")
    return ZeroConfig(**{**config.model_dump(), **overrides})  # re-validated


def init_sharded(
    build_fn: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    init_fn: InitFn | None = None,
    config: ZeroConfig | None = None,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    **overrides: Any,
) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """Build a model without ever holding it whole: on ``meta``, then stage-3 shards only.

    ``build_fn()`` runs under ``torch.device("meta")``; ``make_optimizer(model)`` builds the
    optimizer over its parameters; each rank then initializes its shards one module at a time
    with the model's own ``reset_parameters()`` and ``init_fn`` (see :mod:`zero.runtime.materialize`
    for when that equals building the model normally with the same seed; every rank must use
    the same seed). Returns ``(model, optimizer)``::

        model, opt = zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters()),
                                       init_fn=init_gpt_weights)
    """
    with torch.device("meta"):
        model = build_fn()
    overrides = {**overrides, "stage": 3}
    optimizer = ZeroOptimizer(
        make_optimizer(model), model, config=config, process_group=process_group, init_fn=init_fn,
        device=device, **overrides,
    )
    return model, optimizer
