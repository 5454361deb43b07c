"""Pre-flight memory estimates: one rank's peak bytes for a model at any stage, world size and micro-batch.

Nothing is allocated. :func:`estimate` takes a :class:`~zero.estimator.Workload` (the model, the loss
as the training loop computes it, and its batches), traces one forward, loss and backward on fake
tensors with live bytes after every operator (:mod:`zero.estimator.timeline`: what autograd saves and
releases, operator temporaries, gradients as they are created and accumulated), then replays that
timeline with the configuration's buffer schedule (:mod:`zero.estimator.schedule`: the buckets and
units ``ZeroOptimizer`` would build, gathering and prefetch at stage 3, reduction staging and gradient
shards at stages 2-3, persistent gradient buckets at stages 0-1) and with traced steps of the wrapped
optimizers, each priced where its state lives (:mod:`zero.estimator.optimizers`: a flat optimizer's on every rank's
pieces, a whole-parameter optimizer's, such as Muon's or Adafactor's, on the rank that owns the parameter). The rank
priced is rank 0, or with several or whole-parameter optimizers the one with the higher peak of the rank holding
the most optimizer state and the rank owning the most whole-parameter elements (the ranks differ), or the rank asked
for. The peak is reported
by the memory tracker's categories with the phase, module and event where it happens, so that an estimate and a
``zero.profile`` measurement read side by side.

Checked against ``zero.profile`` on the same configuration (``tests/distributed/test_estimate_world.py``):
the project's GPT, Hugging Face GPT-2 and Llama with the loss inside ``forward``, a CNN, at stages 0-3,
world sizes 1-3 and two micro-batches, Muon with AdamW and Adafactor at stages 0-3 on every rank of worlds of 2
and 3 (``estimate_world optimizers``), a 1.1B GPT at stage 3 on 64 simulated ranks, a tensor-parallel
LlamaGPT on dp 2 x tp 2 at stages 0-3 (``estimate(..., tensor_parallel=tp)``: :mod:`zero.estimator.tensor_parallel`),
and the parts of a pipelined LlamaGPT under GPipe and 1F1B on dp 2 x pp 2 and pp 3 at stages 1-3
(``estimate(..., pipeline=Pipeline(...))``: :mod:`zero.estimator.pipeline`).
It prices from the operator's shapes: the CPU convolution's own buffers (oneDNN's blocked copies and GEMM workspaces,
slow_conv2d's columns: :mod:`zero.estimator.workspaces`) and the CPU bf16 matmul's (oneDNN's scratchpad:
:mod:`zero.estimator.matmul_workspaces`). What it cannot see: what other kernels allocate inside themselves (e.g.
oneDNN's smaller convolution scratchpads), which fake tensors do not run, and what
collectives allocate for themselves (NCCL's are outside PyTorch's
allocator; gloo's are reported by the tracker as ``communication/collective internals``).

Each estimate also carries one step's collectives under the configuration's ``communication`` policy (ZeRO++'s
quantized weights and gradients, hierarchical sharding), as ``opt.comm_stats`` counts them
(:mod:`zero.estimator.traffic`).

:func:`trace` is the older forward-only census (saved bytes per block) that activation-checkpointing
policies use (:func:`zero.blocks_within_budget`); :func:`model_states` gives the ZeRO paper's formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from zero.activations import ActivationCheckpointing
from zero.config import ZeroConfig
from zero.estimator.census import Trace, trace  # noqa: F401 - re-exported (zero.estimator.trace)
from zero.estimator.codec_memory import CodecMemory
from zero.estimator.configuration import DISK_PATH, POLICIES, Units, priced_config
from zero.estimator.offloading import OffloadChoice
from zero.estimator.optimizer_step import master_dtype
from zero.estimator.partial_offload import least_offload, offload_boundaries
from zero.estimator.pipeline import Pipeline, check_part, compose
from zero.estimator.result import Estimate
from zero.estimator.schedule import Options, replay
from zero.estimator.tensor_parallel import check_tensor_parallel, price_in_child
from zero.estimator.traffic import communication_policy, secondary_size, stages_for, step_traffic
from zero.estimator.workload import Workload
from zero.memory import STAGES, ModelStateBytes, zero_model_states
from zero.offload import TARGETS, Offload, OffloadTarget, target_of
from zero.precision import DTYPES, MixedPrecision
from zero.sizes import format_bytes, parse_size  # noqa: F401 - parse_size re-exported by zero.estimator

HEADROOM = 0.9  # the share of the device a plan fills; the rest is the allocator's and the CUDA context's


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state kind (Adam: ``optimizer`` is m and v), as ZeroOptimizer
    holds them under a :class:`zero.MixedPrecision` policy (``zero.precision``'s Note)."""

    name: str
    param: int
    grad: int  # autograd's gradients (stages 0-1: the persistent gradient buffer)
    master: int  # fp32 master copy kept by mixed precision
    optimizer: int
    reduced: int  # the reduced gradient shard; stages 0-1 reduce the gradient buffer in place when = grad

    @classmethod
    def of(cls, policy: MixedPrecision, name: str = "") -> "Precision":
        """The bytes a ZeroOptimizer with ``policy`` holds for an fp32-built model trained with Adam."""
        if policy.param_dtype is None:
            return cls(name or "fp32", param=4, grad=4, master=0, optimizer=8, reduced=4)
        low = DTYPES[policy.param_dtype].itemsize
        reduced = DTYPES[policy.reduce_dtype or "fp32"].itemsize
        return cls(name or "mixed", param=low, grad=low, master=4, optimizer=8, reduced=reduced)


