"""Replay a traced step (:mod:`zero.estimator.timeline`) with one ZeRO configuration's buffer schedule.

The trace has the model's own bytes after every operator: what autograd saves, operator temporaries
and autograd's gradients (every ``p.grad`` starting as ``None``). This module adds what
``ZeroOptimizer`` holds for one rank of ``world_size`` ranks, and when, using the buckets and units
the optimizer itself would build (``zero.runtime.buffers.partition.build_partition`` on the fake model):

* parameters: whole buckets (stages 0-2); at stage 3 the shards plus the units gathered at that point, as the
  runtime's own gathering schedule decides (``zero.runtime.gathering.gather_order``, priced by
  :mod:`zero.estimator.gathering`);
* gradients: stages 0-1 accumulate into persistent buckets (autograd's fresh gradient lives only while it
  is added); stages 2-3 keep autograd's gradients until their bucket is launched, strictly in bucket order
  at the next gradient's arrival, when they are copied into a staging buffer (``communication``) and
  dropped; at most ``max_in_flight_buckets`` reductions are outstanding, and completing one keeps its
  ``1/N`` chunk as the gradient shard;
* what quantized collectives hold besides (``communication``): their packets while in flight, and the slices they
  encode and decode through (:mod:`zero.estimator.codec_memory`);
* optimizer state, master weights and the step's own temporaries, from traced steps of the wrapped optimizers
  (``StepTrace``: the flat ones on the rank's pieces, the whole-parameter ones on the whole parameters it owns, and
  the owner step's whole tensors and exchange buffers), and after the step of every bucket;

and reports the largest total over the step with its breakdown (the tracker's categories). What offload keeps
off the device is reported beside it (:mod:`zero.estimator.offloading`): host memory and the offload file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from zero.estimator.codec_memory import CodecMemory
from zero.estimator.gathering import gathering as replay_gathering
from zero.estimator.offloading import OffBytes, OffloadChoice, window
from zero.estimator.optimizers import Ownership
from zero.estimator.timeline import Point, Timeline
from zero.estimator.traffic import Wire
from zero.runtime.reduction.reduction_order import ReductionOrder


@dataclass(frozen=True)
class BucketBytes:
    """One bucket as the priced rank of the configuration holds it (bytes)."""

    params: tuple[str, ...]  # trainable parameters (none for a frozen bucket)
    whole: int  # the padded bucket in the parameters' dtype
    shard: int  # this rank's chunk in the parameters' dtype (= whole with one shard)
    staging: int  # the padded bucket in the reduce dtype (stages 2-3 and staged mixed precision)
    grad_shard: int  # this rank's chunk in the reduce dtype
    master: int  # this rank's chunk of the fp32 master weights when they are separate (else 0)
    master_grad: int  # the optimizer's gradient chunk when the reduce dtype is not the master's (else 0)
    elements: int  # this rank's chunk in elements: what the wrapped optimizer steps
    pieces: tuple[int, ...]  # the parameters' pieces in that chunk (elements), as the optimizer sees them
    unit: str | None  # stage 3: the unit that gathers it
    secondary: int = 0  # hpZ's secondary copy of it (P / shard_size in the parameters' dtype, on the device)
    host: int = 0  # its buffers the plan puts in host memory (offload to the CPU)
    disk: int = 0  # the offload file's bytes for it: its buffers there and its optimizer state (page-rounded)
    wire: Wire | None = None  # what its collectives move (zero.estimator.traffic)
    offloaded: bool = False  # its optimizer side (master, state, the step) is off the device
    shard_off_device: bool = False  # stage 3: its parameter shard is off the device
    piece_params: tuple[str, ...] = ()  # the parameter of each of ``pieces``


@dataclass(frozen=True)
class Layout:
    """What one rank of one configuration holds, before any step (see :meth:`zero.estimator.Workload.layout`)."""

    stage: int
    buckets: tuple[BucketBytes, ...]
    frozen: int  # frozen parameters kept whole outside buckets (stages 0-2)
    buffers: int  # the model's buffers
    staged: bool  # reductions copy into a staging buffer (stages 2-3; stages 0-1 under some precisions)
    grad_buffer: int  # stages 0-1: the persistent gradient buckets
    units: tuple[str, ...] = ()  # stage 3, root first
    disk: int = 0  # offload to disk: the offload file (zero.runtime.offload.disk.planned_disk_bytes)
    disk_state: int = 0  # ... of which bytes per element of optimizer state (the rest of the state stays in memory)
    slots: int = 0  # trainable parameters (a flag each in the end of backward's agreement)
    owners: Ownership = Ownership(0)  # the rank priced (its shard) and the whole parameters it owns


@dataclass(frozen=True)
class StepTrace:
    """The wrapped optimizers' part of the priced rank's step (``zero.estimator.Workload.step``)."""

    state_by_bucket: dict[tuple[str, ...], float]  # bucket (its parameters) -> the optimizer state kept for it (bytes)
    adopt: float  # bytes: the largest temporaries while one bucket's masters adopt edits (mixed precision)
    update: float  # bytes: the largest temporaries while the flat optimizers step one bucket (steady state)
    whole: float = 0.0  # bytes on the device while the owners step the whole parameters (tensors, exchange)

    def state(self, buckets: Iterable[BucketBytes]) -> float:
        """The optimizer state kept for ``buckets``: their flat pieces' and their whole parameters owned here."""
        return sum(self.state_by_bucket.get(b.params, 0.0) for b in buckets)


