"""The only module that calls ``torch.distributed`` collectives.

Every collective goes through a :class:`Communicator`, which

* counts payload elements and bytes per collective kind, for the current step
  and for the last completed one (``CommStats``);
* returns a :class:`Handle` whose ``wait()`` carries a timeout and turns a timeout
  or a dead peer into an error that says which collective was waiting and why;
* takes a fast path at world size 1 (no process group needed, nothing sent).

Payload conventions (the ZeRO paper's): a reduce-scatter's payload is its input,
an all-gather's its output, an all-reduce's and a broadcast's their tensor.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class KindStats:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Payload counters per collective kind: ``current`` (this step) and ``last_step``."""

    current: dict[str, KindStats] = field(default_factory=lambda: defaultdict(KindStats))
    last_step: dict[str, KindStats] = field(default_factory=dict)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        entry = self.current[kind]
        entry.calls += 1
        entry.numel += tensor.numel()
        entry.bytes += tensor.numel() * tensor.element_size()

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        self.current = defaultdict(KindStats)

    def as_dict(self, which: str = "last_step") -> dict[str, dict[str, int]]:
        stats = self.last_step if which == "last_step" else self.current
        return {kind: vars(entry).copy() for kind, entry in sorted(stats.items())}


class Handle:
    """An in-flight collective; ``wait()`` raises a descriptive error on timeout."""

    def __init__(self, work: Any, what: str, timeout: datetime.timedelta):
        self._work = work
        self.what = what
        self._timeout = timeout

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as err:
            raise RuntimeError(
                f"zero: {self.what} did not complete within {self._timeout.total_seconds():.0f}s ({err}). "
                "A rank may have died, or ranks took different paths (a different number of backward "
                "passes, steps or clip_grad_norm_ calls, or different models). Check every rank's log; "
                "raise ZeroConfig.timeout_s if a step is simply slow."
            ) from err


class Communicator:
    """Collectives over one process group, or none at all (world size 1)."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 600.0):
        initialized = dist.is_available() and dist.is_initialized()
        if group is None and initialized:
            group = dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.stats = CommStats()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size})"

    @property
    def backend(self) -> str:
        """The process group's backend (``"nccl"``, ``"gloo"``, ...), or ``"none"`` without one."""
        return str(dist.get_backend(self.group)) if self.group is not None else "none"

    def _handle(self, work: Any, what: str) -> Handle:
        return Handle(work, what, self.timeout)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str = "all-reduce") -> Handle:
        """In-place all-reduce (``op`` is ``"sum"`` or ``"max"``)."""
        if self.world_size == 1:
            return self._handle(None, what)
        self.stats.record("all_reduce", tensor)
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group, async_op=True)
        return self._handle(work, what)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, what: str = "reduce-scatter") -> Handle:
        """Sum ``input`` (1D, ``world_size * len(output)``) over ranks; keep this rank's chunk.

        ``output`` may be this rank's chunk of ``input`` itself (in place).
        """
        assert input.numel() == output.numel() * self.world_size, (input.shape, output.shape)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._handle(None, what)
        self.stats.record("reduce_scatter", input)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._handle(fn(output, input, group=self.group, async_op=True), what)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, what: str = "all-gather") -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (1D); ``input`` may alias its chunk of ``output``."""
        assert output.numel() == input.numel() * self.world_size, (output.shape, input.shape)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._handle(None, what)
        self.stats.record("all_gather", output)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._handle(fn(output, input, group=self.group, async_op=True), what)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str = "broadcast") -> Handle:
        """Overwrite ``tensor`` with group rank ``src``'s copy."""
        if self.world_size == 1:
            return self._handle(None, what)
        self.stats.record("broadcast", tensor)
        global_src = dist.get_global_rank(self.group, src)
        return self._handle(dist.broadcast(tensor, src=global_src, group=self.group, async_op=True), what)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (for small metadata, not tensors)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def end_step(self) -> None:
        """Close the current step's counters (``stats.last_step`` becomes this step's)."""
        self.stats.end_step()