PRECISIONS = {name: Precision.of(policy, name) for name, policy in POLICIES.items()}


def model_states(numel: int, world_size: int, stage: int, precision: str | Precision = "fp32") -> ModelStateBytes:
    """Per-rank model-state bytes after a step (Ψ = ``numel``, N = ``world_size``) for a precision's name (a key of
    ``PRECISIONS``: "fp32", "mixed", "mixed-fp32-reduce" ...) or :class:`Precision`: the ZeRO paper's formulas
    (:func:`zero.memory.zero_model_states`) when the reduced gradient has the gradients' dtype ("fp32",
    "mixed"); with a wider reduced gradient ("mixed-fp32-reduce") stages 0-1 keep it beside their gradient
    buffer and stages 2-3 shard it at its own width."""
    prec = precision if isinstance(precision, Precision) else _precision(precision)
    return zero_model_states(numel, world_size, stage, param_bytes=prec.param, grad_bytes=prec.grad,
                             optimizer_bytes=prec.master + prec.optimizer, reduced_bytes=prec.reduced)


def estimate(
    workload: Workload,
    config: ZeroConfig | None = None,
    *,
    world_size: int,
    micro_batch: int,
    no_sync: bool = False,
    rank: int | None = None,
    tensor_parallel: int = 1,
    pipeline: Pipeline | Mapping[str, Any] | None = None,
    maybe_unused: Sequence[str] = (),
    **settings: Any,
) -> Estimate:
    """One rank's peak of one steady-state training step (the optimizer state exists) of ``workload`` under
    ``ZeroOptimizer(optimizer, model, config)`` on ``world_size`` ranks: the step traced on fake tensors
    (:mod:`zero.estimator.timeline`) replayed with the configuration's buffer schedule (:mod:`zero.estimator.schedule`).

    ``config``: the :class:`zero.ZeroConfig` the run uses, every field of which is priced or declared memory-neutral
    (:mod:`zero.estimator.configuration`); ``settings`` are applied on top of it: its fields by name (``stage=3``,
    ``unit_classes=["Block"]``, ``reshard_after_forward=False`` ...) or the estimator's shorthands:

    * ``precision``: ``"fp32"`` (no mixed precision), ``"mixed"`` (the ZeRO paper's: bf16 parameters, gradients and
      reduction, fp32 master weights, ``precision={"param_dtype": "bf16", "reduce_dtype": "bf16"}``) or
      ``"mixed-fp32-reduce"`` (``precision={"param_dtype": "bf16"}``: gradients reduced and kept in fp32), or the
      field's own value;
    * ``checkpointing``: ``True`` for every block of the model's ``nn.ModuleList`` (``activation_checkpointing={}``),
      or a policy as ``activation_checkpointing`` takes it;
    * ``offload``: where the optimizer's side (fp32 master, gradient shard, optimizer state) lives, ``"none"``,
      ``"cpu"`` or ``"disk"`` (``False`` and ``True`` read as ``"none"`` and ``"cpu"``; disk's directory is a stand-in
      unless ``offload={"path": ...}`` is given), or the field's own value; ``params_offload`` (``offload.params``,
      stage 3's parameter shards, which take the optimizer's side along), ``buffer_count`` (``offload.buffer_count``:
      with disk, how many buckets are mapped in host memory at a time) and ``offload_ratio`` (``offload.ratio``).

    The estimate's ``categories`` are device memory, ``host`` host memory (with disk: ``buffer_count`` of the largest
    buckets' files) and ``disk`` the offload file; ``config`` the validated ``ZeroConfig`` priced.
    ``no_sync``: gradient accumulation with earlier micro-batches under ``opt.no_sync()`` (the Trainer's and
    Accelerate's way), which keeps the gradients whole until the last micro-batch's backward reduces them (at stages
    2-3 too). With ``communication.shard_size`` (HSDP) the model states are those of a ``shard_size``-rank world; with
    ``hierarchy="hpz"`` (stage 3) those of the whole world, plus each bucket's secondary copy (``1/shard_size`` of it
    in the parameters' dtype, under ``parameters``). The estimate's ``traffic`` is one step's collectives, what
    ``opt.comm_stats`` counts (:mod:`zero.estimator.traffic`).
    ``rank``: the rank priced (``Estimate.rank``). By default rank 0, or, with several optimizers or one stepped on
    whole parameters (``Workload(optimizers=...)``: Muon, Adafactor, ...), where the ranks differ (each whole
    parameter's state lives on its owner, which also holds its whole gradient and master during the step), the
    higher peak of two: the rank holding the most optimizer state and the rank owning the most whole-parameter
    elements.
    ``tensor_parallel``: the tp degree of a run whose model the workload's ``parallelize`` splits
    (``Workload(..., parallelize=fn)``); ``world_size`` is then every rank, dp x tp, the model states are sharded over
    the dp ranks, and ``rank`` is a global rank (``divmod(rank, tensor_parallel)`` is its place on the mesh). It is
    priced in a process of its own (:mod:`zero.estimator.tensor_parallel`).
    ``pipeline``: the workload is one part of a pipeline, trained under torch's ``ScheduleGPipe`` or ``Schedule1F1B``
    with ``zero.pipelining.PipelineStage`` (a :class:`zero.estimator.Pipeline`, or a mapping of its fields:
    ``schedule``, ``stages``, ``stage_index``, ``micro_batches``); ``world_size`` is the part's dp ranks,
    ``micro_batch`` one micro-batch, and the step is the schedule's micro-batches on this part
    (:mod:`zero.estimator.pipeline`).
    ``maybe_unused``: parameters that may get no gradient in a step, by name or module prefix as
    ``model.named_parameters()`` names them (``["blocks.0.moe.experts"]``: an MoE's experts, one of which may receive no
    tokens). The trace gives every parameter the forward used a gradient; the reducer launches buckets strictly in
    order, each once all its gradients are in, so a gradient that does not come holds its bucket and every later one
    until the end of backward. The estimate is the larger of the two steps, every gradient coming and none of these
    (their optimizer state and step still counted, as an earlier step may have made it).
    """
    config = priced_config(config, **settings)
    if world_size < 1 or micro_batch < 1:
        raise ValueError(f"world_size and micro_batch must be >= 1, got {world_size} and {micro_batch}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be a whole number from 0 to world_size - 1 = {world_size - 1}, got {rank!r}")
    pipe = Pipeline.of(pipeline)
    check_part(workload, pipe, tensor_parallel)
    mesh = check_tensor_parallel(workload.parallelize, world_size, tensor_parallel, config)
    if mesh is not None and workload.mesh is None:  # (split over a fake (dp, tp) mesh in a child process)
        return price_in_child(estimate, workload, mesh, rank or 0, dict(
            config=config, world_size=world_size, micro_batch=micro_batch, no_sync=no_sync, rank=rank,
            tensor_parallel=tensor_parallel, maybe_unused=tuple(maybe_unused)))
    tp_rank = workload.mesh["tp"].get_local_rank() if mesh is not None else 0
    if mesh is not None:
        whole = workload.declaring(config.elementwise_optimizers, config.per_parameter_optimizers).assignment()
        if any(whole.whole):
            raise ValueError(f"the estimator does not price {whole.describe()} under tensor parallelism yet (their "
                             "owners gather tp-sharded matrices over tp); estimate with an elementwise optimizer "
                             "(AdamW) in its place, or measure the step with zero.profile")
        world_size, rank = world_size // tensor_parallel, rank // tensor_parallel if rank is not None else None
    choice = OffloadChoice.of(config.offload)
    policy, group = communication_policy(config.communication, world_size)
    secondary = secondary_size(policy, world_size)
    workload = workload.declaring(config.elementwise_optimizers, config.per_parameter_optimizers)
    precision, units, checkpointing = config.precision, Units.of(config), config.activation_checkpointing
    options = Options(choice, config.max_in_flight_buckets, config.prefetch_units, config.reshard_after_forward,
                      no_sync, CodecMemory.of(policy, group, world_size))
    timeline = workload.timeline(micro_batch, precision, checkpointing, units, pipe.part if pipe else None)
    if pipe is not None:  # (the schedule's micro-batches on this part, reduced once after the last)
        part = compose(timeline, pipe)
        timeline = part.timeline
        options = replace(options, pipelined=True, pipeline_buffers=part.buffers, step_held=part.step_held,
                          reshard_after_backward=pipe.reshard_after_backward)
    late = _parameters_named(maybe_unused, timeline.grad_bytes)

    def priced(shard: int | None) -> tuple[Any, Any]:
        layout = workload.layout(config.stage, group, precision, config.bucket_size_mb, choice,
                                 secondary_shards=max(1, secondary), rank=shard, units=units)
        step = workload.step(layout, precision)
        peaks = [replay(timeline, layout, step, options)]
        if late:  # (and none of them coming)
            peaks.append(replay(timeline.without_gradients(late), layout, step, options))
        return layout, max(peaks, key=lambda peak: peak.total)

    layout, peak = priced(rank)
    for shard in layout.owners.rivals() if rank is None else ():  # (the larger peak of the two)
        other = priced(shard)
        if other[1].total > peak.total:
            layout, peak = other
    owners = layout.owners
    exchange = (owners.exchanged, master_dtype(precision)) if owners.num_shards > 1 else None
    tp = mesh.tp if mesh is not None else 1
    return Estimate(
        world_size=world_size * tp, micro_batch=micro_batch, categories=peak.categories, host=peak.off.host,
        phase=peak.phase, module=peak.module, event=peak.event, disk=peak.off.disk,
        traffic=step_traffic(config.stage, tuple(b.wire for b in layout.buckets), layout.slots, peak.gathers, policy,
                             group, world_size, regathers=peak.regathers, secondary=secondary, exchange=exchange),
        rank=(rank if rank is not None else owners.shard) * tp + tp_rank, config=config, tensor_parallel=tp,
        pipeline=pipe,
    )


