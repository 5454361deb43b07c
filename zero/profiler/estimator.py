"""Pre-flight memory estimates: per-rank bytes for a model at any stage, world size and batch.

Nothing is allocated: the model is built and run once under ``FakeTensorMode`` (tensors
with shapes, dtypes and a device but no data, and the same kernel choices as the real
device's), which gives the exact parameter count, the sizes of stage 3's units and the
bytes autograd saves for backward. The ZeRO formulas take over where tracing cannot reach
(sharding, optimizer state, precision, offload).

A training step peaks at the start of backward, when every saved activation is still alive:

* model states: parameters, gradients, optimizer state (incl. fp32 master weights), as
  sharded by the stage; stages 0-1 keep gradient buckets allocated, stages 2-3 release
  them at ``zero_grad()``, so none exist yet when backward starts;
* activations: saved-for-backward bytes of one micro-batch (with activation
  checkpointing: the checkpointed units' inputs instead of their activations, or, if larger, what is
  alive while one of them is recomputed in backward: ``zero.activations.saved_activation_bytes``);
* gathered parameters (stage 3): the root unit, the last unit and the prefetched one;
* the output gradient: backward's first buffers, the gradients of the loss with respect to the
  model's output and to the softmax inside the loss, alive together (twice the output's bytes);

or, at stages 2-3 with small activations, when a bucket's (stage 3: a unit's) gradients are
complete: autograd's gradients and the staging buffer of the reduce-scatter, both whole.
Buffers that collectives allocate for themselves are left out: NCCL's are outside PyTorch's
allocator, and gloo (CPU ranks) copies through buffers as large as the bucket or unit it moves,
which it frees at times that vary from run to run (sometimes only well after the collective).
The tracker reports them as ``communication/collective internals``.

Checked against the tracker's measured peaks (``zero.profile``, without those buffers) for a
GPT at every stage, world sizes 1-3 and two micro-batches (``tests/distributed``); the
model-state column is the ZeRO paper's and is tested against it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero.activations import MATMULS, saved_activation_bytes
from zero.outputs import tensors_in
from zero.precision import DTYPES, MixedPrecision
from zero.units import plan_units

GiB = 2**30
STAGES = (0, 1, 2, 3)


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


PRECISIONS = {
    "fp32": Precision.of(MixedPrecision(), "fp32"),
    # the ZeRO paper's mixed precision (K = 12): bf16 parameters, gradients and reduction
    "mixed": Precision.of(MixedPrecision(param_dtype="bf16", reduce_dtype="bf16"), "mixed"),
    # MixedPrecision(param_dtype="bf16")'s default: the reduced gradient kept in fp32
    "mixed-fp32-reduce": Precision.of(MixedPrecision(param_dtype="bf16"), "mixed-fp32-reduce"),
}


@dataclass(frozen=True)
class ModelStates:
    parameters: float
    gradients: float
    optimizer_state: float  # master weights included

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def model_states(numel: int, world_size: int, stage: int, precision: str | Precision = "fp32") -> ModelStates:
    """Per-rank model-state bytes after a step (Ψ = ``numel``, N = ``world_size``): the ZeRO paper's
    formulas when the reduced gradient has the gradients' dtype ("fp32", "mixed"); with a wider reduced
    gradient ("mixed-fp32-reduce") stages 0-1 keep it beside their gradient buffer and stages 2-3
    shard it at its own width."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    prec = precision if isinstance(precision, Precision) else _precision(precision)
    n = world_size
    p, g, k = prec.param * numel, prec.grad * numel, (prec.master + prec.optimizer) * numel
    shard = 1 if stage == 0 else n
    kept = g + (0 if prec.reduced == prec.grad else prec.reduced * numel / shard)  # stages 0-1
    sharded = {0: (p, kept, k), 1: (p, kept, k / n), 2: (p, prec.reduced * numel / n, k / n)}
    sharded[3] = (p / n, prec.reduced * numel / n, k / n)
    return ModelStates(*map(float, sharded[stage]))


@dataclass(frozen=True)
class Trace:
    """What one fake forward found (for one micro-batch)."""

    numel: int
    unit_numels: dict[str, int]  # stage 3's default units ("" is the root unit)
    activation_bytes: int  # saved for backward, parameters excluded
    unit_activation_bytes: dict[str, int]  # saved while each unit's forward ran (outermost first)
    unit_input_bytes: dict[str, int]  # what activation checkpointing keeps per unit
    output_bytes: int  # the forward's output (its gradient is backward's first buffer)
    unit_matmul_bytes: dict[str, int] = field(default_factory=dict)  # matmul outputs per unit (selective checkpointing)


