"""Assembling a ``ZeroOptimizer``'s runtime, in the order data flows:

    config -> communicators (codec, shard groups) -> stage policy -> plan and buckets (placed)
    -> parameters packed or sharded -> wrapped optimizers over the shard (flat) or over owned whole parameters
    -> stepper -> gatherer and reducer (hooks) -> release

Each step takes what the steps before produced and nothing else; parts a configuration does not use are
null objects (``NoGatherer``, ``NoLossScaling``, ``ImmediateUpdate``), so nothing downstream asks whether
they exist.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero.comm.communicator import Communicator
from zero.comm.hierarchy import codec_of, hierarchical
from zero.config import ZeroConfig
from zero.precision import DTYPES
from zero.runtime.activations.checkpointing import checkpoint_activations
from zero.runtime.buffers.local_tensor import local_of, retype_parameters
from zero.runtime.buffers.partition import Partition, build_partition
from zero.runtime.buffers.placement import Placements
from zero.runtime.buffers.units import plan_units
from zero.runtime.gathering.gatherer import ParamGatherer
from zero.runtime.gathering.no_gatherer import NoGatherer
from zero.runtime.gathering.release import ModelRelease, gather_dropped_shards
from zero.runtime.gathering.secondary import PrimaryShards, SecondaryCopies
from zero.runtime.guards.ddp import check_not_ddp
from zero.runtime.guards.ownership import OwnershipMarker, claim_parameters, managed_elsewhere
from zero.runtime.materialize import InitFn, materialize, replace_meta_parameters
from zero.runtime.offload.host import check_host_memory
from zero.runtime.offload.paging import per_element_state
from zero.runtime.offload.targets import paging_of, placements_of
from zero.runtime.parallel.tensor_parallel import NoTensorParallel, tensor_parallel_of
from zero.runtime.precision.casts import input_casts
from zero.runtime.precision.parameters import (
    cast_unmanaged_parameters,
    check_device_supports,
    full_precision_parameters,
)
from zero.runtime.reduction.reducer import GradReducer
from zero.runtime.runtime import Runtime
from zero.runtime.stages import Stage, make_stage
from zero.runtime.step.delayed import DelayedStep
from zero.runtime.step.host_threads import HostThreads, host_step_threads, warn_unfused_host_step
from zero.runtime.step.inner import (
    ParamGroups,
    as_list,
    check_optimizers,
    is_elementwise,
    is_per_parameter,
    rebuild_flat,
    rebuild_whole,
)
from zero.runtime.step.loss_scaler import LossScaler, NoLossScaling
from zero.runtime.step.owner_step import OwnerStep
from zero.runtime.step.stepper import BucketStepper, ImmediateUpdate
from zero.weak import weak_hook


def build_runtime(
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
    model: torch.nn.Module,
    config: ZeroConfig,
    *,
    process_group: dist.ProcessGroup | None,
    init_fn: InitFn | None,
    device: torch.device | str | None,
    placements: Placements | None = None,
) -> Runtime:
    """Check the inputs, then build every part of the runtime over ``model`` (collective: every rank builds).
    ``placements``: where each side of a bucket lives (default: as ``config.offload`` says)."""
    optimizers = as_list(optimizer)
    check_optimizers(optimizers, model)
    whole = [not is_elementwise(o, config.elementwise_optimizers) for o in optimizers]
    _check_whole_supported(optimizers, whole, config)
    groups = ParamGroups(optimizers)
    check_not_ddp(model)
    world = Communicator(
        process_group, config.timeout_s, device=model_device(model, device), force_collectives=config.force_collectives
    )
    comm, secondary = hierarchical(world, config.communication)  # (HSDP: the shard group's; hpZ: and its group's)
    tensor_parallel = tensor_parallel_of(model, world, config.timeout_s)  # (a model split by parallelize_module)
    _check_tensor_parallel_supported(tensor_parallel, config, comm.replicas or secondary)
    for communicator in (comm, *comm.levels.values()):
        communicator.codec = codec_of(config.communication)
    gather_dropped_shards(model)  # what a dropped stage-3 optimizer left sharded (zero.runtime.gathering.release)
    check_device_supports(config.precision, comm.device)
    stage = make_stage(config.stage, config.precision)
    meta = _replace_meta_parameters(model, groups, stage, init_fn, comm.device)
    if config.sync_module_states:
        _broadcast_module_states(model, world, skip=meta)
    placements = placements or placements_of(config.offload, comm.device, comm.rank, comm.world_size)
    state = per_element_state(optimizers[0]) if placements.paged is not None else {}  # what a paged side must hold
    partition = _build_partition(groups, model, config, stage, comm, placements, state, secondary)
    marker = OwnershipMarker()
    claim_parameters(marker, partition.buckets)
    for bucket in partition.buckets:
        stage.init_params(bucket)
        if bucket.trainable:
            stage.init_grads(bucket)
        bucket.build_pieces()
        bucket.evict()  # offload to disk: what was written is not needed in memory until used
    retype_parameters(model, [slot for bucket in partition.buckets for slot in bucket.slots])  # (bf16 DTensors)
    if meta:
        slots = {slot.param: slot for bucket in partition.buckets for slot in bucket.slots}
        materialize(model, meta, slots, init_fn, comm.device)
    precision = config.precision
    managed = {slot.param for bucket in partition.buckets for slot in bucket.slots}
    cast_unmanaged_parameters(model, precision, keep=managed | _full_precision(model, config))
    whole_groups = {gi: None if is_per_parameter(o, config.per_parameter_optimizers) else i
                    for i, (o, r, w) in enumerate(zip(optimizers, groups.ranges, whole)) if w for gi in r}
    whole_step = OwnerStep(partition.trainable_buckets, whole_groups, comm, stage.num_shards(comm.world_size),
                           tensor_parallel)
    inners = [rebuild_whole(o, r, whole_step.owned()) if w else rebuild_flat(o, r, partition.buckets)
              for o, r, w in zip(optimizers, groups.ranges, whole)]
    whole_step.inners = [inner for inner in inners if inner.whole]
    stepper = BucketStepper(inners, partition.trainable_buckets, config.step_kernel)
    paging = paging_of(inners[0].optimizer, partition.trainable_buckets, placements, state, config.offload.buffer_count)
    threads = HostThreads(_host_threads(config, comm))
    if threads.count is not None:
        for inner in inners:
            warn_unfused_host_step(inner.optimizer)
    policy = config.activation_checkpointing
    runtime = Runtime(
        config=config,
        module=model,
        comm=comm,
        stage=stage,
        partition=partition,
        placements=placements,
        marker=marker,
        inners=inners,
        stepper=stepper,
        whole_parameter_step=whole_step,
        update=(DelayedStep(inners[0].optimizer, threads) if config.offload.delayed_step
                else ImmediateUpdate(stepper, whole_step, stage, comm, paging, threads)),
        scaler=LossScaler(precision.scaling, comm.device) if precision.scaling is not None else NoLossScaling(),
        gatherer=_gatherer(partition, stage, comm, config, secondary),
        paging=paging,
        tensor_parallel=tensor_parallel,
        checkpointed=checkpoint_activations(model, policy) if policy is not None else None,
    )
    runtime.reducer = GradReducer(
        partition.trainable_buckets,
        stage,
        comm,
        config.max_in_flight_buckets,
        runtime.gatherer,
        check=weak_hook(runtime.before_backward),
        steps=weak_hook(runtime.steps_taken),
        scaler=runtime.scaler,
        tensor_parallel=tensor_parallel,
    )
    hooks = [*runtime.reducer.hooks, *runtime.gatherer.hooks, *_input_casts(runtime, partition)]
    first_forward = torch.compiler.disable(weak_hook(runtime.before_first_forward))  # (it reads the call stack)
    runtime.first_forward_hook = model.register_forward_pre_hook(first_forward)
    hooks.append(runtime.first_forward_hook)
    runtime.release = ModelRelease(hooks, partition.buckets, stage, comm, sharded=runtime.gatherer.sharded)
    comm.stats.end_step()  # construction traffic is not a step's
    return runtime


def watch_for_drop(owner: Any, runtime: Runtime) -> None:
    """When ``owner`` (the ``ZeroOptimizer``) is dropped without ``close()``, give the model back as far as that
    can be done without a collective (see ``zero.runtime.gathering.release``)."""
    finalizer = weakref.finalize(owner, runtime.release.dropped)
    finalizer.atexit = False  # (no collective, no hook removal at interpreter exit)
    runtime.marker.optimizer = weakref.ref(owner)  # found from its parameters (zero.pipelining)


def _check_whole_supported(optimizers: list[torch.optim.Optimizer], whole: list[bool], config: ZeroConfig) -> None:
    """Several optimizers, or one stepped on whole parameters: refuse by name what their step cannot run under."""
    if len(optimizers) == 1 and not whole[0]:
        return
    what = (f"several optimizers ({', '.join(type(o).__name__ for o in optimizers)})" if len(optimizers) > 1
            else f"{type(optimizers[0]).__name__}, stepped on whole parameters")
    if config.offload.delayed_step:
        raise ValueError(f"offload.delayed_step steps a copy of one elementwise optimizer in the background; with "
                         f"{what} turn it off (offload.optimizer='cpu' alone steps on the host)")
    if config.offload.pages:
        raise ValueError(f"offload to disk pages one elementwise optimizer's per-element state through the file; "
                         f"with {what} offload to 'cpu' instead")


def _check_tensor_parallel_supported(tensor_parallel: NoTensorParallel, config: ZeroConfig,
                                     levels: Communicator | None) -> None:
    """With a tensor-parallel model: refuse by name what does not compose with tp yet."""
    if tensor_parallel.size == 1:
        return
    refused = ["offload to disk" if config.offload.pages else None,
               "hierarchical communication (HSDP, hpZ)" if levels is not None else None]
    refused = [r for r in refused if r]
    if refused:
        raise ValueError(f"zero does not yet compose tensor parallelism with {refused[0]}; with a model split by "
                         "parallelize_module, offload to 'cpu' at most, and use flat communication "
                         "(docs/parallelism.md)")


def _host_threads(config: ZeroConfig, comm: Communicator) -> int | None:
    """The host step's threads (``None``: nothing steps on the host). The ranks sharing this machine: torchrun's
    ``LOCAL_WORLD_SIZE``, else every rank of the world (one machine)."""
    if not config.offload.optimizer_on_host or config.offload.ratio == 0:
        return None
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
    return host_step_threads(config.offload.host_threads, local_ranks)


def model_device(model: torch.nn.Module, device: torch.device | str | None) -> torch.device | None:
    """The device the model's parameters live on (the communicator's): ``device`` if given, else that of
    the first parameter not on ``meta``; ``None`` lets the communicator choose (the backend's device)."""
    if device is not None:
        return torch.device(device)
    return next((p.device for p in model.parameters() if not p.is_meta), None)


def _full_precision(model: torch.nn.Module, config: ZeroConfig) -> set:
    return full_precision_parameters(model) if config.precision.enabled else set()


def _build_partition(
    optimizer: ParamGroups,
    model: torch.nn.Module,
    config: ZeroConfig,
    stage: Stage,
    comm: Communicator,
    placements: Placements,
    state: dict[str, torch.dtype],
    secondary: Communicator | None,
) -> Partition:
    """The buckets (and their plan) of this rank, after checking that the offloaded side fits in host memory (or,
    paged, with the optimizer's per-element ``state``, that its placement has room for the plan: the disk's)."""
    precision, offload = config.precision, config.offload
    num_shards = stage.num_shards(comm.world_size)
    trainable = sum(local_of(p).local(p).numel()  # (a DTensor's: what this rank holds)
                    for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    param_bytes = DTYPES[precision.param_dtype].itemsize if precision.enabled else 4
    check_host_memory(offload, int(-(-trainable // num_shards) * offload.ratio), param_bytes)
    full = _full_precision(model, config)
    plan = _unit_planner(model, config) if stage.sharded_params else None
    return build_partition(
        optimizer,
        model,
        bucket_size_bytes=config.bucket_size_bytes,
        policy=stage.policy(comm.world_size, secondary_shards=secondary.world_size if secondary else 1),
        shard_index=comm.rank if num_shards > 1 else 0,
        plan=plan,
        device=comm.device,
        dtypes_of=lambda p: precision.dtypes(p.dtype, full=p in full),
        placements=placements,
        check=lambda plan: placements.check_room(plan, state),
    )


def _unit_planner(model: torch.nn.Module, config: ZeroConfig) -> Callable[[list[torch.nn.Parameter]], list]:
    return lambda params: plan_units(model, params, unit_classes=config.unit_classes,
                                     unit_size_bytes=config.unit_size_bytes)


def _gatherer(
    partition: Partition, stage: Stage, comm: Communicator, config: ZeroConfig, secondary: Communicator | None
) -> ParamGatherer | NoGatherer:
    if not stage.sharded_params:
        return NoGatherer()
    return ParamGatherer(
        partition.units,
        partition.buckets,
        stage,
        comm,
        reshard_after_forward=config.reshard_after_forward,
        prefetch=config.prefetch_units,
        source=SecondaryCopies(secondary) if secondary is not None else PrimaryShards(),
    )


def _input_casts(runtime: Runtime, partition: Partition) -> list:
    """Mixed precision: the root's floating-point inputs cast to ``param_dtype``, and those of each unit and of each
    module computing in it (``zero.runtime.precision.casts.input_casts``; refused by name with
    ``cast_forward_inputs=False``)."""
    precision, model = runtime.config.precision, runtime.module
    if not precision.enabled:
        return []
    units = partition.units or _unit_planner(model, runtime.config)(list(model.parameters()))
    hooks = input_casts(model, DTYPES[precision.param_dtype], precision.cast_forward_inputs,
                        units=[unit.name for unit in units if unit.name])
    if precision.cast_forward_inputs:
        hooks.append(model.register_forward_pre_hook(weak_hook(runtime.cast_forward_inputs), with_kwargs=True,
                                                     prepend=True))
    return hooks


def _broadcast_module_states(model: torch.nn.Module, comm: Communicator, skip: set) -> None:
    """Rank 0's parameters and buffers everywhere, except those built on ``meta`` (``skip`` and meta
    buffers: every rank initializes them alike, from the same seed) and parameters another live
    ZeroOptimizer manages (a part of the model trained apart)."""
    if comm.skips_collectives:
        return
    params = [p for p in model.parameters() if not managed_elsewhere(p)]  # (broadcast by their owner)
    tensors = [t for t in [*params, *model.buffers()] if t not in skip and not t.is_meta]
    what = "broadcast of rank 0's module states"
    for handle in [comm.broadcast(local_of(t).local(t).data, 0, what=what) for t in tensors]:
        handle.wait()


def _replace_meta_parameters(
    model: torch.nn.Module, optimizer: ParamGroups, stage: Stage, init_fn: InitFn | None, device: torch.device
) -> set:
    """Stage 3 with a meta model: swap meta parameters for placeholders on the target device."""
    if not any(p.is_meta for p in model.parameters()):
        if init_fn is not None:
            raise ValueError("init_fn is used only to initialize a model built on the meta device")
        return set()
    if not stage.sharded_params:
        raise ValueError(
            f"the model has parameters on the meta device; only stage 3 materializes them shard by shard "
            f"(got stage {stage.number}). Use stage=3, or build the model on a real device."
        )
    return replace_meta_parameters(model, optimizer, device)
