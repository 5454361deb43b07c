"""Stage 3's parameter gathering: module hooks, prefetch and the gathered working set.

Life of one unit in a training step (``reshard_after_forward=True``)::

    forward pre-hook   release the unit that ran before; unshard (all-gather, unless prefetched),
                       wait; prefetch the next unit(s)
    forward hook       mark for release (the root unit excepted); hook the outputs so that the
                       first gradient reaching them ...
    pre-backward       ... unshards the unit again (and prefetches the next one in backward order)
    backward done      reshard, once both its inputs' gradients are computed (every forward call's)
                       and its trainable parameters' gradients have arrived (they go on to the
                       reducer as at stage 2)
    end of backward    reshard whatever is still gathered (units with unused parameters)

The decisions (which unit to gather, prefetch or release, and when) are the schedule's,
``zero.runtime.gathering.gather_order.GatherOrder``, which the estimator drives too when it prices a traced
step: this module hooks the model, tells the schedule what happened, and carries its decisions
out with all-gathers (:class:`AllGathers`).

The unit's backward is over only when autograd has computed the gradient of its forward inputs
(see ``zero.runtime.gathering.post_backward``): frozen weights are read until then, e.g. a frozen base under
LoRA adapters, whose last adapter gradient arrives before the frozen weight carries the gradient
back to the adapters of earlier units. A forward whose inputs need no gradient (the first unit)
ends its backward with its last parameter gradient: nothing it holds is read after that.

Releasing a unit after its forward waits until the next unit starts (the working set while a
unit computes is the same), so the unit that runs last in forward, which backward needs
first, goes straight into backward without being gathered again; so does the root unit.

Prefetch follows the order in which units ran on the previous forward (backward) pass, so
the first step gathers on demand. Every rank must run the same units in the same order
(collectives are matched by order): the sequence of gathers is folded into a fingerprint
that the reducer compares across ranks at the end of each backward, so a model whose
ranks take different paths fails with an error naming the problem rather than training
on mismatched parameters. Sooner than that, each rank compares every forward's units with its
first forward's (locally, for free): the rank whose order changes warns at once, naming the
unit, and a gather that then fails or times out repeats it in its error.

A parameter of a released unit can never be read by accident: backward's saved references to
its parameters are checked when autograd unpacks them (``zero.runtime.gathering.saved_params``), and any
other use is refused by ``ZeroParameter``.

Without gradients (``torch.no_grad()`` inference) a unit is always released after its forward,
and every unit when the root's forward ends. During backward a unit's forward may run again
(activation checkpointing): it is gathered if needed and left to backward to release. A
forward or backward interrupted by an error leaves no stale state: the next pass starts clean.
A unit whose output is an object this module cannot look into (neither tensors nor
tuples, lists, dicts or dataclasses of them) stays gathered until its backward ends.

A backward pass with ``create_graph=True`` (a gradient penalty: ``torch.autograd.grad(out, x,
create_graph=True)``, then a backward through the penalty) records a graph that reads the parameters
of every unit it passes through: the schedule then releases nothing until the backward pass through
that graph ends (or the step), so the units it gathered stay whole in between.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero.comm.communicator import Communicator, Handle
from zero.outputs import tensors_in
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.units import UnitSpec
from zero.runtime.gathering.backward_pass import BackwardPass
from zero.runtime.gathering.gather_order import GatherOrder, UnitProgress, UnitState
from zero.runtime.gathering.post_backward import hook_input_gradients
from zero.runtime.gathering.saved_params import SavedParamCheck
from zero.runtime.gathering.secondary import PrimaryShards
from zero.runtime.stages.stage3 import Stage3
from zero.weak import weak_hook

_FINGERPRINT_MOD = 2**31 - 1


class Unit:
    """One unit at run time: its buckets, its gathers in flight and, from the schedule, where it is in the step."""

    def __init__(self, index: int, spec: UnitSpec, buckets: list[Bucket]):
        self.index = index
        self.name = spec.name or "<root>"
        self.module = spec.module
        self.buckets = buckets
        self.num_params = sum(len(b.slots) for b in buckets if b.trainable)  # those that get gradients
        self.handles: list[Handle] = []
        self.input_hooks: list[RemovableHandle] = []  # its inputs' gradient hooks, removed when backward is over
        # The root unit's backward starts as soon as its forward ends, so it is never released in
        # between (FSDP2 does the same): regathering it at once would only cost traffic.
        self.is_root = spec.name == ""
        self.progress = UnitProgress(self.num_params, self.is_root)  # (the schedule's own, once it is built)

    def __repr__(self) -> str:
        return f"unit {self.name!r}"

    @property
    def state(self) -> UnitState:
        return self.progress.state

    def is_gathered(self) -> bool:
        return self.state is UnitState.GATHERED


class AllGathers:
    """Carries out the schedule's decisions (``zero.runtime.gathering.gather_order.Gathers``) with all-gathers."""

    def __init__(self, stage: Stage3, comm: Communicator, source: PrimaryShards):
        self.stage = stage
        self.comm = comm
        self.source = source  # where each gather reads (hpZ: backward's from secondary copies)
        self.fingerprint = 0  # the gathers issued since the reducer last read it
        self.divergence: str | None = None  # how this rank's unit order first left the first pass's

    def start(self, unit: Unit, *, from_copies: bool, exact: bool) -> None:
        unit.handles = [self.source.unshard(self.stage, bucket, self.comm, exact=exact, from_copies=from_copies)
                        for bucket in unit.buckets]
        self.fingerprint = (self.fingerprint * 1_000_003 + unit.index + 1) % _FINGERPRINT_MOD

    def wait(self, unit: Unit) -> None:
        for handle in unit.handles:
            try:
                handle.wait()
            except RuntimeError as err:
                if self.divergence is None:
                    raise
                raise RuntimeError(f"{err}\nzero: {self.divergence}") from err
        unit.handles = []
        for bucket in unit.buckets:
            self.source.gathered(bucket)
            self.stage.attach(bucket)

    def release(self, unit: Unit) -> None:
        for bucket in unit.buckets:
            self.stage.reshard(bucket)

    def diverged(self, position: int, ran: Unit | None, first: Unit | None) -> None:
        """A rank that runs other units than its peers pairs its all-gathers with theirs: say so now, on the rank
        that diverged, and again in the error of the collective that then fails or times out."""
        self.divergence = (
            f"rank {self.comm.rank} ran {ran or 'no unit'} as unit #{position} of a forward pass, where its first "
            f"forward pass ran {first or 'no unit'}. If other ranks kept the first order, this rank's all-gathers "
            "no longer match theirs (collectives pair up by order): the next one fails or times out, or the "
            "end-of-backward check reports it. Every rank must run the same units in the same order (no branch "
            "or loop count that depends on a rank's data)."
        )
        warnings.warn(f"zero: {self.divergence}", stacklevel=6)


