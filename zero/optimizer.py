"""``ZeroOptimizer``, the user-facing wrapper over ``torch.optim`` optimizers: a thin facade (``zero.runtime.build``
assembles the runtime; the methods here say what each operation means for the user and hand it to the runtime)."""

from __future__ import annotations

from collections import ChainMap
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zero.auto_ratio import StepExample, resolve_config
from zero.checkpoint.shard import state as shard_state
from zero.comm.groups import data_parallel_group, pipeline_group
from zero.config import ZeroConfig
from zero.memory import MemoryItem, ModelStateBytes
from zero.runtime import owned_memory, whole_parameters
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.build import build_runtime, watch_for_drop
from zero.runtime.materialize import InitFn


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard an optimizer's state (stage 1), gradients (stage 2) and parameters (stage 3) over data-parallel ranks.

    Example::

        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, stage=2)
        loss_fn(model(x), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    The wrapped optimizer must not have stepped yet; its class, parameter groups and per-group hyperparameters are
    kept, and it is rebuilt over this rank's shard (its ``param_groups`` are shared with this object, so LR
    schedulers work as usual). Elementwise optimizers (torch's SGD, Adam, AdamW, ...) step flat shards; every other
    one (Muon, Adafactor, LAMB, SOAP, ...) steps whole parameters, each on one rank, once per step. Several over one
    model, ``ZeroOptimizer([muon, adamw], model)``, share one step, clip and checkpoint; their groups are
    ``param_groups`` in that order. Every stage, at every world size, computes the same update as single-process
    training on the global batch (the mean of the per-rank mean losses); parameters that got no gradient on any rank
    are skipped, as PyTorch skips ``p.grad is None``.

    Gradients follow PyTorch's rules whatever clears them: ``model.zero_grad()`` (both modes) is the same as
    :meth:`zero_grad`, no clearing accumulates into the next step, and several backward passes before :meth:`step`
    add up. At stage 0 ``p.grad`` is the whole averaged gradient; at stages 1-3 no rank holds it, so ``p.grad`` is a
    guard (:class:`zero.runtime.buffers.sharded_grad.ShardedGrad`) that refuses any use of its values: clip with
    :meth:`clip_grad_norm_`, not ``torch.nn.utils.clip_grad_norm_``. Changing the model's dtype or device after
    wrapping is refused.

    Args:
        optimizer: a ``torch.optim`` optimizer over parameters of ``model``, or a list of them
            (each parameter in exactly one); see ``docs/optimizers.md``.
        model: the module being trained. Its trainable parameters become views into flat
            buffers owned by this optimizer; buffers are left alone, and so are frozen
            parameters at stages 0-2 (stage 3 shards them too, gathered with their unit).
        config: a :class:`ZeroConfig`; keyword ``overrides`` (``stage=2``, ``bucket_size_mb=...``)
            are applied on top of it.
        process_group, mesh: the data-parallel group, or a mesh's dp dimension (``mesh["dp"]``), or a mesh with a
            ``"dp"`` dimension and a ``"pp"`` one (pipeline parallelism: the clip norm adds up over the pipeline's
            ranks; tensor and pipeline parallelism: docs/parallelism.md); default: the default group if one is
            initialized, else a world of one.
        init_fn, device: for a model built on ``meta`` (stage 3; see :func:`init_sharded`).
        example: with ``offload.ratio="auto"``, a :class:`zero.StepExample` (the loss and a micro-batch) with which
            the estimator picks the ratio (:mod:`zero.auto_ratio`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        model: torch.nn.Module,
        *,
        config: ZeroConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        init_fn: InitFn | None = None,
        device: torch.device | str | None = None,
        example: StepExample | None = None,
        **overrides: Any,
    ):
        if isinstance(optimizer, ZeroOptimizer):
            raise ValueError("this optimizer is already a ZeroOptimizer; wrap the plain torch.optim optimizer once")
        process_group = data_parallel_group(process_group, mesh)
        self.config = resolve_config(config, overrides, optimizer, model, example, process_group, device)
        runtime = build_runtime(optimizer, model, self.config, process_group=process_group, init_fn=init_fn,
                                device=device)
        inners = [inner.optimizer for inner in runtime.inners]
        super().__init__([g for o in inners for g in o.param_groups], inners[0].defaults if len(inners) == 1 else {})
        self.runtime, self.state = runtime, _state_of(inners)  # (param_groups: the same dicts as the inners')
        self.module, self.comm, self.partition = model, runtime.comm, runtime.partition
        self.zero_stage, self.stage_policy = runtime.stage.number, runtime.stage  # the ZeRO stage (0-3); its policy
        self.checkpointed = runtime.checkpointed
        watch_for_drop(self, runtime)
        if pipeline_group(mesh) is not None:
            runtime.pipeline_from_mesh(pipeline_group(mesh))

    @property
    def buckets(self) -> list[Bucket]:  # (this rank's)
        return self.partition.buckets

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, rebuilt over this rank's shard (with several: :attr:`optimizers`)."""
        return self.runtime.inner

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Each wrapped optimizer, rebuilt over this rank's share: its pieces (flat) or its owned parameters."""
        return [inner.optimizer for inner in self.runtime.inners]

    @property
    def loss_scaler(self) -> Any:
        """The fp16 loss scaler (``scale``, ``state_dict()``), or ``None`` without loss scaling."""
        return self.runtime.scaler if self.runtime.scaler.enabled else None

    @property
    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Payload counters of the last completed step, per collective kind, and the seconds this rank waited for
        them (what overlap did not hide): ``{"reduce_scatter": {"calls", "numel", "bytes", "wait_s"}, ...}``;
        a step's traffic runs from the end of the previous ``step()`` to the end of this one."""
        return self.comm.step_stats()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication; the next backward pass
        outside reduces the sum, so ``k - 1`` micro-batches inside and the last one outside equal one batch ``k``
        times larger (each micro-batch loss scaled by ``1/k``)."""
        reducer = self.runtime.reducer
        previous, reducer.sync_enabled = reducer.sync_enabled, False
        try:
            yield
        finally:
            reducer.sync_enabled = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch: ``False`` makes the backward passes that follow accumulate locally, as inside
        :meth:`no_sync`, until it is set ``True`` again (the next backward pass then reduces the sum) or
        :meth:`reduce_gradients` reduces them."""
        self.runtime.reducer.sync_enabled = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """FSDP2's switch (stage 3): ``False`` keeps each unit that backward reaches gathered until :meth:`step`, so a
        pipeline step's later micro-batches gather it no more (the part's gathered parameters held meanwhile)."""
        self.runtime.gatherer.set_reshard_after_backward(reshard_after_backward)

    def reduce_gradients(self, divide_factor: int = 1) -> None:
        """Reduce now, with no backward pass, the gradients accumulated with synchronization off, averaged over the
        dp ranks and divided by ``divide_factor`` too: a pipeline schedule's one reduction per step after its last
        micro-batch (``divide_factor``: its micro-batches, each loss a mean; ``zero.pipelining`` calls this)."""
        self.runtime.check_open()
        self.runtime.reducer.reduce_accumulated(divide_factor)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the global gradient norm, as ``torch.nn.utils.clip_grad_norm_`` on the whole model: the norm over
        every rank's shard (one small all-reduce), gradients scaled by ``min(1, max_norm / (norm + 1e-6))``;
        returns the norm (the same on every rank), 0 with no gradient since :meth:`zero_grad`."""
        return self.runtime.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shard with the wrapped optimizer, then share it with every rank. ``closure`` runs
        first, as in ``torch.optim``; other keyword arguments go to the wrapped optimizer's ``step``. With no
        gradient since :meth:`zero_grad`, nothing is updated (torch's optimizers skip ``p.grad is None``)."""
        self.runtime.check_open()
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.runtime.step(kwargs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (``model.zero_grad()`` is equivalent). With ``set_to_none`` parameters have no gradient
        until the next backward; stages 0-1 keep their gradient buckets (zeroed), stages 2-3 release theirs."""
        self.runtime.zero_grad(set_to_none)

    def flush(self) -> None:
        """With ``offload.delayed_step``: wait for the update started by the last :meth:`step` and share it
        (call it after the last step, before evaluating or saving the model). Otherwise nothing to do."""
        self.runtime.flush()

    def close(self) -> None:
        """Give the model back (a collective: call it on every rank): every hook removed, gradients no rank holds
        whole dropped and, at stage 3, every parameter gathered into a whole ``nn.Parameter`` of its own. The
        model can then be trained plainly or wrapped again; this optimizer can no longer be used."""
        self.runtime.close()

    @contextmanager
    def gathered_parameters(self, targets: whole_parameters.Targets = None,
                            modifier_rank: int | None = None) -> Iterator[None]:
        """Whole parameters of ``targets`` (modules, parameters, ``None``: the whole model) on every rank inside
        the block, for inspection, custom initialization or edits (``model.state_dict()`` taken inside keeps its
        values). On exit edits are written back to each rank's shard; with ``modifier_rank=r`` rank ``r``'s values
        are first broadcast (edit on one rank only), with ``None`` every rank must make the same edits. At stages
        0-2 the parameters are always whole and only ``modifier_rank`` has an effect."""
        with whole_parameters.gathered_parameters(self.runtime, targets, modifier_rank):
            yield

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "runtime" in self.__dict__:  # (called by torch.optim.Optimizer.__init__ first)
            raise NotImplementedError("add parameter groups to the optimizer before wrapping it, not to ZeroOptimizer")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (call on every rank; save one file per rank). Under
        mixed precision it holds this rank's fp32 master weights, and with fp16 the loss scale."""
        return shard_state.shard_state_dict(self.runtime)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by :meth:`state_dict` on the same rank, world size, stage, precision and model
        (call on every rank: the parameters are then cast from the loaded master weights and shared)."""
        states, masters = shard_state.load_shard_state_dict(self.runtime, state_dict)
        self.finish_load(states, state_dict.get("loss_scale"), masters)

    def prepare_for_checkpoint(self) -> None:
        """Before a portable checkpoint (``zero.save_checkpoint``/``load_checkpoint``) reads or writes the shards:
        the delayed update shared, nothing gathered (stage 3), and edits made since the step in the masters."""
        self.runtime.quiesce()

    def finish_load(self, inner_state: dict[str, Any] | list[dict[str, Any]], loss_scale: dict[str, Any] | None,
                    buckets: list[Bucket] | None = None) -> None:
        """After this rank's masters or shards were written: load the wrapped optimizers' state (a ``torch.optim``
        state dict over this rank's share, or one per optimizer), then cast and share ``buckets`` (default: all)."""
        shard_state.finish_load(self.runtime, inner_state, loss_scale, buckets)
        self.param_groups, self.state = [g for o in self.optimizers for g in o.param_groups], _state_of(self.optimizers)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the fp16 loss scale (unchanged without loss scaling); backward on the result.
        The gradients are divided by the scale again before :meth:`clip_grad_norm_` and :meth:`step` see them."""
        return self.runtime.scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``self.scale_loss(loss).backward(**kwargs)``: the backward call that works with every precision."""
        self.scale_loss(loss).backward(**kwargs)

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state (unique storages; fp32 master weights
        count as optimizer state, as in the ZeRO paper)."""
        return owned_memory.model_state_bytes(self.runtime)

    def named_memory(self) -> list[MemoryItem]:
        """Every tensor this optimizer owns, named for the memory profiler (``zero.profile``)."""
        return owned_memory.named_memory(self.runtime)


def _state_of(optimizers: list[torch.optim.Optimizer]) -> Any:  # (one state: the optimizer's own dict)
    return ChainMap(*(o.state for o in optimizers)) if len(optimizers) > 1 else optimizers[0].state
