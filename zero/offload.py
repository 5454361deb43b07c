"""Offload: the policy (``ZeroConfig.offload``) and its table of targets, the places the optimizer's side and stage 3's
parameter shards can live.

With ``optimizer="cpu"`` (stages 1-3) the optimizer's side of each bucket (the fp32 master shard, the optimizer's
gradients and the wrapped optimizer's state) lives in host memory and steps there; with ``params="cpu"`` (stage 3)
each rank's parameter shards live there too, copied up for each unit's all-gather (it takes the optimizer's side
along). ``ratio`` below 1 offloads only that share of the buckets, whole (ZeRO-Offload++'s Twin-Flow); ``"disk"``
(ZeRO-Infinity) keeps the same buffers, and the wrapped optimizer's per-element state, in a file per rank under
``path``, of which ``buffer_count`` buckets are mapped in host memory at a time. The arithmetic is unchanged: the
same optimizer steps the same fp32 values, so offload changes no number (tested bit for bit at 1, 2 and 3 ranks).

**Targets.** What ``optimizer`` and ``params`` may name is :data:`TARGETS`, one :class:`OffloadTarget` per place
(where its bytes live, whether it pages through host memory, what it needs, the planner's order, DeepSpeed's name for
it), or a target of your own by import path (``"module:NAME"``, an ``OffloadTarget``). The policy's rules, the
runtime's placements and paging, the estimator's pricing and planner, and the DeepSpeed reader all read the table;
a new target is an entry and the ``Placement`` subclass it names (docs/offload.md, "Offload targets").

This module holds the policy. Where it runs: :mod:`zero.runtime.offload` (each target's placement, paging through
host memory, the host-memory check before allocating: ``zero.runtime.offload.targets`` and ``host``), the placements
themselves in :mod:`zero.runtime.buffers.placement` (device and host memory) and :mod:`zero.runtime.offload.disk`,
the host step's threads and kernel in :mod:`zero.runtime.step.host_threads`. It imports nothing of ``zero``: a
target names its placement class by import path, which the runtime imports.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator


class Where(Enum):
    """Where a planned buffer lives (what the estimator prices apart: device memory, host memory, files)."""

    DEVICE = "device"
    HOST = "host"
    PINNED_HOST = "pinned host"
    DISK = "disk"

    @property
    def on_host(self) -> bool:
        return self is not Where.DEVICE

    @property
    def suffix(self) -> str:
        """How the profiler's labels name buffers kept here: ``""``, ``" (host)"`` or ``" (disk)"``."""
        return {Where.DEVICE: "", Where.DISK: " (disk)"}.get(self, " (host)")


@dataclass(frozen=True)
class OffloadTarget:
    """One place ``offload.optimizer`` and ``offload.params`` can name (an entry of :data:`TARGETS`, or one of your
    own, named by import path). The runtime builds ``placement`` (``Class.make(offload, device, rank, world_size)``)
    for each side that names the target; the estimator prices the buffers by ``where`` (device memory, host memory,
    or, for a target that pages, a file of which a window of buckets is in host memory)."""

    name: str  # how messages and ``zero estimate`` call it (a built-in's is what offload.optimizer says)
    where: Where  # where its bytes live (a target that pages keeps them in a file: Where.DISK)
    placement: str  # "module:Class": the zero.runtime.buffers.placement.Placement subclass that holds them
    tier: int  # the planner's order, fastest first: 0 the device, 1 host memory, 2 a disk
    pages: bool = False  # mapped through host memory ``offload.buffer_count`` buckets at a time (one optimizer's state)
    needs_path: bool = False  # offload.path: the directory that holds its files
    deepspeed: str | None = None  # DeepSpeed's offload_optimizer/offload_param ``device`` for it

    @property
    def on_device(self) -> bool:
        return self.where is Where.DEVICE


TARGETS = (  # fastest first: the planner's order
    OffloadTarget("none", Where.DEVICE, "zero.runtime.buffers.placement:DevicePlacement", tier=0, deepspeed="none"),
    OffloadTarget("cpu", Where.HOST, "zero.runtime.buffers.placement:HostPlacement", tier=1, deepspeed="cpu"),
    OffloadTarget("disk", Where.DISK, "zero.runtime.offload.disk:DiskPlacement", tier=2, pages=True, needs_path=True,
                  deepspeed="nvme"),
)