def trace(build_fn: Callable[[], nn.Module], loss_fn: Callable[..., torch.Tensor], batch: tuple) -> Trace:
    """Build the model and run ``loss_fn(model, *batch)`` on fake tensors (no memory is used).

    ``batch`` holds real tensors or shapes' worth of example inputs; they are faked too.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            model = build_fn()
            fake_batch = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in batch)
            return _trace_fake(model, loss_fn, fake_batch)
    except Exception as err:  # a model or loss that cannot run without data
        raise ValueError(
            f"could not trace the model on fake tensors ({type(err).__name__}: {err}). Estimation runs the "
            "forward without data: data-dependent control flow (e.g. .item(), .tolist(), nonzero()) is not "
            "supported; pass a loss_fn whose forward depends only on shapes."
        ) from err


def _trace_fake(model: nn.Module, loss_fn, batch: tuple) -> Trace:
    params = list(model.parameters())
    param_storages = {p.untyped_storage()._cdata for p in params}
    units = plan_units(model, [p for p in params if p.requires_grad], unit_classes=None, unit_size_bytes=None)
    saved: dict[int, int] = {}
    per_unit: dict[str, int] = {u.name: 0 for u in units}
    inputs: dict[str, int] = {u.name: 0 for u in units}
    stack = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            per_unit[stack[-1]] += saved[key]
        return t

    matmuls: dict[str, int] = {u.name: 0 for u in units}
    outputs: list[int] = []
    hooks = [model.register_forward_hook(_record_output(outputs))]
    for unit in units:
        if unit.name:
            hooks.append(unit.module.register_forward_pre_hook(_enter(stack, inputs, unit.name)))
            hooks.append(unit.module.register_forward_hook(_leave(stack)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _MatmulOutputs(stack, matmuls):
            loss = loss_fn(model, *batch)
    finally:
        for hook in hooks:
            hook.remove()
    if loss.grad_fn is None:
        raise ValueError("loss_fn returned a tensor with no gradient: nothing to train")
    return Trace(
        numel=sum(p.numel() for p in params if p.requires_grad),
        unit_numels={u.name: sum(p.numel() for p in u.params) for u in units},
        activation_bytes=sum(saved.values()),
        unit_activation_bytes=per_unit,
        unit_input_bytes=inputs,
        output_bytes=max(outputs, default=0),
        unit_matmul_bytes=matmuls,
    )


class _MatmulOutputs(TorchDispatchMode):
    """Adds the bytes of each matmul's output to the unit running it (what selective checkpointing saves)."""

    def __init__(self, stack: list[str], totals: dict[str, int]):
        super().__init__()
        self.stack, self.totals = stack, totals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS and self.stack[-1] in self.totals:
            tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            self.totals[self.stack[-1]] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _enter(stack: list[str], inputs: dict[str, int], name: str):
    def enter(module: nn.Module, args: Any) -> None:
        stack.append(name)
        inputs[name] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    return enter


def _leave(stack: list[str]):
    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    return leave


def _record_output(outputs: list[int]):
    """Bytes of the model's forward output (e.g. the logits): backward's first buffer is its gradient."""

    def record(module: nn.Module, args: Any, output: Any) -> None:
        tensors = tensors_in(output) or []
        outputs.append(sum(t.numel() * t.element_size() for t in tensors if t.requires_grad))

    return record


@dataclass(frozen=True)
class Estimate:
    """Per-rank peak bytes of one training step, by category (device), plus host memory."""

    stage: int
    world_size: int
    micro_batch: int
    precision: str
    offload: bool
    checkpointing: bool
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    gathered_parameters: float
    output_gradient: float
    host: float  # CPU memory for offloaded optimizer state
    moment: str  # when the peak happens: "start of backward" or "gradient reduction"
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return (
            self.parameters + self.gradients + self.optimizer_state + self.activations
            + self.gathered_parameters + self.output_gradient
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak}