class ParamGatherer:
    """Registers stage 3's module and gradient hooks; its schedule (``self.order``) gathers units just in time."""

    sharded = True

    def __init__(
        self,
        specs: list[UnitSpec],
        buckets: list[Bucket],
        stage: Stage3,
        comm: Communicator,
        *,
        reshard_after_forward: bool,
        prefetch: int,
        source: PrimaryShards | None = None,
    ):
        self.units = [Unit(i, spec, [b for b in buckets if b.unit is spec]) for i, spec in enumerate(specs)]
        self.gathers = AllGathers(stage, comm, source or PrimaryShards())
        root = next((unit for unit in self.units if unit.is_root), None)
        self.order = GatherOrder(self.units, [unit.num_params for unit in self.units], root, self.gathers,
                                 prefetch=prefetch, reshard_after_forward=reshard_after_forward)
        for unit in self.units:
            unit.progress = self.order.progress[unit]
        self._pass = BackwardPass()
        self._saved_check = SavedParamCheck(weak_hook(self._units_of_storage))
        self.hooks = []
        for unit in self.units:
            # Under torch.compile the hooks run eagerly (a graph break each): they gather, release and
            # prefetch, which dynamo cannot trace; the unit's forward between them compiles as usual.
            pre = torch.compiler.disable(weak_hook(self._pre_forward, unit.index))
            post = torch.compiler.disable(weak_hook(self._post_forward, unit.index))
            self.hooks.append(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self.hooks.append(unit.module.register_forward_hook(post))
            done = torch.compiler.disable(weak_hook(self._forward_done))
            self.hooks.append(unit.module.register_forward_hook(done, always_call=True))
            for bucket in unit.buckets:
                for slot in bucket.slots if bucket.trainable else []:
                    hook = weak_hook(self._on_grad, unit.index, slot.name)
                    self.hooks.append(slot.param.register_post_accumulate_grad_hook(hook))

    @property
    def source(self) -> PrimaryShards:
        """Where each gather reads (hpZ: backward's from secondary copies)."""
        return self.gathers.source

    # ----- unshard / reshard ------------------------------------------------------------------------

    def forget(self, unit: Unit) -> None:
        """The shards of ``unit`` were written (``gathered_parameters()``): no copy of them is current."""
        self.order.forget(unit)

    def unshard(self, unit: Unit, *, exact: bool = False) -> None:
        """Start gathering ``unit`` (no-op unless sharded); ``exact``: never through a lossy codec."""
        self.order.gather(unit, backward=_in_backward(), exact=exact)

    def wait(self, unit: Unit) -> None:
        """Make ``unit`` usable: gather it if needed and wait for the gather."""
        self.order.wait(unit, backward=_in_backward())

    def reshard(self, unit: Unit) -> None:
        self.order.release(unit)

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """``False``: a unit backward reaches stays gathered until the step (``GatherOrder.reshard_after_backward``)."""
        self.order.reshard_after_backward = reshard

    def reshard_all(self, keep: list[Unit] = ()) -> None:
        """Release every unit (but ``keep``) and forget any pass in progress (also one interrupted by an error)."""
        self._forget_pass()
        self.order.release_all(keep)

    def _forget_pass(self) -> None:
        self._pass.forget()
        for unit in self.units:
            for hook in unit.input_hooks:  # (a leaf input would keep them)
                hook.remove()
            unit.input_hooks = []

    @property
    def in_forward(self) -> bool:
        return self.order.depth > 0

    def gathering_buckets(self) -> set[Bucket]:
        """Buckets whose all-gather is in flight (prefetched units not yet needed, among them)."""
        return {b for u in self.units if u.state is UnitState.GATHERING for b in u.buckets}

    def units_of(self, params: Iterable[nn.Parameter]) -> list[Unit]:
        """The units holding any of ``params``, in unit order."""
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(s.param) in wanted for b in u.buckets for s in b.slots)]

    def fingerprint_flags(self) -> list[int]:
        """A hash of the gathers issued since the last call (same on every rank if they ran the same units), as
        ``[v, -v]`` for the reduction's MAX all-reduce: both come back as ``(v, -v)`` only if every rank had ``v``."""
        value, self.gathers.fingerprint = self.gathers.fingerprint, 0
        return [value, -value]

    @staticmethod
    def fingerprints_agree(agreed: list[int]) -> bool:
        """Whether the all-reduced :meth:`fingerprint_flags` show the same gathers on every rank."""
        return agreed[0] == -agreed[1]

    # ----- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        unit = self.units[index]
        functorch = _in_functorch()
        self._saved_check.enter(torch.is_grad_enabled() and not _in_backward() and not functorch)
        if functorch:
            raise RuntimeError(_NO_FUNCTORCH)
        if _in_backward():  # recomputation (activation checkpointing): backward releases it
            self.order.recompute(unit)
            return
        self.order.pre_forward(unit)
        hook = hook_input_gradients(args, kwargs, weak_hook(self._inputs_done, unit.index))
        if hook is not None:
            self.order.inputs_hooked(unit)
            unit.input_hooks.append(hook)

    def _post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        unit = self.units[index]
        if _in_backward():
            return
        if not torch.is_grad_enabled():  # no backward will come
            self.order.post_forward(unit, "no_grad")
            return
        tensors = tensors_in(output)
        if tensors is None:  # cannot see the outputs, so cannot hook them: keep it for backward
            self.order.post_forward(unit, "unseen")
            return
        needs_grad = [t for t in tensors if t.requires_grad]
        if needs_grad:
            hook = weak_hook(self._pre_backward, unit.index)
            torch.autograd.graph.register_multi_grad_hook(needs_grad, hook, mode="any")
        self.order.post_forward(unit, "hooked" if needs_grad else "none")

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        """After every unit forward, also one that raised: remove the saved-tensor check it installed."""
        self._saved_check.exit()

    def _units_of_storage(self) -> dict[int, Unit]:
        """The unit of each parameter buffer's storage (the saved-tensor check's lookup)."""
        return {b.param_buffer.storage_tensor.untyped_storage()._cdata: u for u in self.units for b in u.buckets}

    # ----- backward ---------------------------------------------------------------------------------

    def _pre_backward(self, index: int, grad: torch.Tensor | None) -> None:
        unit = self.units[index]
        if not self._pass.running:  # the first hook of a new backward pass (a nested one runs inside it)
            if self._pass.interrupted:  # the previous one died with an error
                self._forget_pass()
                self.order.backward_interrupted()
            self._pass.begin(weak_hook(self._end_backward))
        self.order.pre_backward(unit, builds_graph=torch.is_grad_enabled())  # (autograd's grad mode: create_graph)

    def _inputs_done(self, index: int) -> None:
        """Autograd computed the gradients of one forward call's inputs: that call's backward is over."""
        self.order.inputs_done(self.units[index])

    def _on_grad(self, index: int, name: str, param: torch.Tensor) -> None:
        unit = self.units[index]
        if unit.state is not UnitState.GATHERED:
            raise RuntimeError(
                f"zero: the gradient of {name!r} was computed while {unit} was not gathered: backward reached "
                "its parameters without passing through the outputs of its forward (a tensor kept on the side "
                "and used later?). Return such tensors from the unit's forward, or choose units "
                "(ZeroConfig.unit_classes) so that the code using them is inside the unit."
            )
        self.order.grad_arrived(unit)

    def _end_backward(self) -> None:
        """Release every unit but the root, which stays gathered until ``step()`` (``GatherOrder.end_backward``)."""
        self._forget_pass()
        self.order.end_backward()


_NO_FUNCTORCH = (
    "zero: a torch.func transform (grad, vjp, jacrev, vmap, ...) ran a stage-3 model: its backward does not pass "
    "through the hooks that gather each unit's parameters, so it would read released ones. Use stage 0, 1 or 2 "
    "(parameters are whole there, and torch.func works), or load `model.state_dict()` taken inside "
    "`opt.gathered_parameters()` into a plain copy of the model and apply torch.func to that copy."
)


def _in_functorch() -> bool:
    """Whether a ``torch.func`` transform is running."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _in_backward() -> bool:
    """Whether this thread is running an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1
