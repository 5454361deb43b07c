"""The allocator's own figure, which the tracker's categories are reconciled with.

* CUDA: ``torch.cuda.memory_allocated()`` at each sample; tensor sizes are rounded up to the
  caching allocator's 512-byte blocks; the peak between samples is ``max_memory_allocated()``
  (its counter is reset at each sample, so this changes what a caller sees from it). cuBLAS's
  workspaces are allocated through the same allocator but belong to no tensor: they are measured
  when tracking starts and reported as ``other/cuBLAS workspaces`` (:func:`cublas_workspaces`).
* CPU: PyTorch's CPU allocator reports every allocation and free to the profiler
  (``torch.profiler.profile(profile_memory=True)``), with the operator it happened in. The
  tracker marks each sample in that record; afterwards the record is replayed: the figure at a
  sample is the bytes allocated since the start and not yet freed, plus the storages that were
  already alive at the start and still are (their frees are not reported, because they were
  allocated before the profiler ran; the tracker checks them itself at each sample).

Buffers that the collectives allocate for themselves (gloo copies its inputs and outputs
into buffers of its own) are reported by the allocator inside ``c10d::`` / ``gloo:`` operators
or on gloo's worker threads; they are added to the ``communication`` category as
``communication/collective internals``.
"""

from __future__ import annotations

import torch

MARK = "zero::memory_sample"
_COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:")


class Allocator:
    """Common result: the allocator's peak and where it happened."""

    name = "allocator"

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        # the peak of what PyTorch's own code holds: without the buffers collectives allocate
        # for themselves (gloo's; NCCL's are outside the allocator), freed at times that vary
        self.peak_without_collectives = 0

    def block_size(self, nbytes: int) -> int:
        return nbytes

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def mark(self, index: int) -> None: ...

    def now(self) -> int:
        return 0

    def reconcile(self, samples: list, entries: list) -> None: ...

    def outside_tensors(self) -> dict[str, int]:
        """What the allocator holds for libraries rather than in any tensor, by name (bytes)."""
        return {}

    def _note_peak(self, value: int, collectives: int = 0) -> None:
        self.peak = max(self.peak, value)
        self.peak_without_collectives = max(self.peak_without_collectives, value - collectives)