@dataclass(frozen=True)
class Plan:
    fits: list[Estimate]  # best first
    rejected: list[tuple[Estimate, str]]  # with the reason


def plan(
    workload: Workload,
    config: ZeroConfig | None = None,
    *,
    gpu_memory: float,
    world_size: int,
    micro_batches: list[int],
    headroom: float = HEADROOM,
    no_sync: bool = False,
    progress: Callable[[str], None] | None = None,
    host_memory: float | None = None,
    maybe_unused: Sequence[str] = (),
    **settings: Any,
) -> Plan:
    """Every stage × offload × checkpointing × micro-batch over ``config`` (with ``settings`` applied, as
    :func:`estimate` takes them; its other fields, such as precision, units, prefetch, buckets and communication, are
    kept); those whose peak fits in ``headroom * gpu_memory`` (the rest is left to the allocator and the CUDA
    context), and whose host bytes fit in ``host_memory`` when it is given, best first.

    Offload is each target of ``zero.offload.TARGETS``, in its order: ``"none"`` and ``"cpu"`` (stages 1-3), and
    with a ``host_memory`` budget (bytes of host memory this rank may use) also those that page, ``"disk"``
    (``offload.buffer_count`` buckets mapped at a time): without a host budget offload to the CPU fits wherever offload
    to disk does (the same device bytes) and is faster. Offload to the CPU offloads
    the least that fits (``offload_ratio``, :func:`least_offload`): the rest of the optimizer side steps on the
    device, concurrently with the host's part (where no offload fits, full CPU offload is listed as the
    configuration with the least device memory). Checkpointing is none, and ``config``'s policy if it has one, else
    every block of the model's ``nn.ModuleList``.
    Best means most tokens per step for the least extra work: larger micro-batches first, then
    no checkpointing (it recomputes the forward), no offload before CPU offload before disk (the targets' ``tier``:
    host transfers, then disk reads and writes, the slowest), lower stage (stage 3 moves 1.5x the data).
    ``no_sync`` and ``maybe_unused``: see :func:`estimate` (only the stages ``ZeroConfig`` runs the communication
    policy at are tried: quantized weights need stage 3, the rest stages 1-3). ``progress`` is told about each trace as
    it starts."""
    if workload.parallelize is not None:
        raise ValueError("plan() does not search tensor-parallel workloads yet (a workload with a parallelize "
                         "function); price each configuration with estimate(..., tensor_parallel=tp)")
    if gpu_memory <= 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_memory}")
    if host_memory is not None and host_memory <= 0:
        raise ValueError(f"host memory must be positive (or None: no host budget), got {host_memory}")
    base = priced_config(config, **{"stage": 3, **settings})  # (the stage is what the plan varies; 3 runs any policy)
    budget = headroom * gpu_memory
    stages = stages_for(communication_policy(base.communication, world_size)[0], STAGES)  # (shard_size divides it)
    paging = host_memory is not None and not workload.declaring(
        base.elementwise_optimizers, base.per_parameter_optimizers).assignment().several_or_whole  # (one elementwise)
    offloads = [target for target in TARGETS if paging or not target.pages]  # (the table's order: fastest first)
    checkpointings = (None, base.activation_checkpointing or ActivationCheckpointing())
    fits, rejected = [], []
    for micro in micro_batches:
        for checkpointing in checkpointings:
            if progress is not None:
                progress(f"micro-batch {micro}{' with activation checkpointing' if checkpointing else ''}")
            for target in offloads:
                for stage in [s for s in stages if s or target.on_device]:  # offload needs stage 1-3 (zero.config)
                    def priced(ratio: float = 1.0, stage: int = stage, target: OffloadTarget = target) -> Estimate:
                        return estimate(workload, base, world_size=world_size, micro_batch=micro, no_sync=no_sync,
                                        maybe_unused=maybe_unused, stage=stage, activation_checkpointing=checkpointing,
                                        offload=_candidate(base.offload, target, ratio))

                    e = priced()
                    if not target.on_device and not target.pages and not _why(e, budget, host_memory):  # (a ratio)
                        layout = workload.layout(stage, e.group_size, base.precision, base.bucket_size_mb,
                                                 units=Units.of(base))
                        least = least_offload(priced, offload_boundaries(layout), e, budget)
                        e = least if least.offload_ratio > 0 else e  # (0: the "none" candidate; full offload kept)
                    why = _why(e, budget, host_memory)
                    if why:
                        rejected.append((e, why))
                    else:
                        fits.append(e)
    fits.sort(key=lambda e: (-e.micro_batch, e.checkpointing, target_of(e.optimizer_offload).tier, e.offload_ratio,
                             e.stage))  # (less offloaded first)
    return Plan(fits, rejected)


