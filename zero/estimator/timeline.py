"""The estimator's trace: one forward and backward of the user's own loss on fake tensors, live bytes
after every operator.

Under ``FakeTensorMode`` tensors have shapes, dtypes, a device and storages of the right size, but no
data, and operators take the same kernels (so the same saved tensors) as on the real device. The model
is built, cast and (optionally) activation-checkpointed there, then ``loss_fn(model, *batch)`` runs and
``loss.backward()`` follows, with every ``p.grad`` ``None`` at the start, as ZeRO stages 2-3 leave them.

:class:`Recorder` keeps a running count of the bytes of every storage the step creates, by kind, and
writes a :class:`Point` after every operator and at every module boundary, backward reaching a module
and gradient arriving:

* ``activations``: storages autograd holds for backward (saved tensors, released as backward uses them);
* ``gradients``: what autograd put in ``p.grad``;
* ``temporaries``: every other storage created since the step began (operator outputs and workspaces,
  the loss path's copies, a tied weight's gradient contributions being added, ...).

What a kernel allocates inside itself and frees before it returns (the CPU convolution's blocked copies and
unfolded columns, the CPU bf16 matmul's scratchpad) has no storage here: :mod:`zero.estimator.workspaces` prices it
from the operator's arguments, and an operator it prices gets a point of its own just before its usual one, its
workspace counted in ``temporaries`` (the kernel's highest point). What it does not price (oneDNN's smaller
convolution scratchpads, CUDA libraries' workspaces, operators not in its table) the estimate does not see.

Parameters, buffers and the batch existed before and are not counted (the estimator prices them). On a CPU run the
CPU generator's state that activation checkpointing keeps per checkpointed call is counted (a real tensor, made outside
the fake mode).
The counts are kept incrementally (weak references on the storages): the same figures
``zero.profile`` reports at a sample, without walking every storage after every operator.

The stages' own buffers are not here: :mod:`zero.estimator.schedule` replays this timeline with each
stage's buffer schedule.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import _sharding_prop
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from zero.estimator.workspaces import workspace_bytes
from zero.memory import storage_of
from zero.outputs import tensors_in
from zero.runtime.gathering.post_backward import hook_input_gradients

KINDS = ("activations", "temporaries", "gradients")
_SHARDING_PROPAGATION = _sharding_prop.__file__


@dataclass(frozen=True)
class Point:
    """Live bytes of the traced step right after something happened."""

    phase: str  # "forward" or "backward"
    kind: str  # "op", "enter" / "leave" (a module's forward), "hooked" (its inputs need gradients), "reach"
    # (backward reaches a module), "done" (backward computed its inputs' gradients), "grad"
    name: str  # the operator, the module or the parameter
    module: str  # the innermost module running (forward) or last reached (backward)
    activations: int
    temporaries: int
    gradients: int
    outputs: str = ""  # "leave" in forward: how stage 3 ends the forward (zero.runtime.gathering.gather_order.Outputs)

    @property
    def total(self) -> int:
        return self.activations + self.temporaries + self.gradients


@dataclass(frozen=True)
class Timeline:
    """One traced forward and backward (see the module docstring)."""

    points: list[Point]
    grad_bytes: dict[str, int]  # each trainable parameter's gradient, by name
    micro_batch: int = 0  # the batch's size, when known (Workload sets it)
    outputs: int = 0  # a pipeline part's: bytes of the model's output (what the schedule sends on, or keeps)
    input_grads: int = 0  # ... and of the gradients of its inputs (what it sends back to the part before)

    def aligned(self, other: "Timeline") -> bool:
        """Whether both traces went through the same steps (operators, modules, gradients) in the same order."""
        return self.grad_bytes == other.grad_bytes and len(self.points) == len(other.points) and all(
            (a.phase, a.kind, a.name, a.module) == (b.phase, b.kind, b.name, b.module)
            for a, b in zip(self.points, other.points)
        )

    def extrapolate(self, following: "Timeline", micro_batch: int) -> "Timeline":
        """``micro_batch``'s timeline from this one and ``following``, traced at the next micro-batch and aligned."""
        assert self.micro_batch and following.micro_batch == self.micro_batch + 1

        def at(a: int, b: int) -> int:
            return a + (b - a) * (micro_batch - self.micro_batch)

        points = [
            replace(p, activations=at(p.activations, q.activations), temporaries=at(p.temporaries, q.temporaries),
                    gradients=at(p.gradients, q.gradients))
            for p, q in zip(self.points, following.points)
        ]
        return Timeline(points, dict(self.grad_bytes), micro_batch, at(self.outputs, following.outputs),
                        at(self.input_grads, following.input_grads))

    def without_gradients(self, names: frozenset[str]) -> "Timeline":
        """This step had the parameters ``names`` got no gradient (an MoE's expert given no tokens): their gradients
        never arrive and are never held (what computing them would allocate is kept, an over-count)."""
        points, missing = [], 0
        for p in self.points:
            if p.kind == "grad" and p.name in names:
                missing += self.grad_bytes[p.name]
                continue
            points.append(replace(p, gradients=p.gradients - missing) if missing else p)
        grads = {name: nbytes for name, nbytes in self.grad_bytes.items() if name not in names}
        return replace(self, points=points, grad_bytes=grads)


