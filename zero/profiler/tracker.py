"""The memory tracker: every live tensor byte on one device, by category, module and phase, over time.

While a :class:`MemoryTracker` is active it keeps three registries of tensor storages:

* **owned**: asked for at each sample: the model's parameters, gradients and buffers, and
  whatever the optimizer names (``ZeroOptimizer.named_memory()``: flat buffers, shards,
  buffers of collectives in flight, optimizer state; for a plain ``torch.optim`` optimizer,
  its ``state``);
* **saved**: storages autograd saves for backward (``saved_tensors_hooks``), with the module
  whose forward saved them;
* **created**: every storage an operator returns (a ``TorchDispatchMode``), with the module
  and phase it was created in; and the storages that were already alive on entry.

It samples at every module's forward pre- and post-hook, when backward reaches a module's
outputs, at every parameter's gradient and around ``optimizer.step()``. A sample counts each
live storage once, in this order: owned (by the owner's category), saved (``activations``),
created during the run (``temporaries``; ``activations`` when created by a forward recomputed in backward,
the ``recompute`` phase of activation checkpointing), alive on entry (``other``). Sizes are read when
sampled, so storages resized in place (freed and re-gathered buffers) count what they hold.

The categories are then reconciled with the allocator's own figure (``zero.profiler.allocator``):
whatever it holds that no category explains is reported as ``unexplained``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zero.memory import CATEGORIES, MemoryItem, storage_of
from zero.outputs import tensors_in
from zero.profiler.allocator import Allocator, make_allocator
from zero.profiler.report import peak_sample, table
from zero.profiler.report import plot as plot_report
from zero.profiler.report import to_json as report_json
from zero.profiler.sample import Sample
from zero.profiler.storages import EntryStorage, Origin, SavedStorage, SavedTensor, entry_storages, register
from zero.weak import weak_hook


class _Context:
    """Where the run is: the module stack in forward, the module reached in backward, the phase."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.backward_module = ""
        self.in_step = False
        self.step = 0

    @property
    def phase(self) -> str:
        if self.in_step:
            return "step"
        if torch._C._current_graph_task_id() != -1:  # a forward inside backward: activation checkpointing's
            return "recompute" if self.stack else "backward"
        return "forward" if self.stack else "idle"

    @property
    def module(self) -> str:
        if self.stack:  # forward, or a forward recomputed in backward (activation checkpointing)
            return self.stack[-1]
        if self.in_step:
            return "<optimizer>"
        return self.backward_module if self.phase in ("backward", "recompute") else ""


class _Creations(TorchDispatchMode):
    """Records the storage of every tensor an operator returns."""

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._record_created(out)
        if self.tracker.every_op:
            self.tracker.sample(func.__name__)
        return out