def _candidate(base: Offload, target: OffloadTarget, ratio: float) -> dict[str, Any]:
    """The planner's offload: the optimizer's side in ``target``, ``ratio`` of it, with ``base``'s buffer count, host
    threads and disk path (the estimator's stand-in if it has none)."""
    path = (base.path or DISK_PATH) if target.needs_path else None
    return {"optimizer": target.name, "ratio": ratio, "buffer_count": base.buffer_count,
            "host_threads": base.host_threads, "path": path}


def _why(e: Estimate, budget: float, host_budget: float | None) -> str:
    """Why ``e`` does not fit (device, then host memory), or ``""``."""
    reasons = []
    if e.peak > budget:
        largest = max(e.categories, key=e.categories.get)
        reasons.append(f"needs {format_bytes(e.peak)} > {format_bytes(budget)} at {e.event} ({e.phase}); largest "
                       f"part: {largest.replace('_', ' ')} {format_bytes(e.categories[largest])}")
    if host_budget is not None and e.host > host_budget:
        held = (f"a window of {e.buffer_count} buckets of the offload file" if e.paged
                else "master weights, gradients and optimizer state")
        reasons.append(f"needs {format_bytes(e.host)} of host memory > {format_bytes(host_budget)} ({held})")
    return "; ".join(reasons)


def _parameters_named(names: Sequence[str], trained: Mapping[str, int]) -> frozenset[str]:
    """The parameters of ``trained`` (those the traced step gave a gradient) that ``names`` name, each by its own name
    or a module prefix; a name that names none is refused."""
    if isinstance(names, str):
        names = [names]
    found = set()
    for name in names:
        named = {p for p in trained if p == name or p.startswith(name.rstrip(".") + ".")}
        if not named:
            raise ValueError(f"maybe_unused names no parameter with a gradient in the traced step: {name!r} (give "
                             f"names or module prefixes as model.named_parameters() names them, e.g. "
                             f"{next(iter(trained), 'layers.0.weight')!r})")
        found |= named
    return frozenset(found)


def _precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]

