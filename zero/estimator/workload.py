"""What the estimator needs of a model, traced on fake tensors on demand: its step's timeline, the
buckets and units ``ZeroOptimizer`` would build for it, and its optimizer's step.

Nothing is allocated: the model is built once per precision (and once more with activation
checkpointing) under one ``FakeTensorMode``, and reused for every micro-batch.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable, Union

import torch
from torch import nn

from zero.activations import ActivationCheckpointing, checkpoint_activations
from zero.estimator.failure import describe_failure
from zero.estimator.offloading import OffloadChoice, file_bytes, host_bytes
from zero.estimator.schedule import BucketBytes, Layout, StepTrace
from zero.estimator.timeline import Recorder, Timeline, record_step
from zero.estimator.traffic import Wire
from zero.precision import DTYPES, MixedPrecision, full_precision_parameters, input_casts
from zero.runtime.buffers.bucket import adopt_edits_
from zero.runtime.buffers.partition import build_partition
from zero.runtime.buffers.placement import Where
from zero.runtime.buffers.plan import BucketPlan, Role
from zero.runtime.buffers.units import plan_units
from zero.runtime.offload.disk import planned_disk_bytes
from zero.runtime.offload.paging import per_element_state
from zero.runtime.stages import make_stage

# the precisions the planner prices, as ZeroOptimizer's policies
POLICIES = {
    "fp32": MixedPrecision(),
    "mixed": MixedPrecision(param_dtype="bf16", reduce_dtype="bf16"),  # the ZeRO paper's (K = 12)
    "mixed-fp32-reduce": MixedPrecision(param_dtype="bf16"),  # the default policy: gradients reduced in fp32
}


# what a Workload can be checkpointed with: no, every block (True), or a policy (as ZeroConfig takes it)
Checkpointing = Union[bool, dict, ActivationCheckpointing, None]


def policy_key(checkpointing: Checkpointing) -> str:
    """``""`` without checkpointing, else the policy as JSON (validated; the caches' key)."""
    if checkpointing is None or checkpointing is False:
        return ""
    if checkpointing is True:
        checkpointing = {}
    if isinstance(checkpointing, dict):
        checkpointing = ActivationCheckpointing(**checkpointing)
    if not isinstance(checkpointing, ActivationCheckpointing):
        raise ValueError(f"checkpointing must be a bool, a dict or an ActivationCheckpointing, got {checkpointing!r}")
    return checkpointing.model_dump_json()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Workload:
    """A model, its loss and its batches, for the estimator.

    ``build()`` returns the model (built in fp32 on the device it will train on; it runs under fake
    tensors, so nothing is allocated); ``loss(model, *batch)`` returns the scalar loss exactly as the
    training loop computes it (e.g. ``model(input_ids=x, labels=x).loss``); ``batch(micro_batch)``
    returns the forward's inputs for one rank's micro-batch (real or fake tensors: only shapes matter);
    ``optimizer(params)`` builds the wrapped optimizer (default AdamW).
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        loss: Callable[..., torch.Tensor],
        batch: Callable[[int], tuple],
        optimizer: Callable[[Any], torch.optim.Optimizer] = _adamw,
    ) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.build, self.loss, self.batch, self.optimizer = build, loss, batch, optimizer
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._models: dict[tuple[str, str], nn.Module] = {}
        self._timelines: dict[tuple[int, str, str], Timeline] = {}
        self._steps: dict[tuple[Any, ...], StepTrace] = {}
        self._disk_state_keys: dict[str, torch.dtype] | None = None

    # ----- the model, on fake tensors -------------------------------------------------------------------

    def model(self, precision: str = "fp32", checkpointing: Checkpointing = False) -> nn.Module:
        """The fake model, cast as ``ZeroOptimizer`` casts it under ``precision`` and checkpointed by the policy
        ``checkpointing`` (``True``: every block of its ``nn.ModuleList``,
        ``ZeroConfig(activation_checkpointing={})``)."""
        key = (precision, policy_key(checkpointing))
        if key not in self._models:
            with _explained("building the model"):
                model = self._build_fake()
            with self.mode, _explained("building the model"):
                if not isinstance(model, nn.Module):
                    raise ValueError(f"the model function must return a torch.nn.Module, got {type(model).__name__}")
                policy = POLICIES[precision]
                if policy.enabled:  # as ZeroOptimizer casts the managed parameters, and the inputs of its units
                    full = full_precision_parameters(model)  # and of the modules computing in param_dtype
                    for p in model.parameters():
                        if p not in full and p.is_floating_point():
                            p.data = p.data.to(DTYPES[policy.param_dtype])
                    units = plan_units(model, list(model.parameters()), unit_classes=None, unit_size_bytes=None)
                    input_casts(model, DTYPES[policy.param_dtype], cast=True, units=[u.name for u in units if u.name])
                if key[1]:
                    checkpoint_activations(model, ActivationCheckpointing.model_validate_json(key[1]))
            self._models[key] = model
        return self._models[key]

    def _build_fake(self) -> Any:
        """``build()`` on fake tensors. torch cannot move a module built inside ``FakeTensorMode`` (``Module.to()``
        fails to swap its parameters; PEFT calls it when it adds adapters): such a model is built on ``meta`` and
        then given fake tensors, one per parameter (ties kept) and buffer."""
        try:
            with self.mode:
                return self.build()
        except RuntimeError as err:
            if "Couldn't swap" not in str(err):
                raise
        with torch.device("meta"):
            model = self.build()
        if isinstance(model, nn.Module):
            _to_fake(model, self.mode)
        return model

    def timeline(self, micro_batch: int, precision: str = "fp32", checkpointing: Checkpointing = False) -> Timeline:
        """Forward, loss and backward of one micro-batch, live bytes after every operator. Beyond 3, the bytes at
        each point are extrapolated from the traces of micro-batches 2 and 3 (every storage's size is a constant
        or proportional to the micro-batch), unless those two traces differ in their steps. (Not from 1: models
        often take another path for a batch of one.)"""
        key = (micro_batch, precision, policy_key(checkpointing))
        if key not in self._timelines and micro_batch > 3:
            two, three = (self.timeline(m, precision, checkpointing) for m in (2, 3))
            if two.aligned(three):
                self._timelines[key] = two.extrapolate(three, micro_batch)
        if key not in self._timelines:
            self._timelines[key] = self._trace(micro_batch, precision, checkpointing)
        return self._timelines[key]

    def _trace(self, micro_batch: int, precision: str, checkpointing: Checkpointing) -> Timeline:
        model = self.model(precision, checkpointing)
        policy = POLICIES[precision]
        with self.mode:
            with _explained("making the batch"):
                batch = tuple(self._fake(t, policy) for t in self.batch(micro_batch))
            with _explained("tracing the step"):
                try:
                    return replace(record_step(model, self.loss, batch), micro_batch=micro_batch)
                finally:
                    for p in model.parameters():
                        p.grad = None

    def _fake(self, t: Any, policy: MixedPrecision) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            t = self.mode.from_tensor(t)
        if policy.enabled and t.is_floating_point():  # ZeroOptimizer casts the root forward's float inputs
            t = t.to(DTYPES[policy.param_dtype])
        return t

    # ----- what ZeroOptimizer builds -----------------------------------------------------------------------

    def layout(self, stage: int, world_size: int, precision: str = "fp32", bucket_size_mb: float = 25,
               offload: OffloadChoice = OffloadChoice(), secondary_shards: int = 1) -> Layout:
        """Rank 0's buckets (and stage 3's units) for this configuration, by the optimizer's own planning (with
        ``offload``'s placements: which buffers are off the device, and where). ``world_size`` is the ranks the
        model states are sharded over: with HSDP, the shard group's size (with hpZ every rank's, and
        ``secondary_shards`` the ranks of its groups: each bucket then has a secondary copy of ``1/secondary_shards``
        of it)."""
        model = self.model(precision)
        policy = POLICIES[precision]
        stage_policy = make_stage(stage, policy).policy(world_size, secondary_shards=secondary_shards)
        state = self._disk_state() if offload.on_disk else {}
        with self.mode:
            full = full_precision_parameters(model)
            partition = build_partition(
                torch.optim.SGD([p for p in model.parameters() if p.requires_grad] or model.parameters(), lr=0.1),
                model,
                bucket_size_bytes=max(1, int(bucket_size_mb * 2**20)),
                policy=stage_policy,
                shard_index=0,
                plan=partial(plan_units, model, unit_classes=None, unit_size_bytes=None) if stage == 3 else None,
                dtypes_of=lambda p: policy.dtypes(p.dtype, full=p in full),
                placements=offload.placements() if offload.offloaded else None,
            )
        bucketed = {id(slot.param) for b in partition.buckets for slot in b.slots}
        stage_plan = partition.plan
        priced = tuple(_priced(b.plan, tuple(s.name for s in b.slots), b.unit, file_bytes(stage_plan, b.plan, state))
                       for b in partition.buckets)
        return Layout(
            stage=stage,
            buckets=priced,
            frozen=sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in bucketed),
            buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
            staged=partition.plan.policy.staged,
            grad_buffer=sum(plan.nbytes(Role.GRADS) for plan in partition.plan.buckets),
            units=tuple(u.name for u in partition.units),
            disk=planned_disk_bytes(stage_plan, state) if offload.on_disk else 0,
            disk_state=sum(dtype.itemsize for dtype in state.values()),
            slots=len(partition.slots),
        )

    def _disk_state(self) -> dict[str, torch.dtype]:
        """The optimizer's per-element state that offload to disk keeps in the file, by the runtime's own probe."""
        if self._disk_state_keys is None:  # (on a real two-element parameter, outside the fake mode)
            self._disk_state_keys = per_element_state(self.optimizer([torch.zeros(2, requires_grad=True)]))
        return self._disk_state_keys

    def step(self, layout: Layout, precision: str = "fp32") -> StepTrace:
        """What ``ZeroOptimizer.step()`` holds besides the buffers, traced on fake tensors: the wrapped optimizer's
        state per element and the largest temporaries of a step, one bucket at a time: under mixed precision the
        masters first adopt edits of the parameters (``zero.runtime.buffers.bucket.adopt_edits_``), then the wrapped
        optimizer steps the pieces of the bucket's chunk (two steps: the second is the steady state). Traced on rank 0's
        largest chunk and on the chunk holding the largest piece (a foreach step's temporaries grow with the
        chunk, a per-tensor step's with the largest piece)."""
        policy = POLICIES[precision]
        master = torch.promote_types(DTYPES[policy.param_dtype or "fp32"], torch.float32)
        low = DTYPES[policy.param_dtype] if policy.enabled else None
        chunks = [b.pieces for b in layout.buckets if b.pieces]
        candidates = {max(chunks, key=sum, default=()), max(chunks, key=max, default=())}
        traced = [self._step(master, low, pieces) for pieces in candidates if pieces]
        if not traced:
            return StepTrace(0.0, 0.0, 0.0)
        return StepTrace(*(max(getattr(t, f) for t in traced)
                           for f in ("state_per_element", "adopt", "update", "state_per_piece")))

    def _step(self, dtype: torch.dtype, low: torch.dtype | None, pieces: tuple[int, ...]) -> StepTrace:
        key = (dtype, low, pieces)
        if key not in self._steps:
            with self.mode, _explained("tracing the optimizer's step"):
                holder = nn.Module()
                holder.pieces = nn.ParameterList(nn.Parameter(torch.zeros(n, dtype=dtype)) for n in pieces)
                opt = self.optimizer(list(holder.pieces))
                for p in holder.pieces:
                    p.grad = torch.zeros_like(p)
                opt.step()  # creates the state
                shard = torch.zeros(sum(pieces), dtype=low) if low is not None else None
                master = torch.zeros(sum(pieces), dtype=dtype)
                existing = ([p.grad for p in holder.pieces], list(opt.state.values()), shard, master)
                adopting = Recorder(holder, existing=existing)
                if shard is not None:
                    with torch.no_grad(), adopting:
                        adopt_edits_(master, shard)
                updating = Recorder(holder, existing=existing)
                with torch.no_grad(), updating:
                    opt.step()
                tensors = [(p, t) for p in holder.pieces for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
                per_element = sum(t.untyped_storage().nbytes() for p, t in tensors if t.shape == p.shape)
                per_piece = sum(t.untyped_storage().nbytes() for p, t in tensors if t.shape != p.shape)
            self._steps[key] = StepTrace(per_element / sum(pieces), _largest(adopting), _largest(updating),
                                         per_piece / len(pieces))
        return self._steps[key]


def _priced(plan: BucketPlan, names: tuple[str, ...], unit: Any, disk: int) -> BucketBytes:
    """The bytes of one bucket's planned buffers, as the schedule replays them (``zero.runtime.buffers.plan``)."""
    lay, d = plan.layout, plan.dtypes
    return BucketBytes(
        params=names if plan.trainable else (),
        whole=plan.nbytes(Role.PARAMS),
        shard=plan.nbytes(Role.SHARD) or lay.chunk_numel * d.compute.itemsize,
        staging=lay.padded_numel * d.reduce.itemsize,
        grad_shard=lay.chunk_numel * d.reduce.itemsize,
        master=plan.nbytes(Role.MASTER),
        master_grad=plan.nbytes(Role.MASTER_GRAD),
        elements=lay.chunk_numel if plan.trainable else 0,
        pieces=tuple(piece.numel for piece in lay.pieces(0)) if plan.trainable else (),
        unit=unit.name if unit is not None else None,
        secondary=plan.nbytes(Role.SECONDARY),
        host=host_bytes(plan),
        disk=disk,
        offloaded=_not_on_device(plan.spec(Role.MASTER)),
        shard_off_device=_not_on_device(plan.spec(Role.SHARD)),
        wire=Wire(lay.padded_numel, lay.chunk_numel, plan.spec(Role.PARAMS).dtype, plan.spec(Role.STAGING).dtype
                  if plan.trainable else d.reduce, plan.trainable, unit.name if unit is not None else None),
    )


def _not_on_device(spec: Any) -> bool:
    """Whether a planned buffer (or none) lives off the device (host memory or disk)."""
    return spec is not None and spec.where is not Where.DEVICE


def _to_fake(model: nn.Module, mode: Any) -> None:
    """Replace every meta parameter and buffer of ``model`` by a fake CPU tensor of its shape (a parameter held
    by several modules stays one object)."""
    made: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in made:
                        fake = torch.empty_like(t, device="cpu")
                        made[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    table[name] = made[id(t)]


def _largest(recorder: Recorder) -> int:
    return max((p.temporaries for p in recorder.points), default=0)


class _explained:
    """Turns a failure while tracing into a ``ValueError`` that says what was being done, where it failed and what
    to check (:func:`zero.estimator.failure.describe_failure`)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, ValueError):
            return False
        raise ValueError(describe_failure(self.what, exc)) from exc