class MemoryTracker:
    """Context manager that profiles device memory while a model trains (see the module docstring).

    Use :func:`zero.profile` rather than this class directly.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: torch.device | str | None = None,
        every_op: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise ValueError(f"zero.profile needs the model (an nn.Module), got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"zero.profile's optimizer must be a torch.optim.Optimizer, "
                             f"got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.every_op = every_op
        self.device = torch.device(device) if device is not None else _model_device(model)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.samples: list[Sample] = []
        self.allocator: Allocator = make_allocator(self.device)
        self._ctx = _Context()
        self._created: dict[int, Origin] = {}
        self._saved: dict[int, SavedStorage] = {}
        self._entry: dict[int, EntryStorage] = {}
        self._param_modules = {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}
        self.run = _run_info(model, optimizer)  # the plot's title: model size, stage, world size, rank
        self._exits = ExitStack()  # what __exit__ undoes: hooks, saved-tensor hooks, the dispatch mode
        self._start = 0.0
        self._active = False

    # ----- context ---------------------------------------------------------------------------------

    def __enter__(self) -> "MemoryTracker":
        if self._active or self.samples:
            raise ValueError("a memory tracker records one run; make a new one with zero.profile()")
        self._active = True
        self._start = time.perf_counter()
        self._entry = entry_storages(self.device)
        try:
            self.allocator.start()
            self._exits.callback(self.allocator.stop)
            self._install_hooks()
            self._exits.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, SavedTensor.unpack))
            self._exits.enter_context(_Creations(self))
            self.sample("start")
        except BaseException:
            self._exits.close()
            self._active = False
            raise
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.sample("end")
        finally:
            self._exits.close()  # hooks, saved-tensor hooks, the dispatch mode, the allocator's recording
            self._active = False
        try:
            self.allocator.reconcile(self.samples, list(self._entry.values()))
        except Exception:
            if exc_type is None:  # never hide the error that ended the block
                raise
        finally:
            # a finished profile keeps its numbers, not the model, the optimizer or any storage
            self.model = self.optimizer = None
            self._created.clear()
            self._saved.clear()
            self._entry.clear()

    # ----- results ----------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps taken while tracking."""
        return self._ctx.step

    @property
    def peak(self) -> Sample:
        """The sample with the allocator's highest figure, with its breakdown."""
        return peak_sample(self)

    def report(self) -> str:
        """The terminal table: categories at the peak and between steps, top labels and modules."""
        return table(self)

    def to_json(self, path: str | None = None) -> str:
        """The report and the whole timeline as JSON (written to ``path`` if given)."""
        return report_json(self, path)

    def plot(self, path: str, **title: Any) -> None:
        """Save a figure (needs matplotlib): the timeline by category over the run's phases with the peak marked,
        and each module's own bytes at the peak by category. ``title``: see :func:`zero.profiler.report.figure`."""
        plot_report(self, path, **title)

    # ----- sampling -------------------------------------------------------------------------------

    def sample(self, event: str) -> None:
        """Record live bytes now (also called by the hooks); ``event`` says what happened."""
        if not self._active:  # a hook left on a graph built inside the block, run after it
            return
        categories = dict.fromkeys(CATEGORIES, 0)
        labels: dict[str, int] = {}
        modules: dict[str, int] = {}
        by_module: dict[tuple[str, str], int] = {}
        seen: set[int] = set()
        size = self.allocator.block_size
        index = len(self.samples)

        def count_storage(storage: torch.UntypedStorage, category: str, label: str, module: str) -> None:
            key = storage._cdata
            if key in seen or storage.device != self.device:
                return
            seen.add(key)
            nbytes = size(storage.nbytes())
            if nbytes:
                categories[category] += nbytes
                labels[f"{category}/{label}"] = labels.get(f"{category}/{label}", 0) + nbytes
                modules[module] = modules.get(module, 0) + nbytes
                by_module[module, category] = by_module.get((module, category), 0) + nbytes

        with torch._C.DisableTorchFunctionSubclass():  # stage 3's sharded parameters guard their storage
            for item in self._owned():
                count_storage(storage_of(item.tensor), item.category, item.label, item.module)
            for origin in list(self._saved.values()):  # held by autograd right now
                storage = origin.ref()
                if storage is not None:
                    count_storage(storage, "activations", "saved for backward", origin.module)
            created_ptrs = set()
            for origin in list(self._created.values()):
                storage = origin.ref()
                if storage is not None:
                    created_ptrs.add(storage.data_ptr())
                    if origin.phase == "recompute":  # activation checkpointing rebuilt it for backward
                        count_storage(storage, "activations", "recomputed", origin.module)
                    else:
                        count_storage(storage, "temporaries", f"created in {origin.phase}", origin.module)
            entry_alive = 0
            for entry in self._entry.values():
                if entry.dead_at is not None:
                    continue
                storage = entry.ref()
                if storage is None or storage.data_ptr() != entry.ptr or storage.nbytes() != entry.nbytes:
                    entry.dead_at = index
                    continue
                entry_alive += entry.nbytes
                count_storage(storage, "other", "alive on entry", "")
        for label, nbytes in self.allocator.outside_tensors().items():  # (cuBLAS's workspaces on a GPU)
            categories["other"] += nbytes
            labels[f"other/{label}"] = nbytes
            modules[""] = modules.get("", 0) + nbytes
            by_module["", "other"] = by_module.get(("", "other"), 0) + nbytes
        self.allocator.mark(index)
        self.samples.append(Sample(
            index=index, time=time.perf_counter() - self._start, step=self._ctx.step, phase=self._ctx.phase,
            module=self._ctx.module, event=event, categories=categories, labels=labels, modules=modules,
            allocated=self.allocator.now(), entry_alive=entry_alive, created_ptrs=frozenset(created_ptrs),
            module_categories=by_module,
        ))

    def _owned(self) -> Iterable[MemoryItem]:
        named = getattr(self.optimizer, "named_memory", None)
        if named is not None:  # a ZeroOptimizer names its own buffers
            yield from named()
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    for leaf in tree_leaves(value):  # (a tensor, or lists of them: SOAP's per-dimension factors)
                        if isinstance(leaf, torch.Tensor):
                            yield MemoryItem("optimizer_state", key, leaf)
        for name, p in self.model.named_parameters():
            module = self._param_modules.get(id(p), "")
            yield MemoryItem("parameters", "whole", p, module)
            if p.grad is not None:
                yield MemoryItem("gradients", "whole", p.grad, module)
        for name, b in self.model.named_buffers():
            yield MemoryItem("other", "module buffers", b, name.rpartition(".")[0])

    # ----- registries -----------------------------------------------------------------------------

    def _record_created(self, out: Any) -> None:
        ctx = self._ctx
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type and t.layout == torch.strided:
                register(self._created, storage_of(t), ctx.module, ctx.phase)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type != self.device.type or isinstance(t, nn.Parameter):
            return t
        return SavedTensor(t, self._saved, self._ctx.module, self._ctx.phase)

    # ----- hooks ----------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        add = self._exits.callback
        for name, module in self.model.named_modules():
            add(module.register_forward_pre_hook(weak_hook(self._pre_forward, name)).remove)
            # always_call: a forward that raises still leaves the module
            add(module.register_forward_hook(weak_hook(self._post_forward, name), always_call=True).remove)
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                add(p.register_post_accumulate_grad_hook(weak_hook(self._on_grad, name)).remove)
        if self.optimizer is not None:
            add(self.optimizer.register_step_pre_hook(weak_hook(self._pre_step)).remove)
            add(self.optimizer.register_step_post_hook(weak_hook(self._post_step)).remove)

    def _pre_forward(self, name: str, module: nn.Module, args: Any) -> None:
        self._ctx.in_step = False  # (a step that raised never ran its post-hook)
        self._ctx.stack.append(name)
        self.sample(f"forward of {name or '<root>'} starts")

    def _post_forward(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self.sample(f"forward of {name or '<root>'} ends")
        if self._ctx.stack and self._ctx.stack[-1] == name:
            self._ctx.stack.pop()
        outputs = [t for t in tensors_in(output) or [] if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(outputs, weak_hook(self._pre_backward, name), mode="any")

    def _pre_backward(self, name: str, grad: torch.Tensor | None) -> None:
        self._ctx.backward_module = name
        self.sample(f"backward reaches {name or '<root>'}")

    def _on_grad(self, name: str, param: torch.Tensor) -> None:
        self.sample(f"gradient of {name}")

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._ctx.in_step = True
        self.sample("optimizer step starts")

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.sample("optimizer step ends")
        self._ctx.in_step = False
        self._ctx.step += 1


def _run_info(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The model's class and size, the ZeRO stage (``None``: not a ZeroOptimizer), world size and rank."""
    with torch._C.DisableTorchFunctionSubclass():  # stage 3's sharded parameters keep their whole shape
        params = sum(p.numel() for p in model.parameters())
    comm = getattr(optimizer, "comm", None) if hasattr(optimizer, "named_memory") else None
    if comm is not None:  # (with hierarchical sharding: every rank of the job, not the shard group's)
        world = comm.data_parallel_size
        rank = dist.get_rank() if comm.replicas is not None else comm.rank
    elif dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    stage = optimizer.config.stage if comm is not None else None
    return {"model": type(model).__name__, "params": params, "stage": stage, "world_size": world, "rank": rank}


def _model_device(model: nn.Module) -> torch.device:
    with torch._C.DisableTorchFunctionSubclass():
        for t in [*model.parameters(), *model.buffers()]:
            if not t.is_meta:
                return t.device
    return torch.device("cpu")


def profile(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: torch.device | str | None = None,
    every_op: bool = True,
) -> MemoryTracker:
    """Track device memory while ``model`` trains, by category, module and phase.

    Example::

        with zero.profile(model, opt) as prof:
            for x, y in batches[:3]:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        print(prof.report())          # table: categories at the peak and between steps
        prof.to_json("memory.json")   # the same and the whole timeline
        prof.plot("memory.png")       # stacked timeline and bytes per module (matplotlib)

    ``optimizer`` may be a :class:`~zero.ZeroOptimizer`, which names its own buffers, or any
    ``torch.optim`` optimizer (its ``state`` is the optimizer state). ``device`` defaults to the
    model's. ``every_op`` samples after every operator too (exact breakdown at the peak, a few
    times slower); otherwise only at module boundaries, gradients and optimizer steps. On CPU the
    allocator is read through ``torch.profiler``, so the block cannot run inside another profiler.
    """
    return MemoryTracker(model, optimizer, device=device, every_op=every_op)
