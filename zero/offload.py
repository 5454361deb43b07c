"""Offload: the policy (``ZeroConfig.offload``) and the memory and disk checks made before anything is allocated.
Where each buffer then lives, and how it is allocated and copied, is ``zero.runtime.buffers.placement``'s (and, on
disk, ``zero.runtime.offload.disk``'s).

With ``optimizer="cpu"`` (stages 1-3) the buffers of the optimizer's side of a bucket live in host
memory: the fp32 master shard, the optimizer's gradients (``master_grad``) and the wrapped
optimizer's state (created on the master's device by ``torch.optim``). Where the reduction is staged
(stages 2-3, and mixed stage 1) each reduced chunk goes down to a host gradient shard as soon as its
collective completes; stage 1, which reduces its gradient buffer in place, copies its chunk down at
the step. The step runs on the host, and each bucket's updated master is cast back into the
device's low-precision parameters. With ``params="cpu"`` (stage 3) each rank's
parameter shard lives in host memory too and is copied up for its unit's all-gather; it implies
optimizer offload (the master shard is then a host buffer whatever the dtypes).

Host buffers are pinned when the model is on a GPU, so that copies to and from it can run
asynchronously. The arithmetic is unchanged: the same optimizer steps the same fp32 values, so
offload changes no number on CPU (tested bit for bit at 1, 2 and 3 ranks).

With ``ratio`` below 1 (ZeRO-Offload++'s Twin-Flow, DeepSpeed's ``offload_optimizer.ratio``) only that fraction of
the buckets is offloaded, whole: the first ones backward reduces (their gradients go down while backward goes on),
and the rest stay on the device, where they step with the device's kernel while the host steps its part
(``zero.runtime.buffers.placement.Placements.for_buckets``). ``ratio=0`` is no offload, bit for bit.

With ``"disk"`` (ZeRO-Infinity) the same buffers, and the wrapped optimizer's per-element state, live in one
preallocated, memory-mapped file per rank under ``path``; at most ``buffer_count`` buckets of them are mapped in
host memory at a time, read ahead of their step and written back after it (``zero.runtime.offload.disk``).
"""

from __future__ import annotations

import os
import warnings
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

# bytes per element of this rank's chunk held on the host: fp32 master, fp32 gradient, two fp32 moments
HOST_BYTES_PER_ELEMENT = 4 + 4 + 8


class Offload(BaseModel):
    """The offload policy of :class:`zero.ZeroConfig` (``offload=``): ``{"optimizer": "cpu"}`` keeps the
    fp32 master shard, the optimizer's gradients and its state in host memory and steps there (stages
    1-3); ``{"params": "cpu"}`` also keeps stage 3's parameter shards there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="'cpu': master weights, optimizer gradients and state in host memory; step on the host. "
        "'disk': the same in a file per rank under `path`, stepped bucket by bucket on the host.",
    )
    params: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="'cpu' (stage 3): parameter shards in host memory, copied up for each gather. 'disk': in the "
        "file under `path` (the optimizer side goes to disk too), read ahead of each gather.",
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
        if self.delayed_step and self.on_disk:
            raise ValueError(
                "offload.delayed_step=True steps every bucket at once in a background thread, which would map the "
                "whole optimizer side from disk into host memory; use it with optimizer='cpu', not 'disk'"
            )
        return self

    @model_validator(mode="after")
    def _ratio_needs_cpu_offload(self) -> "Offload":
        if self.gpu_memory is not None and self.ratio != "auto":
            raise ValueError("offload.gpu_memory is the budget of ratio='auto'; set offload.ratio='auto' or remove it")
        if self.ratio == 1.0:
            return self
        if not self.optimizer_on_host or self.on_disk:
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
        if self.on_disk and self.path is None:
            raise ValueError(
                "offload to 'disk' needs offload.path: a directory on a local disk (NVMe) where each rank writes "
                "its offload file, e.g. offload={'optimizer': 'disk', 'path': '/local_nvme/zero'}"
            )
        if self.params == "disk" and self.optimizer == "cpu":
            raise ValueError(
                "offload.params='disk' keeps the optimizer side on disk too (the master shard beside the parameter "
                "shard); set offload.optimizer='disk' or leave it unset"
            )
        if self.path is not None and not self.on_disk:
            raise ValueError("offload.path is used only with 'disk'; set optimizer='disk' (or params='disk')")
        return self

    @property
    def on_disk(self) -> bool:
        """The optimizer side (and with ``params='disk'`` stage 3's parameter shards) lives in files on disk."""
        return self.optimizer == "disk" or self.params == "disk"

    @property
    def optimizer_on_host(self) -> bool:
        """The optimizer side lives off the device (host memory, or disk mapped through host memory)."""
        return self.optimizer != "none" or self.params != "none"

    @property
    def params_on_host(self) -> bool:
        """Stage 3's parameter shards live off the device (host memory or disk)."""
        return self.params != "none"


def available_host_bytes() -> int | None:
    """Host memory available to this process now (``MemAvailable`` on Linux), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_step_threads(setting: int | Literal["auto"], local_ranks: int) -> int:
    """The threads of the host step: ``setting`` if it is a number; with ``"auto"`` the cores in this process's CPU
    affinity, divided among ``local_ranks`` (the ranks on this machine) when the affinity is the whole machine (the
    ranks were not bound to cores of their own, so they share them)."""
    if setting != "auto":
        return setting
    try:
        owned = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        owned = os.cpu_count() or 1
    if owned >= (os.cpu_count() or owned):
        owned //= max(local_ranks, 1)
    return max(owned, 1)


def check_host_memory(offload: Offload, shard_numel: int, param_bytes: int) -> None:
    """Raise before allocating if this rank's host buffers would not fit in the memory available now
    (``shard_numel``: elements of this rank's chunks; ``param_bytes``: bytes per element of a parameter
    shard kept on the host)."""
    if not offload.optimizer_on_host or offload.on_disk:  # (disk: zero.runtime.offload.disk checks free space)
        return
    per_element, extras = HOST_BYTES_PER_ELEMENT, ""
    if offload.params_on_host:
        per_element, extras = per_element + param_bytes, extras + ", plus the parameter shard"
    if offload.delayed_step:  # the copy of the gradients handed to the background step
        per_element, extras = per_element + 4, extras + ", plus the gradients of the delayed step"
    needed = shard_numel * per_element
    available = available_host_bytes()
    if available is not None and needed > available:
        raise ValueError(
            f"CPU offload needs about {needed / 2**30:.2f} GiB of host memory on this rank (fp32 master, "
            f"gradients and Adam-sized optimizer state for {shard_numel:,} elements{extras}), but only "
            f"{available / 2**30:.2f} GiB is available. Use more ranks (the shard shrinks as 1/N), free host "
            "memory, or offload less (offload.params='none', or offload.optimizer='none')."
        )


def warn_unfused_host_step(optimizer: torch.optim.Optimizer) -> None:
    """The host step is memory-bound: torch's fused CPU Adam/AdamW kernel runs at the bandwidth limit,
    the foreach and single-tensor ones several times slower (``benchmarks/optimizer_step.py``)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not optimizer.defaults.get("fused"):
        kernel = "single-tensor" if optimizer.defaults.get("foreach") is False else "foreach"
        warnings.warn(
            f"offloaded {type(optimizer).__name__} steps on the host with its {kernel} kernel; build it with "
            f"fused=True for a host step at memory bandwidth (about 8x faster on CPU, "
            "see benchmarks/optimizer_step.py; its rounding differs from the foreach kernel's by about 1 ulp).",
            stacklevel=4,
        )
