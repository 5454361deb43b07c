"""Host memory for offload to the CPU: what is available now, and the check made before anything is allocated.

With ``optimizer="cpu"`` (stages 1-3) the buffers of the optimizer's side of a bucket live in host memory: the fp32
master shard, the optimizer's gradients (``master_grad``) and the wrapped optimizer's state (created on the master's
device by ``torch.optim``). Where the reduction is staged (stages 2-3, and mixed stage 1) each reduced chunk goes down
to a host gradient shard as soon as its collective completes; stage 1, which reduces its gradient buffer in place,
copies its chunk down at the step. The step runs on the host (:mod:`zero.runtime.step.host_threads`), and each bucket's
updated master is cast back into the device's low-precision parameters. With ``params="cpu"`` (stage 3) each rank's
parameter shard lives in host memory too and is copied up for its unit's all-gather. Host buffers are pinned when the
model is on a GPU, so that copies to and from it can run asynchronously
(:class:`zero.runtime.buffers.placement.HostPlacement`).

With ``ratio`` below 1 only that fraction of the buckets is offloaded, whole: the first ones backward reduces (their
gradients go down while backward goes on), and the rest stay on the device, where they step with the device's kernel
while the host steps its part (``zero.runtime.buffers.placement.Placements.for_buckets``).

May import: ``torch``, the policies."""

from __future__ import annotations

import os

from zero.offload import Offload

# bytes per element of this rank's chunk held on the host: fp32 master, fp32 gradient, two fp32 moments
HOST_BYTES_PER_ELEMENT = 4 + 4 + 8


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


def check_host_memory(offload: Offload, shard_numel: int, param_bytes: int) -> None:
    """Raise before allocating if this rank's host buffers would not fit in the memory available now
    (``shard_numel``: elements of this rank's chunks; ``param_bytes``: bytes per element of a parameter
    shard kept on the host)."""
    if not offload.optimizer_on_host or offload.pages:  # (a target that pages: its placement checks its own room)
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
