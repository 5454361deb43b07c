"""Offload to disk (ZeRO-Infinity): one preallocated, memory-mapped file per rank, and the placement over it.

:class:`OffloadFile` is one rank's file under ``offload.path``: a header page that names the run, then one
page-aligned region per buffer, mapped into the process in arenas of a GiB. :class:`DiskPlacement` hands out 1D
tensors over those regions, so every part of the runtime (the step, clipping, checkpoints) reads and writes
them as ordinary host tensors while their bytes live on disk. What is in host memory at a time is bounded by
paging (``zero.runtime.offload.paging``): a region is read ahead (``madvise(MADV_WILLNEED)``) before its bucket is used
and written back and dropped (``MADV_DONTNEED``, then ``POSIX_FADV_DONTNEED``, which starts the write-back)
right after, so the kernel overlaps reads, the step and writes.

Note: why memory mapping, not ``preadv``/``pwritev`` into a pool of staging buffers or io_uring. A mapped
region is a plain tensor, so nothing above the placement changes and no value is copied twice; the kernel's
read-ahead and write-back run on their own threads, which is the pipeline we would otherwise build. A
released buffer (a gradient shard between steps) is a hole punched in the file (``MADV_REMOVE``), allocated again
(as zeros) when it is restored: writing it then neither reads the stale bytes first nor writes them back.
``benchmarks/disk_offload.py`` measures the step against this disk's own sequential bandwidth.

Robustness: free space is checked before anything is allocated (:func:`check_disk_space`, with the bytes the stage
plan puts on disk, :func:`planned_disk_bytes`; the file is created at the first allocation); every region is
allocated with ``posix_fallocate`` (a full disk fails there, with the bytes needed, never later as a SIGBUS); the
file's name and header carry a run identity drawn at construction (it is created with ``O_EXCL``, so a file left by
an earlier run is never read), and the header and inode are checked at every pass over the buckets
(``zero.runtime.offload.paging``), so a file another process wrote or replaced is an error; the file is removed by
``close()``, when the optimizer is collected, or at a normal interpreter exit, and only if its header still names
this run (nothing else is ever deleted).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from zero.offload import Offload
from zero.runtime.buffers.placement import HOST, Placement, Where
from zero.runtime.buffers.plan import StagePlan

PAGE = mmap.ALLOCATIONGRANULARITY  # regions start on page boundaries (mmap's offset and madvise need it)
HEADER_BYTES = PAGE
ARENA_BYTES = 1 << 30  # one mapping (and one duplicated descriptor) per GiB of file, not one per region
# the kernel reads at most its read-ahead size (often 128 KiB to 8 MiB) per MADV_WILLNEED: ask in pieces this big
WILLNEED_BYTES = 2 << 20
MAGIC = b"zero offload file\n"


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(eq=False)
class Region:
    """``nbytes`` of the file from ``offset``, at ``start`` in an arena's ``mapping``."""

    file: "OffloadFile"
    offset: int
    nbytes: int
    mapping: mmap.mmap
    start: int

    def tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1D tensor over the region (it keeps the mapping alive)."""
        return torch.frombuffer(self.mapping, dtype=dtype, count=numel, offset=self.start)

    def prefetch(self) -> None:
        """Start reading the region into memory (asynchronously, by the kernel's read-ahead)."""
        self._will_need()
        self.file.stats.prefetched += self.nbytes

    def _will_need(self) -> None:
        """``MADV_WILLNEED`` over the whole region, piece by piece (one call reads only up to the device's read-ahead
        size; the rest would be read by page faults, whose own read-ahead runs on into the next regions)."""
        for start in range(self.start, self.start + self.nbytes, WILLNEED_BYTES):
            self.mapping.madvise(mmap.MADV_WILLNEED, start, min(WILLNEED_BYTES, self.start + self.nbytes - start))

    def evict(self) -> None:
        """Unmap the region's pages from this process and start writing the dirty ones back; the values stay."""
        self.mapping.madvise(mmap.MADV_DONTNEED, self.start, self.nbytes)
        os.posix_fadvise(self.file.fd, self.offset, self.nbytes, os.POSIX_FADV_DONTNEED)
        self.file.stats.evicted += self.nbytes

    def discard(self) -> None:
        """Drop the values: punch a hole (reads give zeros, with no I/O; nothing is written back)."""
        self.mapping.madvise(mmap.MADV_REMOVE, self.start, self.nbytes)

    def restore(self) -> None:
        """Allocate a discarded region's blocks again (as zeros, with no I/O), so that writing it cannot meet a full
        disk (that would be a SIGBUS, not an error); and map its zero pages in ahead (no I/O either: unwritten blocks),
        so that writing it does not fault page by page, each fault reading ahead into the next regions."""
        _allocate(self.file, self.offset, self.nbytes)
        self._will_need()


@dataclass
class DiskStats:
    """Bytes of regions asked to be read ahead and written back (the runtime's side of the traffic; the
    storage's own counters are ``/proc/self/io``'s, which ``benchmarks/disk_offload.py`` reads)."""

    prefetched: int = 0
    evicted: int = 0


class OffloadFile:
    """One rank's offload file (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int):
        self.directory = Path(directory)
        self.run_id = uuid.uuid4().hex
        self.path = self.directory / f"zero-offload-{self.run_id[:16]}-rank{rank:05d}-of-{world_size:05d}.bin"
        self.size = HEADER_BYTES
        self.arena: tuple[int, mmap.mmap] | None = None  # (file offset, mapping) of the arena regions go into
        self.stats = DiskStats()
        self.header = _header(self.run_id, rank, world_size)
        self.fd = -1  # the file is made at the first reserve()

    def _create(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # never an existing file
        self._finalizer = weakref.finalize(self, _remove_if_ours, self.path, self.fd, self.header)
        _allocate(self, 0, HEADER_BYTES)
        os.pwrite(self.fd, self.header, 0)

    def __repr__(self) -> str:
        return f"OffloadFile({self.path}, {self.size:,} bytes allocated)"

    def reserve(self, nbytes: int) -> Region:
        """A new region of at least ``nbytes`` (zeros: never written), allocated on disk and mapped."""
        if self.fd < 0:
            self._create()
        length = round_up(max(nbytes, 1))
        offset = self.size
        _allocate(self, offset, length)
        self.size += length
        if self.arena is None or offset + length > self.arena[0] + len(self.arena[1]):
            # the file is extended sparsely to the arena's end to be mapped; only allocated regions are ever touched
            arena = max(length, ARENA_BYTES)
            if os.fstat(self.fd).st_size < offset + arena:
                os.ftruncate(self.fd, offset + arena)
            self.arena = (offset, mmap.mmap(self.fd, arena, offset=offset))
        base, mapping = self.arena
        return Region(self, offset, length, mapping, offset - base)

    def check(self) -> None:
        """Raise unless the file on disk is still this run's (a header written by another run, or a file
        replaced or truncated under us, must never be read as this run's state)."""
        if self.fd < 0:
            return
        try:
            on_disk = os.pread(self.fd, HEADER_BYTES, 0)
            same = os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except OSError as err:
            raise RuntimeError(f"the offload file {self.path} cannot be read ({err}); it was removed or moved") from err
        if on_disk != self.header or not same:
            raise RuntimeError(
                f"the offload file {self.path} is not this run's any more (its header or inode changed): another "
                "process wrote or replaced it. Give each run its own offload.path, and do not touch the files."
            )

    def close(self) -> None:
        """Remove the file (if it is still this run's); the regions stay readable while mapped."""
        if self.fd >= 0:
            self._finalizer()


def _header(run_id: str, rank: int, world_size: int) -> bytes:
    fields = {"format": 1, "run": run_id, "rank": rank, "world_size": world_size, "pid": os.getpid(),
              "host": socket.gethostname()}
    raw = MAGIC + json.dumps(fields).encode()
    assert len(raw) < HEADER_BYTES
    return raw.ljust(HEADER_BYTES, b"\0")


def _allocate(file: OffloadFile, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(file.fd, offset, length)
    except OSError as err:
        raise ValueError(
            f"offload to disk could not allocate {length:,} more bytes in {file.path} ({err.strerror}); the file "
            f"holds {file.size:,} bytes so far. Free space on that disk, point offload.path at a larger one, or "
            "use more ranks."
        ) from err


def _remove_if_ours(path: Path, fd: int, header: bytes) -> None:
    """Remove ``path`` if it still carries ``header`` (this run's), then close ``fd``."""
    try:
        with open(path, "rb") as f:
            ours = f.read(HEADER_BYTES) == header
        if ours:
            path.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


def planned_disk_bytes(plan: StagePlan, state: dict[str, torch.dtype]) -> int:
    """The size of a rank's offload file under ``plan`` (the header, and each buffer the plan puts on disk and each
    trainable bucket's region per optimizer state key, ``state``, rounded up to pages, as :meth:`OffloadFile.reserve`
    allocates them)."""
    nbytes = HEADER_BYTES
    for bucket in plan.buckets:
        nbytes += sum(round_up(spec.nbytes) for spec in bucket.buffers if spec.where is Where.DISK and spec.nbytes)
        if bucket.trainable:
            nbytes += sum(round_up(bucket.layout.chunk_numel * dtype.itemsize) for dtype in state.values())
    return nbytes


def check_disk_space(directory: str | os.PathLike, needed: int) -> None:
    """Raise before allocating if ``directory``'s file system has less than ``needed`` bytes free."""
    directory = Path(directory)
    probe = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
    stat = os.statvfs(probe)
    free = stat.f_bavail * stat.f_frsize
    if needed > free:
        raise ValueError(
            f"offload to disk needs {needed:,} bytes ({needed / 2**30:.2f} GiB) on this rank in {directory}, "
            f"but its file system has {free:,} bytes ({free / 2**30:.2f} GiB) free. Free space, point "
            "offload.path at a larger disk, or use more ranks (each rank's file shrinks as 1/N)."
        )


class DiskPlacement(Placement):
    """Buffers in an :class:`OffloadFile`, mapped into host memory (see the module docstring)."""

    where = Where.DISK
    device = HOST

    def __init__(self, file: OffloadFile):
        self.file = file
        self.regions: dict[int, Region] = {}  # by the tensor's data pointer

    @classmethod
    def make(cls, offload: Offload, device: torch.device, rank: int, world_size: int) -> "DiskPlacement":
        """This rank's file under ``offload.path`` (made at its first allocation, once the plan's bytes fit)."""
        return cls(OffloadFile(offload.path, rank, world_size))

    def check_room(self, plan: StagePlan, state: dict[str, torch.dtype]) -> None:
        check_disk_space(self.file.directory, planned_disk_bytes(plan, state))

    def check(self) -> None:
        self.file.check()

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        region = self.file.reserve(numel * dtype.itemsize)  # zeros until written: ``allocate`` needs nothing
        tensor = region.tensor(numel, dtype)
        self.regions[tensor.data_ptr()] = region
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        self.regions[tensor.data_ptr()].discard()

    def restore(self, tensor: torch.Tensor) -> None:
        self.regions[tensor.data_ptr()].restore()

    def prefetch(self, tensor: torch.Tensor) -> None:
        self.regions[tensor.data_ptr()].prefetch()

    def evict(self, tensor: torch.Tensor) -> None:
        self.regions[tensor.data_ptr()].evict()

    def close(self) -> None:
        self.file.close()