def imported(path: str, what: str) -> Any:
    """The object ``path`` (``"module:NAME"``) names, imported; a ``ValueError`` naming ``what`` and the cause."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{what}={path!r} is not an import path: give 'module:NAME'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # (the module's own error, whatever it is, is the cause)
        raise ValueError(f"{what}={path!r}: module {module_name!r} does not import ({type(err).__name__}: {err}); "
                         "check its name, and that it is installed or on PYTHONPATH") from err
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part, None)
    if found is None:
        raise ValueError(f"{what}={path!r}: module {module_name!r} has no {name!r}; check the name")
    return found


def target_of(name: Any, setting: str = "offload.optimizer") -> OffloadTarget:
    """The :class:`OffloadTarget` a value of ``offload.optimizer`` or ``offload.params`` (``setting``) names: a
    built-in's name, or the import path of a target of your own; a ``ValueError`` naming the choices otherwise."""
    for target in TARGETS:
        if target.name == name:
            return target
    choices = ", ".join(repr(t.name) for t in TARGETS[:-1]) + f" or {TARGETS[-1].name!r}"
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{setting}={name!r} should be {choices}, or an offload target of your own by import path "
                         "('module:NAME', a zero.offload.OffloadTarget)")
    found = imported(name, setting)
    if not isinstance(found, OffloadTarget):
        raise ValueError(f"{setting}={name!r} names {found!r}, not a zero.offload.OffloadTarget (an entry like those "
                         "of zero.offload.TARGETS: docs/offload.md, 'Offload targets')")
    return found