class _Storage:
    __slots__ = ("nbytes", "kind", "saved")

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.kind, self.saved = nbytes, "temporaries", 0


class Recorder(TorchDispatchMode):
    """Live bytes by kind, updated as storages are created, saved, made gradients and freed."""

    def __init__(self, model: nn.Module, existing: Any = ()) -> None:
        super().__init__()
        self.model = model
        self.live: dict[int, _Storage] = {}
        self.totals = dict.fromkeys(KINDS, 0)
        self.points: list[Point] = []
        self.stack: list[str] = []
        self.reached = ""
        self.input_hooks: list[Any] = []  # each module call's (removed with the module hooks)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.tensor_parallel = any(is_traceable_wrapper_subclass(p) for p in model.parameters())  # (DTensors)
        self._refs: list[weakref.ref] = []
        # storages that exist already (an in-place operator returns them): parameters, buffers, the batch, ...
        known = [*model.parameters(), *model.buffers(), *tree_leaves(existing)]
        self._known = {self._key(t) for t in known if isinstance(t, torch.Tensor)}

    # ----- bookkeeping -----------------------------------------------------------------------------

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return storage_of(t)._cdata

    def _move(self, entry: _Storage, kind: str) -> None:
        self.totals[entry.kind] -= entry.nbytes
        self.totals[kind] += entry.nbytes
        entry.kind = kind

    def _created(self, t: torch.Tensor) -> None:
        storage = storage_of(t)
        key = storage._cdata
        if key in self.live or key in self._known:
            return
        entry = self.live[key] = _Storage(storage.nbytes())
        self.totals[entry.kind] += entry.nbytes

        def freed(_ref: weakref.ref, key: int = key, entry: _Storage = entry) -> None:
            if self.live.get(key) is entry:
                del self.live[key]
                self.totals[entry.kind] -= entry.nbytes

        self._refs.append(weakref.ref(storage, freed))

    def point(self, kind: str, name: str, outputs: str = "", workspace: int = 0) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        module = self.stack[-1] if self.stack else (self.reached if phase == "backward" else "")
        t = self.totals
        self.points.append(Point(phase, kind, name, module, t["activations"], t["temporaries"] + workspace,
                                 t["gradients"], outputs))

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t`` (a real tensor made outside the fake mode) as held for backward while it lives."""
        self._created(t)
        entry = self.live.get(self._key(t))
        if entry is not None and entry.kind == "temporaries":
            self._move(entry, "activations")

    def forget(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as existing before the step (a pipeline's receive buffer, priced apart)."""
        entry = self.live.pop(self._key(t), None)
        if entry is not None:
            self.totals[entry.kind] -= entry.nbytes
        self._known.add(self._key(t))

    # ----- what autograd saves ------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        entry = self.live.get(self._key(t))
        if entry is None:  # a parameter, a buffer or the batch
            return t
        return _Saved(self, entry, t)

    # ----- operators --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.tensor_parallel:
            if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs))):
                return NotImplemented  # a DTensor's operator: DTensor runs it, its local operators are recorded
            if _propagating_layouts():  # (global-shape fake tensors, fake at run time too: nothing held)
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._created(t)
        workspace = workspace_bytes(func, args, kwargs, out)
        if workspace is not None:  # inside the kernel: its outputs and its workspace (a point even at 0: traces align)
            self.point("op", func.overloadpacket.__name__, workspace=workspace)
        self.point("op", func.overloadpacket.__name__)
        return out

    # ----- hooks ------------------------------------------------------------------------------------

    def hooks(self) -> list[Any]:
        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave(name), always_call=True))
        for p in self.model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(self._grad))
        return handles

    def _enter(self, name: str) -> Callable:
        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(name)
            self.point("enter", name)
            if torch._C._current_graph_task_id() != -1:  # recomputed in backward: stage 3 hooks nothing
                return
            hook = hook_input_gradients(args, kwargs, lambda: self.point("done", name))
            if hook is not None:
                self.input_hooks.append(hook)
                self.point("hooked", name)

        return enter

    def _leave(self, name: str) -> Callable:
        def leave(module: nn.Module, args: Any, output: Any) -> None:
            tensors = tensors_in(output)
            outputs = [t for t in tensors or [] if t.requires_grad]
            grad = torch.is_grad_enabled()  # (as stage 3's forward hook tells its schedule)
            self.point("leave", name, "no_grad" if not grad else "unseen" if tensors is None else
                       "hooked" if outputs else "none")
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if outputs and grad:
                torch.autograd.graph.register_multi_grad_hook(outputs, self._reach(name), mode="any")

        return leave

    def _reach(self, name: str) -> Callable:
        def reach(grad: Any) -> None:
            self.reached = name
            self.point("reach", name)

        return reach

    def _grad(self, p: torch.Tensor) -> None:
        entry = self.live.get(self._key(p.grad))
        if entry is not None and entry.kind != "gradients":
            self._move(entry, "gradients")
        self.point("grad", self.names[id(p)])


