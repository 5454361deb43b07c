"""The only module that calls ``torch.distributed`` collectives.

Every collective goes through a :class:`Communicator`, which

* checks that every tensor it sends lives on its ``device`` (the one the backend moves);
* counts payload elements and bytes (on the wire) per collective kind, for the current step and the last one;
* returns a :class:`Handle` whose ``wait()`` carries a timeout and turns a timeout or a dead peer into an error that
  says which collective was waiting and why, after aborting the process group so that the process can exit;
* takes a fast path at world size 1 (nothing sent), unless ``force_collectives`` asks for real collectives.

Payload conventions (the ZeRO paper's): a reduce-scatter's payload is its input, an all-gather's its output, an
all-reduce's and a broadcast's their tensor, an all-to-all's its input.

Note: every all-gather and reduce-scatter passes through the communicator's ``codec`` (:mod:`zero.comm.codec`),
which decides how what it moves is encoded (the identity by default; ZeRO++'s block-quantized weights and
all-to-all gradient reduction are the codecs this seam is for) and composes the raw collectives of a
:class:`GroupTransport`, the only code that sends them. Their ``numel`` counts the payload above, their ``bytes``
the bytes on the wire (the payload's own with the identity codec).

Note: with hierarchical sharding (:mod:`zero.comm.hierarchy`) the communicator is over one shard group and holds the
one across the groups (``replicas``, HSDP) or counts a group's traffic (hpZ's secondary gathers): ``levels``.

Note: on gloo a reduce-scatter is an all-reduce of its input, and an all-gather one broadcast per rank: gloo's
own two send the same bytes but measured slower (torch 2.13, 2 ranks, in place, 25 MB: 1.6-2.1x and 1.4-1.5x the
time; 130 MB: 1.8-2.1x and 3.9-4.2x; ``benchmarks/gloo_collectives.py``), and with these a 32.6M GPT's stage-2 step
went from 1.07x to 0.96x DDP's (``benchmarks/why_time.py``). Each rank's chunk is still the sum over ranks of the
same inputs (bit for bit at two ranks; beyond, in the order of gloo's all-reduce, DDP's), the same on every rank.

Note on exit: gloo's worker thread drops a finished collective's work, and with it its tensors, possibly after
``wait()`` returned here; had this thread dropped its own references, the worker would free those tensors' Python
objects, taking the GIL, and at interpreter exit the process aborts ("terminate called without an active
exception"). So every gloo collective starts on private aliases (:class:`Settled`), and its wait returns once the
worker has let go of them. For the same reason a communicator holds its group weakly (``Communicator.group``):
after ``destroy_process_group()`` nothing of ours keeps a group's worker threads alive into the interpreter's exit.
"""

from __future__ import annotations

import datetime
import json
import pickle
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero.comm.codec import Codec, IdentityCodec, Work, Works
from zero.comm.groups import abort_group, check_launcher_world, resolve_device
from zero.comm.handles import Chain, CommStats, Handle, KindStats

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_SETTLE_S = 0.1  # the longest wait() waits for gloo's worker to let go of a finished collective's tensors
_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError}