def estimate(
    traced: Trace,
    *,
    stage: int,
    world_size: int,
    micro_batch: int,
    traced_micro_batch: int,
    precision: str = "fp32",
    offload: bool = False,
    checkpointing: bool | Sequence[str] = False,
    selective: bool = False,
    bucket_size_mb: float = 25,
) -> Estimate:
    """Per-rank peak of a training step for one configuration (see the module docstring).

    Activations scale linearly from the traced micro-batch (``traced_micro_batch``) to ``micro_batch``.
    ``checkpointing``: ``True`` for every unit (block), or the names of the blocks checkpointed (a policy's
    ``zero.activations.chosen_blocks``), priced by ``zero.activations.saved_activation_bytes`` (``selective``:
    they also keep their matmul outputs).
    """
    if micro_batch < 1 or traced_micro_batch < 1:
        raise ValueError("micro-batch sizes must be >= 1")
    prec = _precision(precision)
    states = model_states(traced.numel, world_size, stage, precision)
    scale = micro_batch / traced_micro_batch
    act_scale = prec.param / 4  # traced in fp32; mixed precision keeps half-size activations
    if checkpointing is True:
        checkpointing = [n for n in traced.unit_activation_bytes if n]
    activations = saved_activation_bytes(traced, list(checkpointing or ()), selective) * scale * act_scale
    gradients = prec.grad * traced.numel if stage < 2 else 0.0  # stages 2-3 (and reduced shards): freed at zero_grad()
    gathered, blocks = 0.0, sorted((n for k, n in traced.unit_numels.items() if k), reverse=True)
    if stage == 3:
        gathered = (traced.unit_numels.get("", 0) + sum(blocks[:2])) * prec.param
    optimizer_state, host, notes = states.optimizer_state, 0.0, []
    if offload and stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3: stage 0 keeps the whole optimizer state on every rank")
    if offload:  # zero.offload: fp32 master, the optimizer state and the reduced gradient shard, per chunk
        host = (max(prec.master, 4) + prec.optimizer + prec.reduced) * traced.numel / world_size
        optimizer_state = 0.0
    common = dict(
        stage=stage, world_size=world_size, micro_batch=micro_batch, precision=precision, offload=offload,
        checkpointing=bool(checkpointing), parameters=states.parameters, optimizer_state=optimizer_state, host=host,
        notes=notes,
    )
    start = Estimate(
        **common, moment="start of backward", gradients=gradients, activations=activations,
        gathered_parameters=gathered, output_gradient=2 * traced.output_bytes * scale * act_scale,
    )
    if stage < 2:
        return start
    # Stages 2-3 also peak where a bucket's gradients are complete: autograd's gradients and the
    # staging buffer they are copied into for the reduce-scatter, both whole (activations mostly freed).
    bucket = min(traced.numel, int(bucket_size_mb * 2**20) // prec.param) if stage == 2 else max(blocks, default=0)
    reduction = Estimate(
        **common, moment="gradient reduction", gradients=2 * prec.grad * bucket, activations=0.0,
        gathered_parameters=(traced.unit_numels.get("", 0) + bucket) * prec.param if stage == 3 else 0.0,
        output_gradient=0.0,
    )
    return max(start, reduction, key=lambda e: e.peak)


@dataclass(frozen=True)
class Plan:
    fits: list[Estimate]  # best first
    rejected: list[tuple[Estimate, str]]  # with the reason


def plan(
    traced: Trace,
    *,
    gpu_memory: float,
    world_size: int,
    micro_batches: list[int],
    traced_micro_batch: int,
    precision: str = "fp32",
    headroom: float = 0.9,
) -> Plan:
    """Every stage × offload × checkpointing × micro-batch; those whose peak fits in
    ``headroom * gpu_memory`` (the rest is left to the allocator and the CUDA context), best first.

    Best means most tokens per step for the least extra work: larger micro-batches first, then
    no checkpointing (it recomputes the forward), no offload (host transfers), lower stage
    (stage 3 moves 1.5x the data)."""
    if gpu_memory <= 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_memory}")
    budget = headroom * gpu_memory
    fits, rejected = [], []
    for micro in micro_batches:
        for checkpointing in (False, True):
            for offload in (False, True):
                for stage in STAGES[1:] if offload else STAGES:  # offload needs stage 1-3 (zero.offload)
                    e = estimate(
                        traced, stage=stage, world_size=world_size, micro_batch=micro,
                        traced_micro_batch=traced_micro_batch, precision=precision, offload=offload,
                        checkpointing=checkpointing,
                    )
                    if e.peak <= budget:
                        fits.append(e)
                    else:
                        rejected.append((e, _why(e, budget)))
    fits.sort(key=lambda e: (-e.micro_batch, e.checkpointing, e.offload, e.stage))
    return Plan(fits, rejected)


def _why(e: Estimate, budget: float) -> str:
    parts = {
        "model states": e.parameters + e.gradients + e.optimizer_state,
        "activations": e.activations,
        "gathered parameters": e.gathered_parameters,
        "output gradient": e.output_gradient,
    }
    largest = max(parts, key=parts.get)
    return f"needs {e.peak / GiB:.2f} GiB > {budget / GiB:.2f} GiB; largest part: {largest} {parts[largest] / GiB:.2f} GiB"


def _precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def parse_size(text: str) -> float:
    """``"24GiB"``, ``"80GB"``, ``"512MiB"`` or a number of bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "b": 1}
    lowered = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if lowered.endswith(suffix):
            number = lowered[: -len(suffix)].strip()
            break
    else:
        suffix, number = "b", lowered
    try:
        value = float(number) * units[suffix]
    except ValueError:
        raise ValueError(f"not a memory size: {text!r} (examples: 24GiB, 80GB, 512MiB)") from None
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value
