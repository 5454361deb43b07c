"""What the estimator needs of a model, traced on fake tensors on demand: its step's timeline, the
buckets and units ``ZeroOptimizer`` would build for it, and its optimizers' step (:mod:`zero.estimator.optimizers`).

Nothing is allocated: the model is built once per precision (and once more with activation
checkpointing) under one ``FakeTensorMode``, and reused for every micro-batch.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zero.activations import ActivationCheckpointing
from zero.estimator.configuration import POLICIES, Units
from zero.estimator.failure import explained
from zero.estimator.offloading import OffloadChoice, file_bytes, host_bytes
from zero.estimator.optimizer_step import OptimizerSteps, master_dtype
from zero.estimator.optimizers import Assignment, Ownership, assign, ownership
from zero.estimator.schedule import BucketBytes, Layout, StepTrace
from zero.estimator.timeline import Timeline, record_step
from zero.estimator.traffic import Wire
from zero.precision import DTYPES, MixedPrecision
from zero.runtime.activations.checkpointing import checkpoint_activations
from zero.runtime.buffers.local_tensor import local_of
from zero.runtime.buffers.partition import build_partition
from zero.runtime.buffers.placement import Where
from zero.runtime.buffers.plan import Role
from zero.runtime.offload.disk import planned_disk_bytes
from zero.runtime.offload.paging import per_element_state
from zero.runtime.precision.casts import input_casts
from zero.runtime.precision.parameters import cast_unmanaged_parameters, full_precision_parameters
from zero.runtime.stages import make_stage
from zero.runtime.step.inner import same_kind

# a precision as the estimator takes it: a shorthand name (POLICIES) or ZeroConfig's policy
PrecisionArg = Union[str, MixedPrecision]


def precision_policy(precision: PrecisionArg) -> MixedPrecision:
    """The ``MixedPrecision`` of a shorthand name (``"mixed"`` ...) or the policy itself."""
    if isinstance(precision, MixedPrecision):
        return precision
    if precision not in POLICIES:
        raise ValueError(f"precision must be one of {sorted(POLICIES)} or a zero.MixedPrecision, got {precision!r}")
    return POLICIES[precision]


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
    returns the forward's inputs for one rank's micro-batch (real or fake tensors: only shapes matter).
    A pipeline part before the last has no loss (``None``; :mod:`zero.estimator.pipeline`).

    The optimizers, one way or the other: ``optimizer(params)`` builds the one wrapped optimizer over the parameters
    it is given (default AdamW); ``optimizers(model)`` returns what the training script passes to ``ZeroOptimizer``,
    built over ``model``'s parameters: one optimizer or a list, each trainable parameter in exactly one (e.g.
    ``lambda m: [torch.optim.Muon(hidden(m), lr=0.02), torch.optim.AdamW(rest(m), lr=1e-3)]``). Each is priced on
    the path ``ZeroOptimizer`` steps it on (:mod:`zero.estimator.optimizers`); ``elementwise_optimizers`` and
    ``per_parameter_optimizers`` are ``ZeroConfig``'s (third-party classes declared elementwise, stepped on the flat
    path; whole-parameter classes declared to read each parameter alone, owned parameter by parameter).

    Tensor parallelism: ``parallelize(model, tp_mesh)`` splits the model ``build()`` returns as the training script
    does (e.g. ``parallelize_module(model, tp_mesh, plan)``) and returns it; ``estimate(..., tensor_parallel=tp)``
    then prices one rank of ``dp x tp`` (:mod:`zero.estimator.tensor_parallel`), ``batch(micro_batch)`` being what one
    rank's forward takes (the tp ranks of one dp position take the same batch).
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        loss: Callable[..., torch.Tensor],
        batch: Callable[[int], tuple],
        optimizer: Callable[[Any], torch.optim.Optimizer] = _adamw,
        *,
        optimizers: Callable[[nn.Module], Any] | None = None,
        elementwise_optimizers: Sequence[str] = (),
        per_parameter_optimizers: Sequence[str] = (),
        parallelize: Callable[[nn.Module, Any], nn.Module] | None = None,
    ) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        if optimizers is not None and optimizer is not _adamw:
            raise ValueError("give the Workload optimizer= (a function of the parameters, one optimizer) or "
                             "optimizers= (a function of the model, one optimizer or a list), not both")
        self.build, self.loss, self.batch, self.optimizer = build, loss, batch, optimizer
        self.optimizers, self.elementwise_optimizers = optimizers, tuple(elementwise_optimizers)
        self.per_parameter_optimizers = tuple(per_parameter_optimizers)
        self.parallelize = parallelize
        self.mesh: Any = None  # the (dp, tp) DeviceMesh, in the fake world of a tensor-parallel estimate's process
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._models: dict[tuple[str, str], nn.Module] = {}
        self._timelines: dict[tuple[int, str, str], Timeline] = {}
        self._assignment: Assignment | None = None
        self.steps = OptimizerSteps(self.mode, self.assignment)  # the optimizers' fake steps
        self._disk_state_keys: dict[str, torch.dtype] | None = None
        self._declared: dict[tuple[tuple[str, ...], tuple[str, ...]], Workload] = {}

    def declaring(self, elementwise: Sequence[str], per_parameter: Sequence[str]) -> "Workload":
        """This workload with ``ZeroConfig``'s ``elementwise_optimizers`` and ``per_parameter_optimizers`` declared
        besides its own: itself when they add nothing, else a copy sharing its traced models and timelines (they do
        not depend on the optimizers) with its own assignment and optimizer steps."""
        key = (tuple(dict.fromkeys((*self.elementwise_optimizers, *elementwise))),
               tuple(dict.fromkeys((*self.per_parameter_optimizers, *per_parameter))))
        if key == (self.elementwise_optimizers, self.per_parameter_optimizers):
            return self
        if key not in self._declared:
            other = copy.copy(self)
            other.elementwise_optimizers, other.per_parameter_optimizers = key
            other._assignment, other._disk_state_keys, other._declared = None, None, {}
            other.steps = OptimizerSteps(other.mode, other.assignment)
            self._declared[key] = other
        return self._declared[key]

    # ----- the model, on fake tensors -------------------------------------------------------------------

    def model(self, precision: PrecisionArg = "fp32", checkpointing: Checkpointing = False,
              units: Units = Units()) -> nn.Module:
        """The fake model, cast as ``ZeroOptimizer`` casts it under ``precision`` (with stage 3's ``units``: the
        modules whose inputs it casts) and checkpointed by the policy ``checkpointing`` (``True``: every block of its
        ``nn.ModuleList``, ``ZeroConfig(activation_checkpointing={})``)."""
        policy = precision_policy(precision)
        key = (policy.model_dump_json(), policy_key(checkpointing), units if policy.enabled else Units())
        if key not in self._models:
            with explained("building the model"):
                model = self._build_fake()
            with self.mode, explained("building the model"):
                if not isinstance(model, nn.Module):
                    raise ValueError(f"the model function must return a torch.nn.Module, got {type(model).__name__}")
                if any(isinstance(p, DTensor) for p in model.parameters()):
                    raise ValueError("the model function returned a tensor-parallel model (DTensor parameters); give "
                                     "the estimator the unsplit model and the function that splits it: "
                                     "Workload(build, loss, batch, parallelize=fn) with fn(model, tp_mesh) -> model, "
                                     "and estimate(..., tensor_parallel=tp) (docs/estimator.md)")
                model = self._split(model)
                if policy.enabled:  # as ZeroOptimizer casts the managed parameters, and the inputs of its units
                    full = full_precision_parameters(model)  # and of the modules computing in param_dtype
                    cast_unmanaged_parameters(model, policy, keep=full)  # (a DTensor's: a new DTensor, as retyped)
                    planned = units.plan(model, list(model.parameters()))
                    input_casts(model, DTYPES[policy.param_dtype], cast=True, units=[u.name for u in planned if u.name])
                if key[1]:
                    checkpoint_activations(model, ActivationCheckpointing.model_validate_json(key[1]))
            self._models[key] = model
        return self._models[key]

    def _split(self, model: nn.Module) -> nn.Module:
        """The fake model split by ``parallelize`` over the tp mesh (in a tensor-parallel estimate's process)."""
        if self.parallelize is None:
            return model
        if self.mesh is None:
            raise ValueError("a workload with a parallelize function is priced with estimate(..., "
                             "tensor_parallel=tp), which splits the model over a (dp, tp) mesh in a process of its "
                             "own; this call has no tensor_parallel")
        split = self.parallelize(model, self.mesh["tp"])
        if not isinstance(split, nn.Module):
            raise ValueError(f"the parallelize function must return the split torch.nn.Module (as "
                             f"parallelize_module does), got {type(split).__name__}")
        return split

    def spec(self) -> dict[str, Any]:
        """What the workload was built from (``Workload(**spec)`` makes it again, without its traces)."""
        return {"build": self.build, "loss": self.loss, "batch": self.batch, "optimizer": self.optimizer,
                "optimizers": self.optimizers, "elementwise_optimizers": self.elementwise_optimizers,
                "per_parameter_optimizers": self.per_parameter_optimizers, "parallelize": self.parallelize}

    def device_type(self) -> str:
        """The type of device the model is built on (its first parameter's; ``"cpu"`` without any)."""
        with explained("building the model"):
            model = self._build_fake()
        first = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
        return first.device.type if first is not None else "cpu"

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

    def timeline(self, micro_batch: int, precision: PrecisionArg = "fp32", checkpointing: Checkpointing = False,
                 units: Units = Units(), part: tuple[bool, bool] | None = None) -> Timeline:
        """Forward, loss and backward of one micro-batch, live bytes after every operator. Beyond 3, the bytes at
        each point are extrapolated from the traces of micro-batches 2 and 3 (every storage's size is a constant
        or proportional to the micro-batch), unless those two traces differ in their steps. (Not from 1: models
        often take another path for a batch of one.) ``part``: a pipeline part's ``(first, last)``, traced as its
        stage runs it (:func:`zero.estimator.timeline.record_step`)."""
        policy = precision_policy(precision)
        key = (micro_batch, policy.model_dump_json(), policy_key(checkpointing), units if policy.enabled else Units(),
               part)
        if key not in self._timelines and micro_batch > 3:
            two, three = (self.timeline(m, policy, checkpointing, units, part) for m in (2, 3))
            if two.aligned(three):
                self._timelines[key] = two.extrapolate(three, micro_batch)
        if key not in self._timelines:
            self._timelines[key] = self._trace(micro_batch, policy, checkpointing, units, part)
        return self._timelines[key]

    def _trace(self, micro_batch: int, precision: PrecisionArg, checkpointing: Checkpointing,
               units: Units = Units(), part: tuple[bool, bool] | None = None) -> Timeline:
        policy = precision_policy(precision)
        model = self.model(policy, checkpointing, units)
        first, last = part or (True, True)
        with self.mode:
            with explained("making the batch"):  # (a later part's input activation gets its gradient)
                batch = tuple(self._fake(t, policy, not first) for t in self.batch(micro_batch))
            with explained("tracing the step"):
                try:
                    return replace(record_step(model, self.loss if last else None, batch,
                                               output_gradient=not last, keep_output=part is not None and last),
                                   micro_batch=micro_batch)
                finally:
                    for p in model.parameters():
                        p.grad = None

    def _fake(self, t: Any, policy: MixedPrecision, grad: bool = False) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            t = self.mode.from_tensor(t)
        if policy.enabled and t.is_floating_point():  # ZeroOptimizer casts the root forward's float inputs
            t = t.to(DTYPES[policy.param_dtype])
        return t.detach().requires_grad_() if grad and t.is_floating_point() else t

    # ----- what ZeroOptimizer builds -----------------------------------------------------------------------

    def layout(self, stage: int, world_size: int, precision: PrecisionArg = "fp32", bucket_size_mb: float = 25,
               offload: OffloadChoice = OffloadChoice(), secondary_shards: int = 1, rank: int | None = None,
               units: Units = Units()) -> Layout:
        """One rank's buckets (and stage 3's units) for this configuration, by the optimizer's own planning (with
        ``offload``'s placements: which buffers are off the device, and where). ``world_size`` is the ranks the
        model states are sharded over: with HSDP, the shard group's size (with hpZ every rank's, and
        ``secondary_shards`` the ranks of its groups: each bucket then has a secondary copy of ``1/secondary_shards``
        of it). The rank is ``rank`` (its shard: ``rank % shards``), else, with several or whole-parameter
        optimizers, the one holding the most optimizer state (:func:`zero.estimator.optimizers.ownership`), else
        rank 0. ``units``: stage 3's unit policy (``ZeroConfig.unit_classes`` or ``unit_size_mb``)."""
        if offload.pages and self.assignment().several_or_whole:
            raise ValueError(f"offload to disk pages one elementwise optimizer's per-element state through the file; "
                             f"with {self.assignment().describe()} offload to 'cpu' instead")
        policy = precision_policy(precision)
        model = self.model(policy, units=units)
        keeps = make_stage(stage, policy).policy(world_size, secondary_shards=secondary_shards)
        state = self._disk_state() if offload.pages else {}
        stepped = set(self.assignment().group_of)  # (the trainable parameters in the optimizers)
        with self.mode:
            full = full_precision_parameters(model)
            partition = build_partition(
                torch.optim.SGD([p for n, p in model.named_parameters() if n in stepped] or model.parameters(), lr=0.1),
                model,
                bucket_size_bytes=max(1, int(bucket_size_mb * 2**20)),
                policy=keeps,
                shard_index=0,
                plan=partial(units.plan, model) if stage == 3 else None,
                dtypes_of=lambda p: policy.dtypes(p.dtype, full=p in full),
                placements=offload.placements() if offload.offloaded else None,
            )
        bucketed = {id(slot.param) for b in partition.buckets for slot in b.slots}
        stage_plan = partition.plan
        owners = self._ownership(partition.trainable_buckets, keeps.num_shards, policy, rank)
        priced = tuple(_priced(b, owners.shard, file_bytes(stage_plan, b.plan, state)) for b in partition.buckets)
        return Layout(
            stage=stage,
            buckets=priced,
            frozen=sum(local_of(p).local(p).numel() * p.element_size() for p in model.parameters()
                       if id(p) not in bucketed),  # (a DTensor's local tensor)
            buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
            staged=partition.plan.policy.staged,
            grad_buffer=sum(plan.nbytes(Role.GRADS) for plan in partition.plan.buckets),
            units=tuple(u.name for u in partition.units),
            disk=planned_disk_bytes(stage_plan, state) if offload.pages else 0,
            disk_state=sum(dtype.itemsize for dtype in state.values()),
            slots=len(partition.slots),
            owners=owners,
        )

    def _ownership(self, buckets: list, num_shards: int, policy: MixedPrecision, rank: int | None) -> Ownership:
        """Which whole parameters each shard owns, and the shard priced (see :meth:`layout`)."""
        a = self.assignment()
        if not a.several_or_whole:  # (one flat optimizer: every rank holds the same, rank 0 the most elements)
            return Ownership(rank % num_shards if rank is not None else 0)
        dtype = master_dtype(policy)
        flat = self.steps.flat_rates(dtype) if rank is None else {}
        return ownership(buckets, a, self.steps.whole_states(dtype), flat, num_shards, rank)

    def _disk_state(self) -> dict[str, torch.dtype]:
        """The optimizer's per-element state that offload to disk keeps in the file, by the runtime's own probe."""
        if self._disk_state_keys is None:  # (on a real two-element parameter, outside the fake mode)
            real = [torch.zeros(2, requires_grad=True)]
            self._disk_state_keys = per_element_state(
                self.optimizer(real) if self.optimizers is None else same_kind(self.assignment().optimizers[0], real))
        return self._disk_state_keys

    def assignment(self) -> Assignment:
        """The optimizers built on the fake model: which one steps each trainable parameter, and on which path."""
        if self._assignment is None:
            model = self.model()
            with self.mode, explained("building the optimizers"):
                if self.optimizers is not None:
                    built = self.optimizers(model)
                else:  # (over every parameter when none is trainable: the partition says so)
                    built = self.optimizer([p for p in model.parameters() if p.requires_grad] or [*model.parameters()])
                self._assignment = assign(built, model, self.elementwise_optimizers, self.per_parameter_optimizers)
        return self._assignment

    def step(self, layout: Layout, precision: PrecisionArg = "fp32") -> StepTrace:
        """What ``ZeroOptimizer.step()`` holds besides the buffers on the layout's rank, traced on fake tensors
        (:meth:`zero.estimator.optimizer_step.OptimizerSteps.step`)."""
        return self.steps.step(layout, precision_policy(precision))


def _priced(bucket: Any, shard: int, disk: int) -> BucketBytes:
    """The bytes of one bucket's planned buffers, as the schedule replays them (``zero.runtime.buffers.plan``), with
    the pieces of ``shard``'s chunk."""
    plan, unit = bucket.plan, bucket.unit
    lay, d = plan.layout, plan.dtypes
    names = {slot.span.param_index: slot.name for slot in bucket.slots}
    pieces = lay.pieces(shard) if plan.trainable else []
    return BucketBytes(
        params=tuple(s.name for s in bucket.slots) if plan.trainable else (),
        whole=plan.nbytes(Role.PARAMS),
        shard=plan.nbytes(Role.SHARD) or lay.chunk_numel * d.compute.itemsize,
        staging=lay.padded_numel * d.reduce.itemsize,
        grad_shard=lay.chunk_numel * d.reduce.itemsize,
        master=plan.nbytes(Role.MASTER),
        master_grad=plan.nbytes(Role.MASTER_GRAD),
        elements=lay.chunk_numel if plan.trainable else 0,
        pieces=tuple(piece.numel for piece in pieces),
        piece_params=tuple(names[piece.param_index] for piece in pieces),
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