@dataclass(frozen=True)
class Options:
    """The ``ZeroConfig`` settings the schedule depends on besides the layout."""

    offload: OffloadChoice = OffloadChoice()  # where the optimizer's side and stage 3's shards live
    max_in_flight: int = 2
    prefetch: int = 1
    reshard_after_forward: bool = True  # stage 3: units released after their forward, gathered again for backward
    no_sync: bool = False  # micro-batches accumulated under no_sync() before this one (the Trainer's way)
    codec: CodecMemory = CodecMemory()  # what the communication policy's collectives hold besides
    # a pipeline part (zero.estimator.pipeline): the timeline is the step's micro-batches, each point's gradients what
    # p.grad holds (accumulated whole), reduced once at REDUCE; the stage's receive buffers; what it holds in step()
    pipelined: bool = False
    pipeline_buffers: float = 0.0
    step_held: float = 0.0
    reshard_after_backward: bool = True  # stage 3: False keeps the units backward reaches gathered until the step


REDUCE = "<reduce gradients>"  # a pipeline schedule's one reduction after its last backward


@dataclass
class Peak:
    """The largest total of the replayed step and where it happened."""

    categories: dict[str, float]
    phase: str
    module: str
    event: str
    off: OffBytes = OffBytes(0.0, 0.0)  # host memory and disk
    gathers: dict[str, int] = field(default_factory=dict)  # stage 3: how many times the step gathers each unit
    regathers: dict[str, int] = field(default_factory=dict)  # ... of which in backward while its copy is current

    @property
    def total(self) -> float:
        return sum(self.categories.values())


CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication", "temporaries", "other")