class _Saved:
    """What autograd keeps for a saved tensor: while any is held, its storage counts as activations."""

    __slots__ = ("recorder", "entry", "tensor")

    def __init__(self, recorder: Recorder, entry: _Storage, tensor: torch.Tensor) -> None:
        self.recorder, self.entry, self.tensor = recorder, entry, tensor.detach()
        entry.saved += 1
        if entry.saved == 1 and entry.kind == "temporaries":
            recorder._move(entry, "activations")

    def __del__(self) -> None:
        self.entry.saved -= 1
        if self.entry.saved == 0 and self.entry.kind == "activations":
            self.recorder._move(self.entry, "temporaries")


def _propagating_layouts() -> bool:
    """Whether DTensor's sharding propagation is running: it derives an operator's output layout by running it on
    fake tensors of the global shapes (once per input layouts, then cached), which hold nothing at run time."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == _SHARDING_PROPAGATION:
            return True
        frame = frame.f_back
    return False


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


NO_BACKWARD_IN_LOSS = (
    "the loss function runs a backward pass of its own (torch.autograd.grad inside it: a gradient penalty, double "
    "backward), which the estimator does not price: the graph that pass builds, and the parameters stage 3 then "
    "keeps gathered until the backward through it, are not in its trace. Estimate the step without the penalty "
    "(the estimate is then low by those bytes: at stage 3 up to every unit gathered at once), or measure the step "
    "with zero.profile."
)


@contextmanager
def _rng_states(recorder: Recorder, model: nn.Module) -> Iterator[None]:
    """torch's checkpointing keeps the CPU generator's state (``torch.get_rng_state()``, 5056 bytes) per checkpointed
    call until backward has recomputed it: a real tensor, outside the fake mode, in the device's memory on a CPU run
    (on a GPU, in host memory: not counted)."""
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "cpu":
        yield
        return
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        recorder.hold(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def record_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, batch: tuple, *,
                output_gradient: bool = False, keep_output: bool = False) -> Timeline:
    """Run ``loss_fn(model, *batch).backward()`` (all fake) under a :class:`Recorder`.

    A pipeline part (:mod:`zero.estimator.pipeline`): with ``output_gradient`` (``loss_fn`` is ``None``) backward runs
    from a gradient of the part's output, of its shape (the stage's receive buffer: not counted), as torch's stage runs
    every part but the last; with ``keep_output`` the model's output is kept to the end, as the last part's schedule
    keeps each micro-batch's output. Gradients reaching the batch (a part's input activation) are kept."""
    recorder = Recorder(model, existing=batch)
    handles = recorder.hooks()
    kept: list[Any] = []
    if output_gradient or keep_output:
        handles.append(model.register_forward_hook(lambda module, args, out: kept.append(out)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack), recorder, _rng_states(recorder, model):
            loss = loss_fn(model, *batch) if loss_fn is not None else model(*batch)
            output = sum(storage_of(t).nbytes() for t in tree_leaves(kept[-1:]) if isinstance(t, torch.Tensor))
            if output_gradient:
                outputs = [t for t in tree_leaves(loss) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    raise ValueError("the pipeline part's output has no gradient (no parameter requires grad, or it "
                                     "was detached)")
                before = len(recorder.points)
                grads = [torch.zeros_like(t) for t in outputs]
                for g in grads:
                    recorder.forget(g)
                del recorder.points[before:]
            elif not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"the loss function must return the scalar loss tensor, got "
                    f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
                )
            elif loss.grad_fn is None:
                raise ValueError("the loss has no gradient (no parameter requires grad, or it was detached)")
            if any(point.phase == "backward" for point in recorder.points):
                raise ValueError(NO_BACKWARD_IN_LOSS)
            if output_gradient:
                torch.autograd.backward(outputs, grads)
                del outputs, grads
            else:
                loss.backward()
            del loss
            if not keep_output:
                kept.clear()
            recorder.point("op", "<end of backward>")
    finally:
        for handle in [*handles, *recorder.input_hooks]:
            handle.remove()
    grads = {name: storage_of(p.grad).nbytes() for name, p in model.named_parameters() if p.grad is not None}
    return Timeline(recorder.points, grads, outputs=output,
                    input_grads=sum(storage_of(t.grad).nbytes() for t in tree_leaves(batch)
                                    if isinstance(t, torch.Tensor) and t.grad is not None))