class Offload(BaseModel):
    """The offload policy of :class:`zero.ZeroConfig` (``offload=``): ``{"optimizer": "cpu"}`` keeps the
    fp32 master shard, the optimizer's gradients and its state in host memory and steps there (stages
    1-3); ``{"params": "cpu"}`` also keeps stage 3's parameter shards there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: str = Field(
        "none",
        description="'cpu': master weights, optimizer gradients and state in host memory; step on the host. "
        "'disk': the same in a file per rank under `path`, stepped bucket by bucket on the host. Or a target of "
        "your own by import path ('module:NAME', a zero.offload.OffloadTarget).",
    )
    params: str = Field(
        "none",
        description="'cpu' (stage 3): parameter shards in host memory, copied up for each gather. 'disk': in the "
        "file under `path` (the optimizer side goes to disk too), read ahead of each gather. Or a target of your "
        "own by import path.",
    )
    path: str | None = Field(
        None, description="With 'disk': the directory (on local NVMe) that holds each rank's offload file."
    )
    buffer_count: int = Field(
        2, ge=1, le=64, strict=True,
        description="With 'disk': how many buckets' files are mapped in host memory at a time (the one stepping, "
        "the ones read ahead).",
    )

    ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        1.0,
        description="With 'cpu': the fraction of each rank's optimizer side (and, with params='cpu', of its "
        "parameter shards) that lives in host memory, in whole buckets: the first buckets to be reduced in "
        "backward go to the host, the rest stay on the device and step there with the device kernel while the "
        "host steps its part (DeepSpeed's offload_optimizer.ratio, ZeRO-Offload++'s Twin-Flow). 1: everything "
        "offloaded; 0: nothing; 'auto': the least that fits the device, chosen by the estimator when ZeroOptimizer "
        "is built (it needs example=zero.StepExample(...); zero.auto_ratio).",
    )
    gpu_memory: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="With ratio='auto': the bytes of device memory this rank may use (default: measured on CUDA when "
        "the optimizer is built: free plus what torch's allocator holds); the ratio's peak fits 0.9 of it.",
    )
    host_threads: StrictInt | Literal["auto"] = Field(
        "auto",
        description="Threads of the host step (an int >= 1), or 'auto': the cores this process may run on (its CPU "
        "affinity, not os.cpu_count()), shared among the ranks on this machine when they all may run on every "
        "core (torchrun's LOCAL_WORLD_SIZE, else the world size). torchrun sets OMP_NUM_THREADS=1, which would "
        "leave the memory-bound host step on one core.",
    )
    delayed_step: bool = Field(
        False,
        strict=True,
        description="Step the host masters in a background thread during the next forward and backward "
        "(ZeRO-Offload's one-step delayed update): faster, but not equal to synchronous training "
        "(zero.runtime.step.delayed).",
    )

    @field_validator("optimizer", "params", mode="before")
    @classmethod
    def _a_target(cls, name: Any, info: Any) -> Any:
        target_of(name, f"offload.{info.field_name}")  # (a name of TARGETS, or an import path that names a target)
        return name

    @model_validator(mode="after")
    def _threads_positive(self) -> "Offload":
        if self.host_threads != "auto" and self.host_threads < 1:
            raise ValueError(f"offload.host_threads must be 'auto' or a whole number >= 1, got {self.host_threads!r}")
        return self

    @model_validator(mode="after")
    def _delay_needs_offload(self) -> "Offload":
        if self.delayed_step and not self.optimizer_on_host:
            raise ValueError(
                "offload.delayed_step=True hides the host step behind the next forward, so it needs the optimizer "
                "offloaded: set offload.optimizer='cpu' too"
            )
        if self.delayed_step and self.pages:
            raise ValueError(
                "offload.delayed_step=True steps every bucket at once in a background thread, which would map the "
                f"whole optimizer side from {self.optimizer_target.name} into host memory; use it with "
                f"optimizer='cpu', not {self.optimizer_target.name!r}"
            )
        return self

    @model_validator(mode="after")
    def _ratio_needs_cpu_offload(self) -> "Offload":
        if self.gpu_memory is not None and self.ratio != "auto":
            raise ValueError("offload.gpu_memory is the budget of ratio='auto'; set offload.ratio='auto' or remove it")
        if self.ratio == 1.0:
            return self
        if not self.optimizer_on_host or self.pages:
            raise ValueError(
                f"offload.ratio={self.ratio} splits the optimizer side between host memory and the device, so it "
                "needs offload.optimizer='cpu' (not 'disk', not unset), e.g. offload={'optimizer': 'cpu', 'ratio': "
                "0.5}"
            )
        if self.delayed_step:
            raise ValueError(
                "offload.delayed_step=True delays the whole step; with offload.ratio below 1 part of it steps on the "
                "device at once. Use one or the other"
            )
        return self

    @model_validator(mode="after")
    def _disk_needs_path(self) -> "Offload":
        named = next((t for t in (self.optimizer_target, self.params_target) if t.needs_path), None)
        if named is not None and self.path is None:
            raise ValueError(
                f"offload to {named.name!r} needs offload.path: a directory on a local disk (NVMe) where each rank "
                f"writes its offload file, e.g. offload={{'optimizer': {named.name!r}, 'path': '/local_nvme/zero'}}"
            )
        optimizer = target_of(self.optimizer)
        if self.params_target.pages and not optimizer.on_device and optimizer != self.params_target:
            raise ValueError(
                f"offload.params={self.params!r} keeps the optimizer side on {self.params_target.name} too (the master "
                f"shard beside the parameter shard); set offload.optimizer={self.params!r} or leave it unset"
            )
        if self.path is not None and named is None:
            raise ValueError("offload.path is used only with 'disk'; set optimizer='disk' (or params='disk')")
        return self

    @property
    def optimizer_target(self) -> OffloadTarget:
        """Where the optimizer's side lives: ``optimizer``'s target, or with ``optimizer='none'`` the parameter
        shards' (``params`` takes the optimizer's side along)."""
        target = target_of(self.optimizer)
        return target_of(self.params, "offload.params") if target.on_device else target

    @property
    def params_target(self) -> OffloadTarget:
        """Where stage 3's parameter shards live."""
        return target_of(self.params, "offload.params")

    @property
    def pages(self) -> bool:
        """A side lives in a target that pages through host memory (a window of ``buffer_count`` buckets)."""
        return self.optimizer_target.pages or self.params_target.pages

    @property
    def on_disk(self) -> bool:
        """The optimizer side (and with ``params='disk'`` stage 3's parameter shards) lives in files on disk."""
        return Where.DISK in (self.optimizer_target.where, self.params_target.where)

    @property
    def optimizer_on_host(self) -> bool:
        """The optimizer side lives off the device (host memory, or disk mapped through host memory)."""
        return not self.optimizer_target.on_device

    @property
    def params_on_host(self) -> bool:
        """Stage 3's parameter shards live off the device (host memory or disk)."""
        return not self.params_target.on_device