@dataclass
class _Reduction:
    """Stages 2-3 and staged reductions: autograd's gradients, buckets launched, shards kept. Unstaged (stages 0-1
    reducing their persistent buckets) only what a quantizing codec holds while the buckets are reduced."""

    layout: Layout
    options: Options
    grad_bytes: dict[str, int]
    arrived: set[str] = field(default_factory=set)
    released: int = 0  # bytes of autograd gradients copied into staging and dropped
    shards: int = 0  # gradient shards kept on the device
    packets: dict[int, int] = field(default_factory=dict)  # id(bucket) -> what its codec holds while it is in flight
    across: set[int] = field(default_factory=set)  # id(bucket): HSDP's sum across the groups started (advanced)
    transient: int = 0  # a reduction encoding or decoding: the slice it works through
    # the reducer's own order (zero.runtime.reduction.reduction_order)
    order: ReductionOrder[BucketBytes] = field(init=False)

    def __post_init__(self) -> None:
        self.order = ReductionOrder([b for b in self.layout.buckets if b.params], self.options.max_in_flight)

    @property
    def held(self) -> int:
        """The staging buffers of the reductions in flight, and what their codec holds."""
        staging = sum(b.staging for b, _ in self.order.in_flight) if self.layout.staged else 0
        return staging + sum(self.packets.values()) + self.transient

    def _at(self, transient: int, on_peak: Callable[[], None]) -> None:
        self.transient = transient
        on_peak()
        self.transient = 0

    def arrive(self, name: str) -> None:
        self.arrived.add(name)

    def launch_ready(self, on_peak: Callable[[], None]) -> None:
        """Launch every complete bucket in order; ``on_peak()`` is called at each transient moment."""
        for bucket in self.order.ready(lambda b: all(p in self.arrived for p in b.params)):
            self._launch(bucket, on_peak)

    def end(self, on_peak: Callable[[], None]) -> None:
        """The end of backward: launch what is left (gradients that never came count as zeros), complete all."""
        for bucket in self.order.rest():
            self._launch(bucket, on_peak)
        while self.order.in_flight:
            self._complete(on_peak)

    def _launch(self, bucket: BucketBytes, on_peak: Callable[[], None]) -> None:
        if self.order.full:
            self._complete(on_peak)
        for launched, _ in self.order.in_flight:  # (hierarchical sharding: their sums across the groups start)
            self._advance(launched, on_peak)
        self.order.launched(bucket)
        on_peak()  # staging allocated and filled while the bucket's gradients still exist
        if self.layout.stage >= 2:
            self.released += sum(self.grad_bytes.get(p, 0) for p in bucket.params)
        packets = self.options.codec.reducing(bucket.wire)
        if packets:  # quantized: the packets to send, encoded through a slice, then those received too
            self.packets[id(bucket)], slice_ = self.options.codec.sending(bucket.wire)
            self._at(slice_, on_peak)
            self.packets[id(bucket)] = packets

    def _advance(self, bucket: BucketBytes, on_peak: Callable[[], None]) -> None:
        """HSDP: the reduction inside the group is waited for (decoded while its packets are held, which go with
        the wait) and the sum across the groups starts (``zero.comm.handles.Chain.advance``)."""
        if self.options.codec.replicas == 1 or id(bucket) in self.across:  # (flat: nothing to advance)
            return
        if id(bucket) in self.packets:  # (decoded while its packets are held; they go with the wait)
            self._at(self.options.codec.reduce_decode(bucket.wire), on_peak)
            del self.packets[id(bucket)]
        encoding, slice_, held, _ = self.options.codec.across(bucket.wire)
        if held:
            self.packets[id(bucket)] = encoding
            self._at(slice_, on_peak)
            self.packets[id(bucket)] = held
            self.across.add(id(bucket))

    def _complete(self, on_peak: Callable[[], None]) -> None:
        bucket, _ = self.order.oldest()
        self._advance(bucket, on_peak)
        if id(bucket) in self.across:  # the sum across the groups waited for
            self._at(self.options.codec.across(bucket.wire)[3], on_peak)
            self.across.discard(id(bucket))
        elif id(bucket) in self.packets:  # decoded while its packets are held; they go with the wait
            self._at(self.options.codec.reduce_decode(bucket.wire), on_peak)
        self.packets.pop(id(bucket), None)
        if self.layout.staged and not bucket.offloaded:
            self.shards += bucket.grad_shard
            on_peak()  # the chunk is kept (a new shard) before the staging buffer goes
        self.order.completed()