class CudaAllocator(Allocator):
    name = "torch.cuda.memory_allocated"

    def block_size(self, nbytes: int) -> int:
        return 0 if nbytes == 0 else -(-nbytes // 512) * 512

    def start(self) -> None:
        self.workspaces = cublas_workspaces(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def outside_tensors(self) -> dict[str, int]:
        return {"cuBLAS workspaces": self.workspaces} if self.workspaces else {}

    def mark(self, index: int) -> None:
        # the highest point since the previous sample, then a fresh counter for the next interval
        self._note_peak(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reconcile(self, samples: list, entries: list) -> None:
        for s in samples:
            self._note_peak(s.allocated)


def cublas_workspaces(device: torch.device) -> int:
    """Bytes the caching allocator holds for cuBLAS's workspaces (one per handle and stream: the forward thread's and
    autograd's backward thread's, each made at its first matmul, tens of MiB on recent GPUs). They are made here if
    they were not yet, by a small matmul forward and backward in fp32 and bf16, so that they exist from the start of
    the tracking as they would from the first matmul; measured by freeing them and making them again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return 0

    def make() -> None:
        a = torch.ones(16, 16, device=device, requires_grad=True)
        for dtype in (torch.float32, torch.bfloat16):
            w = a.to(dtype)
            torch.nn.functional.linear(w, w, w[0]).sum().backward()

    make()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    clear()
    freed = held - torch.cuda.memory_allocated(device)
    make()
    return freed


class CpuAllocator(Allocator):
    name = "PyTorch's CPU allocator (profiler memory events)"

    def start(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            raise ValueError(
                "zero.profile on CPU reads the allocator through torch.profiler, which is already running; "
                "profile memory outside the torch.profiler block"
            )
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()

    def stop(self) -> None:
        self._profiler.__exit__(None, None, None)

    def mark(self, index: int) -> None:
        with torch.profiler.record_function(MARK):
            pass

    def reconcile(self, samples: list, entries: list) -> None:
        events = self._events()
        markers = sum(1 for e in events if e[1] == 1)
        if markers != len(samples):
            raise RuntimeError(f"zero.profile: found {markers} sample marks in the profiler's record "
                               f"for {len(samples)} samples")
        reused = _entries_reused(events, entries)
        # Note: a block freed on one of gloo's worker threads (the last reference to a collective's
        # buffer can die there) is not reported: the profiler does not watch that thread outside the
        # collective itself. An allocation at an address that is still live therefore means the
        # block there was freed: it is dropped then. Until that happens such a block still counts,
        # as communication/collective internals.
        live: dict[int, tuple[int, bool]] = {}
        total = internal_bytes = index = 0
        entry_bytes = samples[0].entry_alive if samples else 0
        for _time, kind, ptr, size, in_collective in events:
            if kind == 1:  # a sample
                s = samples[index]
                entry_bytes = s.entry_alive - sum(e.nbytes for e, at in reused if at <= index < _dead(e))
                s.allocated = entry_bytes + total
                # a collective's own buffer can surface as an operator's output: then it is a temporary
                hidden = internal_bytes and sum(n for p, (n, own) in live.items() if own and p not in s.created_ptrs)
                if hidden:
                    s.categories["communication"] += hidden
                    s.labels["communication/collective internals"] = hidden
                    s.modules["<collectives>"] = hidden
                self._note_peak(s.allocated, internal_bytes)
                index += 1
                continue
            if ptr in live:  # a free, or an allocation where an unreported free happened (see the note)
                old, was_internal = live.pop(ptr)
                total -= old
                internal_bytes -= old if was_internal else 0
            if size > 0:
                live[ptr] = (size, in_collective)
                total += size
                internal_bytes += size if in_collective else 0
                self._note_peak(entry_bytes + total, internal_bytes)

    def _events(self) -> list[tuple[int, int, int, int, bool]]:
        """(time, 0 = allocation or free / 1 = sample, pointer, signed size, by a collective), in time order.

        A block counts as the collectives' own when it is allocated inside a collective operator or
        on a thread that never takes samples (gloo's workers)."""
        from torch._C._profiler import _EventType

        allocations, marks = [], []
        stack = list(self._profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
                allocations.append(e)
            elif e.name == MARK:
                marks.append(e)
        sampling_threads = {e.start_tid for e in marks}
        out = [(e.start_time_ns, 1, 0, 0, False) for e in marks]
        for e in allocations:
            own = e.start_tid not in sampling_threads or _inside_collective(e)
            out.append((e.start_time_ns, 0, e.typed[1].ptr, e.typed[1].alloc_size, own))
        out.sort(key=lambda x: (x[0], x[1]))
        return out


def _inside_collective(event) -> bool:
    while event is not None:
        if event.name.startswith(_COLLECTIVE_PREFIXES):
            return True
        event = event.parent
    return False


def _entries_reused(events: list, entries: list) -> list[tuple[object, int]]:
    """Storages alive at the start whose block was freed and handed out again between two samples:
    (entry, first sample after the new allocation). The tracker's own check can miss these."""
    by_ptr = {e.ptr: e for e in entries}
    found, index = {}, 0
    for _time, kind, ptr, size, _ in events:
        if kind == 1:
            index += 1
        elif size > 0 and ptr in by_ptr and by_ptr[ptr] not in found:
            found[by_ptr[ptr]] = index
    return [(e, at) for e, at in found.items() if at < _dead(e)]


def _dead(entry) -> float:
    return entry.dead_at if entry.dead_at is not None else float("inf")


def make_allocator(device: torch.device) -> Allocator:
    if device.type == "cuda":
        return CudaAllocator(device)
    if device.type == "cpu":
        return CpuAllocator(device)
    raise ValueError(f"zero.profile supports CPU and CUDA devices, got {device}")