def _all_gather_into_tensor(*args: Any, **kwargs: Any) -> Any:
    """``dist.all_gather_single`` where torch has it (newer name), else ``dist.all_gather_into_tensor``."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


class Settled:
    """A gloo collective started on private aliases of its tensors; :meth:`wait` returns only once gloo's worker
    thread has let go of them (see the module's Note on exit), so the last reference to each is this thread's."""

    def __init__(self, start: Callable[..., Any], tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any]):
        self._aliases = [t.detach() for t in tensors]  # (new tensor objects over the same memory)
        self._work: Any = start(*self._aliases, async_op=True, **kwargs)

    def wait(self, timeout: datetime.timedelta) -> None:
        work, self._work = self._work, None
        work.wait(timeout=timeout)
        del work  # (then only gloo's worker may hold the aliases: it drops them right after completing)
        deadline = time.monotonic() + _SETTLE_S
        while any(alias._use_count() > 1 for alias in self._aliases) and time.monotonic() < deadline:
            time.sleep(0)
        self._aliases = []


def _start(start: Callable[..., Any], backend: str, *tensors: torch.Tensor, **kwargs: Any) -> Any:
    """``start(*tensors, async_op=True, **kwargs)``, a ``torch.distributed`` collective: the only place one
    starts. On gloo through :class:`Settled`."""
    if backend == "gloo":
        return Settled(start, tensors, kwargs)
    return start(*tensors, async_op=True, **kwargs)


class GroupTransport:
    """The raw collectives a codec composes (:class:`zero.comm.codec.Transport`), over ``comm``'s group, each
    adding its payload's bytes to ``stats`` (the entry of the collective being encoded): bytes on the wire."""

    def __init__(self, comm: Communicator, stats: KindStats):
        self.rank, self.world_size, self.device, self.backend = comm.rank, comm.world_size, comm.device, comm.backend
        self._group = comm.group
        self._stats = stats

    def _sent(self, tensor: torch.Tensor) -> None:
        self._stats.bytes += tensor.numel() * tensor.element_size()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        assert output.numel() == input.numel() * self.world_size, (output.shape, input.shape)
        self._sent(output)
        if self.backend == "gloo":  # see the module's Note
            n = input.numel()
            mine = output.narrow(0, self.rank * n, n)
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input)
            chunks = [output.narrow(0, r * n, n) for r in range(self.world_size)]
            return Works([
                _start(dist.broadcast, self.backend, chunk, src=dist.get_global_rank(self._group, r), group=self._group)
                for r, chunk in enumerate(chunks)
            ])
        return _start(_all_gather_into_tensor, self.backend, output, input, group=self._group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        assert input.numel() == output.numel() * self.world_size, (input.shape, output.shape)
        self._sent(input)
        if self.backend == "gloo":  # see the module's Note
            chunk = input.narrow(0, self.rank * output.numel(), output.numel())
            work = _start(dist.all_reduce, self.backend, input, group=self._group)
            if chunk.data_ptr() == output.data_ptr():
                return work

            def then() -> None:
                output.copy_(chunk)

            return Works([work], then)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return _start(fn, self.backend, output, input, group=self._group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        assert output.numel() == input.numel() and input.numel() % self.world_size == 0, (output.shape, input.shape)
        self._sent(input)
        return _start(dist.all_to_all_single, self.backend, output, input, group=self._group)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        self._sent(tensor)
        return _start(dist.all_reduce, self.backend, tensor, group=self._group)


class Communicator:
    """Collectives over one process group, or none at all (world size 1).

    ``device``: where every tensor sent must live (default: the current GPU with NCCL, else
    the CPU). ``force_collectives``: issue real collectives even in a world of one. ``codec``:
    how all-gathers and reduce-scatters encode what they move (:mod:`zero.comm.codec`; default
    :class:`~zero.comm.codec.IdentityCodec`); an attribute, which may be replaced between collectives.
    ``replicas``: hierarchical sharding (:mod:`zero.comm.hierarchy`): the communicator across the groups, over the
    ranks that hold this rank's shard; this one's group is then the shard group (``rank`` and ``world_size`` are
    within it), its reduce-scatters sum across the groups too, and its broadcasts reach every rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 600.0,
        *,
        device: torch.device | str | None = None,
        force_collectives: bool = False,
        codec: Codec | None = None,
        replicas: Communicator | None = None,
    ):
        initialized = dist.is_available() and dist.is_initialized()
        if group is None and initialized:
            group = dist.group.WORLD
        if group is None:
            check_launcher_world()
        self._group = weakref.ref(group) if group is not None else None  # (see ``group``)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = resolve_device(device, self.backend)
        self.force_collectives = force_collectives
        self.codec: Codec = codec if codec is not None else IdentityCodec()
        self.aborted = False  # set when a collective failed and the group was aborted
        self.stats = CommStats()
        # communicators whose traffic counts as this one's steps', by level: "inter" (across HSDP's groups: the
        # replicas), "intra" (within hpZ's groups); zero.comm.hierarchy sets them up
        self.levels: dict[str, Communicator] = {"inter": replicas} if replicas is not None else {}

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None`` without one), held weakly: ``torch.distributed`` owns its groups, and
        ``destroy_process_group()`` frees them (see the module's Note on exit)."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError(
                "zero: the process group was destroyed (torch.distributed.destroy_process_group()), so this "
                "optimizer can no longer communicate; call close(), save_checkpoint() and the like before "
                "destroying it, or build a new ZeroOptimizer after init_process_group()."
            )
        return group

    @property
    def destroyed(self) -> bool:
        """Whether the process group this communicator had was destroyed (nothing can be sent any more)."""
        return self._group is not None and self._group() is None

    @property
    def backend(self) -> str:
        """The process group's backend (``"nccl"``, ``"gloo"``, ...), or ``"none"`` without one."""
        return str(dist.get_backend(self.group)) if self.group is not None else "none"

    @property
    def replicas(self) -> Communicator | None:
        """HSDP: the communicator across the groups (``None`` without it)."""
        return self.levels.get("inter")

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each compute on their own data: this group's, times the groups with hierarchical sharding."""
        return self.world_size * (self.replicas.world_size if self.replicas is not None else 1)

    @property
    def skips_collectives(self) -> bool:
        """True when collectives are local no-ops: no group, or a world of one not forced to send."""
        return self.group is None or (self.world_size == 1 and not self.force_collectives)

    def _handle(self, work: Any, what: str, stats: KindStats | None = None) -> Handle:
        return Handle(work, what, self.timeout, self._abort if work is not None else None, stats)

    def _abort(self) -> None:
        self.aborted = True
        abort_group(self.group)

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        """Raise unless the group is usable and every tensor is on this communicator's device."""
        if self.aborted:
            raise RuntimeError(
                f"zero: cannot run {what}: the process group was aborted after an earlier collective failed "
                "(see that error); restart the job."
            )
        for tensor in tensors:
            dev = tensor.device
            if dev.type != self.device.type or (self.device.index is not None and dev.index != self.device.index):
                raise ValueError(
                    f"zero: {what} got a tensor on {dev}, but this communicator sends tensors on {self.device} "
                    f"(backend {self.backend}). Keep the model on one device and pass that device "
                    "(ZeroOptimizer(device=...) or Communicator(device=...))."
                )

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, what: str = "all-reduce", every_group: bool = False
    ) -> Handle:
        """In-place all-reduce (``op`` is ``"sum"`` or ``"max"``) over this group, and with ``every_group`` across
        the groups too (hierarchical sharding; a ``"sum"`` then counts each group's value once per group)."""
        self._check(what, tensor)
        if self.skips_collectives:
            handle = self._handle(None, what)
        else:
            stats = self.stats.record("all_reduce", tensor)
            work = _start(dist.all_reduce, self.backend, tensor, op=_REDUCE_OPS[op], group=self.group)
            handle = self._handle(work, what, stats)
        if not every_group or self.replicas is None:
            return handle
        return Chain(handle, lambda: self.replicas.all_reduce(tensor, op, what=f"{what} across groups"))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, what: str = "reduce-scatter") -> Handle:
        """Sum ``input`` (1D, ``world_size * len(output)``) over ranks (with ``replicas``: every rank); keep this
        rank's chunk. Through the codec: lossy with a quantizing one.

        ``output`` may be this rank's chunk of ``input`` itself (in place). Afterwards the rest of ``input`` holds
        unspecified values (on gloo: the other chunks' sums).
        """
        self._check(what, output, input)
        assert input.numel() == output.numel() * self.world_size, (input.shape, output.shape)
        if self.skips_collectives:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            handle = self._handle(None, what)
        else:
            stats = self.stats.record("reduce_scatter", input, sent=False)
            handle = self._handle(self.codec.reduce_scatter(output, input, GroupTransport(self, stats)), what, stats)
        if self.replicas is None:
            return handle
        return Chain(handle, lambda: self.replicas.reduce_gradients(output, what=f"{what}: its shard across groups"))

    def reduce_gradients(self, tensor: torch.Tensor, *, what: str) -> Handle:
        """Sum gradients over this group in place, through the codec (lossy with a quantizing one; every rank ends
        with the same values). Counted as an ``all_reduce``: ``numel`` the tensor's, ``bytes`` the wire's."""
        self._check(what, tensor)
        if self.skips_collectives:
            return self._handle(None, what)
        stats = self.stats.record("all_reduce", tensor, sent=False)
        return self._handle(self.codec.all_reduce(tensor, GroupTransport(self, stats)), what, stats)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, what: str = "all-gather", exact: bool = False
    ) -> Handle:
        """Concatenate every rank's ``input`` in this group into ``output`` (1D); ``input`` may alias its chunk of
        ``output``. Through the codec, unless ``exact`` (a gather whose values outlive training's use of them, such
        as ``gathered_parameters()``'s, goes through the identity)."""
        self._check(what, output, input)
        assert output.numel() == input.numel() * self.world_size, (output.shape, input.shape)
        if self.skips_collectives:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return self._handle(None, what)
        stats = self.stats.record("all_gather", output, sent=False)
        codec = IdentityCodec() if exact else self.codec
        return self._handle(codec.all_gather(output, input, GroupTransport(self, stats)), what, stats)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str = "broadcast") -> Handle:
        """Overwrite ``tensor`` with group rank ``src``'s copy (with ``replicas``: that of rank ``src`` of the first
        group, on every rank)."""
        self._check(what, tensor)
        if self.skips_collectives:
            handle = self._handle(None, what)
        else:
            stats = self.stats.record("broadcast", tensor)
            global_src = dist.get_global_rank(self.group, src)
            work = _start(dist.broadcast, self.backend, tensor, src=global_src, group=self.group)
            handle = self._handle(work, what, stats)
        if self.replicas is None:
            return handle
        return Chain(handle, lambda: self.replicas.broadcast(tensor, 0, what=f"{what} across groups"))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   *, what: str = "all-to-all") -> Handle:
        """Send ``input``'s consecutive pieces of ``input_splits[r]`` elements to each rank ``r`` of this group and
        receive each rank's piece for this one into ``output``, in rank order (1D, uneven; no codec)."""
        self._check(what, output, input)
        if self.skips_collectives:
            output.copy_(input)
            return self._handle(None, what)
        work = _start(dist.all_to_all_single, self.backend, output, input, output_split_sizes=output_splits,
                      input_split_sizes=input_splits, group=self.group)
        return self._handle(work, what, self.stats.record("all_to_all", input))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (for small metadata, not tensors), with this
        communicator's timeout."""
        if self.skips_collectives:
            return [obj]
        return [pickle.loads(b) for b in self._all_gather_bytes(pickle.dumps(obj), "all-gather of objects")]

    def all_gather_json(self, obj: Any, *, what: str = "all-gather of metadata") -> list[Any]:
        """Every rank's JSON-serializable ``obj``, in rank order, with this communicator's timeout (for
        control messages such as a checkpoint's manifests: not counted as step traffic, never pickled)."""
        payload = json.dumps(obj).encode()
        if self.skips_collectives:
            return [json.loads(payload)]
        return [json.loads(b) for b in self._all_gather_bytes(payload, what)]

    def _all_gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, in rank order: the lengths, then the bytes padded to the longest."""
        self._check(what)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        mine = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._handle(_start(_all_gather_into_tensor, self.backend, sizes, mine, group=self.group), what).wait()
        longest = int(sizes.max())
        data = torch.zeros(longest, dtype=torch.uint8)
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
        self._handle(_start(_all_gather_into_tensor, self.backend, gathered, data.to(self.device), group=self.group),
                     what).wait()
        rows = gathered.cpu().view(self.world_size, longest)
        return [bytes(rows[r, : int(sizes[r])].numpy()) for r in range(self.world_size)]

    def everywhere(self, fn: Callable[[], Any], what: str, *, share: bool = False, every_group: bool = False) -> Any:
        """Run ``fn`` on this rank, then hear every rank's outcome (one :meth:`all_gather_json`): an error on any
        rank is raised on all of them, with that rank's message, instead of leaving the others waiting in their
        next collective. Returns this rank's result, or with ``share`` every rank's (JSON values). ``every_group``
        (hierarchical sharding): every group's ranks too, numbered as in the whole job."""
        error, result = None, None
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks have heard of it
            error = err
        outcomes = self.all_gather_json({"error": None if error is None else [type(error).__name__, str(error)],
                                         "result": result if share else None}, what=what)
        if every_group and self.replicas is not None:  # (rank = group * shard_size + rank in the group)
            outcomes = [o for group in self.replicas.all_gather_json(outcomes, what=what) for o in group]
        if error is not None:
            raise error
        for rank, outcome in enumerate(outcomes):
            if outcome["error"] is not None:
                kind, message = outcome["error"]
                raise _ERRORS.get(kind, RuntimeError)(f"rank {rank} failed while {what}: {message}")
        return [o["result"] for o in outcomes] if share else result

    def end_step(self) -> None:
        """Close the current step's counters (``stats.last_step`` becomes this step's)."""
        self.stats.end_step()
        for level in self.levels.values():
            level.end_step()

    def step_stats(self) -> dict[str, dict[str, float]]:
        """The last step's counters by kind; with hierarchical sharding those of the other level as ``inter_<kind>``
        (HSDP: across the groups) or ``intra_<kind>`` (hpZ: inside a group)."""
        stats = self.stats.as_dict("last_step")
        for prefix, level in self.levels.items():
            stats.update({f"{prefix}_{kind}": v for kind, v in level.stats.as_dict("last_step").items()})
        return stats