def replay(timeline: Timeline, layout: Layout, step: StepTrace, options: Options) -> Peak:
    """The peak of one training step (steady state: the optimizer state exists) of ``layout``'s configuration."""
    buckets = [b for b in layout.buckets if b.params]
    here = [b for b in buckets if not b.offloaded]  # the buckets whose optimizer side (state included) is on the device
    master = sum(b.master for b in here)
    state = step.state(here)
    off = _off_device(layout, step, options.offload)
    params_static = (sum(b.shard for b in layout.buckets if not b.shard_off_device) if layout.stage == 3
                     else sum(b.whole for b in layout.buckets))
    params_static += layout.frozen + sum(b.secondary for b in layout.buckets)  # (hpZ's copies: always on the device)
    base = {"parameters": params_static, "optimizer_state": master + state, "other": layout.buffers}
    reduction = _Reduction(layout, options, timeline.grad_bytes) if layout.staged or options.codec.gradients else None
    gathering = (replay_gathering(timeline, layout.buckets, options.prefetch, options.codec,
                                  options.reshard_after_forward, options.reshard_after_backward)
                 if layout.stage == 3 else None)
    best = Peak(dict.fromkeys(CATEGORIES, 0.0), "idle", "", "start", off)

    def offer(categories: dict[str, float], phase: str, module: str, event: str) -> None:
        nonlocal best
        if sum(categories.values()) > best.total:
            best = Peak({c: float(categories.get(c, 0)) for c in CATEGORIES}, phase, module, event, off)

    def consider(point: Point, *, gradients: float, event: str | None = None) -> None:
        communication = (reduction.held if reduction is not None else 0) + options.pipeline_buffers + (
            gathering.in_flight + gathering.transient if gathering is not None else 0)
        parameters = base["parameters"] + (gathering.bytes if gathering is not None else 0)
        offer(dict(base, parameters=parameters, activations=point.activations, temporaries=point.temporaries,
                   gradients=gradients, communication=communication),
              point.phase, point.module, event or _describe(point))

    accumulated = sum(timeline.grad_bytes.values())  # under no_sync(): whole in p.grad when this pass starts
    # ... and, when the reduce dtype is wider (bf16 parameters, fp32 reduction), also in an accumulator of that dtype
    wide = _widening(layout) if options.no_sync or options.pipelined else 0.0

    def grads_now(point: Point) -> float:
        fresh = timeline.grad_bytes.get(point.name, 0) if point.kind == "grad" else 0  # while it is added in
        if not layout.staged:  # persistent buckets
            return layout.grad_buffer + fresh
        pending = accumulated - reduction.released  # accumulated gradients of buckets not launched yet
        if options.pipelined:  # (what p.grad holds, its fresh gradient included, less the buckets launched)
            held = point.gradients - reduction.released
            local = held * (1 + wide) if layout.stage >= 2 else layout.grad_buffer + held * wide
        elif layout.stage < 2:
            local = layout.grad_buffer + pending * wide
        elif options.no_sync:
            local = pending * (1 + wide) + fresh
        else:
            local = point.gradients - reduction.released
        return local + reduction.shards

    previous = None
    for point in timeline.points:
        if gathering is not None:
            gathering.event(point, lambda: consider(point, gradients=grads_now(point), event="parameter gather"))
        if reduction is not None and point.kind == "grad" and not options.pipelined:
            before = previous or point
            reduction.launch_ready(lambda: consider(before, gradients=grads_now(before), event="gradient reduction"))
            reduction.arrive(point.name)
        if point.name == (REDUCE if options.pipelined else "<end of backward>") and reduction is not None:
            reduction.end(lambda: consider(point, gradients=grads_now(point), event="gradient reduction"))
        if point.name == "<end of backward>" and gathering is not None:
            gathering.end_backward(lambda: consider(point, gradients=grads_now(point), event="parameter gather"))
        consider(point, gradients=grads_now(point))
        previous = point

    # the step: the gathered units are released; the optimizer's gradients are made for every bucket, then each
    # bucket in turn adopts edits into its masters (mixed precision) and steps
    if gathering is not None:
        gathering.release_all()
    grads = layout.grad_buffer + (reduction.shards if reduction is not None else 0)
    master_grads = sum(b.master_grad for b in here)
    on_device = 1.0 if here else 0.0  # an offloaded step runs on the host
    for temporaries in (step.adopt * on_device, step.whole, step.update * on_device):  # (in this order)
        offer(dict(base, gradients=grads + master_grads, temporaries=temporaries + options.step_held,
                   communication=options.pipeline_buffers), "step", "<optimizer>", "optimizer step")
    if gathering is not None:
        best.gathers, best.regathers = dict(gathering.gathers), dict(gathering.regathers)
    return best


def _off_device(layout: Layout, step: StepTrace, offload: OffloadChoice) -> OffBytes:
    """Host memory and disk: the buffers the plans put there, and the optimizer's state with its side. On disk the
    file holds the state tensors shaped like the parameters (``layout.disk_state`` bytes per element); what else the
    optimizer keeps (Adam's step counts) stays in memory, beside the window of buckets mapped from the file."""
    resident = float(sum(b.host for b in layout.buckets))
    if not offload.offloaded:
        return OffBytes(resident, 0.0)
    if offload.delayed:  # the fp32 gradients handed to the background step (zero.runtime.step.delayed)
        resident += 4.0 * sum(b.elements for b in layout.buckets if b.offloaded)
    state = step.state(b for b in layout.buckets if b.offloaded)
    if not offload.pages:
        return OffBytes(resident + state, 0.0)
    loose = state - layout.disk_state * sum(sum(b.pieces) for b in layout.buckets)
    return OffBytes(resident + loose + window([b.disk for b in layout.buckets], offload.buffer_count), layout.disk)


def _widening(layout: Layout) -> float:
    """Bytes of the reduce-dtype accumulator per byte of gradient under ``no_sync()``: its itemsize over the
    parameters' when the reduce dtype is wider (``zero.runtime.reduction.reducer._widen``), else 0."""
    trainable = [b for b in layout.buckets if b.params]
    ratio = sum(b.staging for b in trainable) / max(1, sum(b.whole for b in trainable)) if layout.staged else 0.0
    return ratio if ratio > 1 else 0.0


def _describe(point: Point) -> str:
    if point.kind == "op":
        return f"{point.name} operator"
    if point.kind == "grad":
        return f"gradient of {point.name}"
    if point.kind == "reach":
        return f"backward reaches {point.name or '<root>'}"
    return f"forward of {point.name or '<root>'} {'starts' if point.kind == 'enter' else 'ends'}"
