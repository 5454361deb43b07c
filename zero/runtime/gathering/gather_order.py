"""Stage 3's gathering schedule, one object shared by the gatherer (``zero.runtime.gathering.gatherer``) and the
estimator's replay of a traced step (``zero.estimator.gathering``), so that what is priced is what runs (as
``zero.runtime.reduction.reduction_order`` is for reductions).

:class:`GatherOrder` is told what happens (a unit's forward starts or ends, backward reaches it, its inputs'
gradients are computed, a parameter's gradient arrives, backward ends, the step) and decides which unit is gathered,
waited for or released; it keeps each unit's progress and runs no collective. Its caller carries the decisions out
(:class:`Gathers`): the gatherer with all-gathers, the estimator with byte accounting.

* a unit's forward starts: the unit that ran before it is released (``reshard_after_forward``), this one is gathered
  and waited for, and the ``prefetch`` units that followed it in the previous forward pass start gathering (if this
  pass has run the same units so far; the first pass gathers on demand). The root unit starts a new pass (without
  one, every outermost unit does);
* its forward ends: with gradients to come, it is released when the next unit starts (not the root: its backward
  starts as soon as forward ends); with none (grad mode off, or no output needs a gradient) at once, and the root's
  end under grad mode off releases every unit; outputs it cannot look into keep it until the end of backward;
* its forward runs again inside backward (activation checkpointing): gathered and waited for, left to backward;
* backward reaches it (the first time in the pass): gathered and waited for, and the ``prefetch`` units that
  followed it in the previous backward pass start gathering;
* its backward is over, i.e. every forward call's inputs' gradients are computed and every trainable parameter's
  gradient arrived: released (not the root);
* the end of backward: every unit but the root is released (and everything's progress forgotten); the root stays
  gathered until the step (:meth:`GatherOrder.release_all`);
* a backward pass that builds a graph (``create_graph=True``: a gradient penalty, double backward): the graph it
  builds reads the parameters of every unit it passes through, so from its first unit on nothing is released, in
  forward or backward, until a backward pass that builds no graph (the one through the penalty) ends, or the step;
* ``reshard_after_backward=False`` (pipelining, FSDP2's switch): a unit that backward reaches stays gathered until
  the step, through the step's later micro-batches (their forwards and backwards gather nothing more for it);
* hpZ's secondary copies: a unit's copy is *current* once a gather of it has completed, until every unit is released
  or its shards are written (:meth:`GatherOrder.forget`); a gather that backward issues (not an exact one) for a
  unit whose copy is current reads the copies (``zero.runtime.gathering.secondary``).

Every forward pass's units are compared with the first pass's (with a root unit): the first position where they
differ is reported once (:meth:`Gathers.diverged`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, Hashable, Iterable, Literal, Protocol, Sequence, TypeVar

U = TypeVar("U", bound=Hashable)  # a unit: the gatherer's Unit, or the estimator's unit name

Outputs = Literal["hooked", "none", "unseen", "no_grad"]
"""How a unit's forward ended: its outputs hooked for backward, none of them needing a gradient, outputs that cannot
be looked into (neither tensors nor containers of them), or grad mode off (no backward will come)."""


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather in flight
    GATHERED = "gathered"


@dataclass(eq=False)
class UnitProgress:
    """Where one unit is in the step."""

    num_params: int  # its trainable parameters (those that get gradients)
    is_root: bool
    state: UnitState = UnitState.SHARDED
    in_backward: bool = False  # between its pre-backward and the end of its backward
    num_grads: int = 0  # parameters whose gradient arrived in this backward pass
    pending_inputs: int = 0  # forward calls whose inputs' gradients backward has not computed yet

    def forget(self) -> None:
        self.in_backward, self.num_grads, self.pending_inputs = False, 0, 0


class Gathers(Protocol[U]):
    """What carries out :class:`GatherOrder`'s decisions."""

    def start(self, unit: U, *, from_copies: bool, exact: bool) -> None:
        """Start gathering ``unit`` (it was sharded); ``from_copies``: from hpZ's secondary copies; ``exact``:
        never through a lossy codec."""

    def wait(self, unit: U) -> None:
        """Wait for ``unit``'s gather (started): the unit becomes usable."""

    def release(self, unit: U) -> None:
        """Release ``unit`` (gathered and waited for)."""

    def diverged(self, position: int, ran: U | None, first: U | None) -> None:
        """This forward pass ran ``ran`` as unit #``position`` where the first pass ran ``first`` (``None``: none)."""


class GatherOrder(Generic[U]):
    """Stage 3's gathering decisions (see the module docstring), carried out by ``gathers``."""

    def __init__(self, units: Sequence[U], num_params: Sequence[int], root: U | None, gathers: Gathers[U], *,
                 prefetch: int, reshard_after_forward: bool = True):
        self.units = list(units)
        self.progress = {u: UnitProgress(n, root is not None and u == root) for u, n in zip(units, num_params)}
        self.has_root = root is not None
        self.gathers = gathers
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.depth = 0  # units whose forward is running (nested)
        self.finished: U | None = None  # ran its forward; released when the next unit starts
        self.forward_order: list[U] = []
        self.previous_forward: list[U] = []
        self.first_forward: list[U] | None = None  # the order every later forward is checked against
        self.diverged = False  # a forward's order left the first pass's (reported once)
        self.backward_order: list[U] = []
        self.previous_backward: list[U] = []
        self.current: set[U] = set()  # units whose secondary copy is current (hpZ)
        self.held = False  # a backward pass built a graph that reads gathered parameters: release nothing
        self.building = False  # the backward pass running builds a graph
        self.reshard_after_backward = True  # False: a unit gathered for backward stays so until the step (pipelining)
        self.kept: set[U] = set()  # units so kept

    # ----- gather, wait, release ----------------------------------------------------------------------

    def state(self, unit: U) -> UnitState:
        return self.progress[unit].state

    def gather(self, unit: U, *, backward: bool, exact: bool = False) -> None:
        """Start gathering ``unit`` unless it is gathered or gathering; ``backward``: autograd's backward runs."""
        progress = self.progress[unit]
        if progress.state is not UnitState.SHARDED:
            return
        self.gathers.start(unit, from_copies=backward and not exact and unit in self.current, exact=exact)
        progress.state = UnitState.GATHERING

    def wait(self, unit: U, *, backward: bool) -> None:
        """Make ``unit`` usable: gather it if needed and wait for the gather."""
        self.gather(unit, backward=backward)
        progress = self.progress[unit]
        if progress.state is UnitState.GATHERING:
            self.gathers.wait(unit)
            progress.state = UnitState.GATHERED
            self.current.add(unit)  # (a gather from the copies leaves them current)

    def release(self, unit: U) -> None:
        progress = self.progress[unit]
        if progress.state is UnitState.SHARDED or self.held or unit in self.kept:
            return
        self.wait(unit, backward=False)  # never release a buffer a collective is still writing
        self.gathers.release(unit)
        progress.state = UnitState.SHARDED

    def forget(self, unit: U) -> None:
        """``unit``'s shards were written: its secondary copy is no longer current."""
        self.current.discard(unit)

    def release_all(self, keep: Iterable[U] = (), *, kept_too: bool = True) -> None:
        """Release every unit (but ``keep``, and unless ``kept_too`` those kept after backward) and forget any pass in
        progress (the step, the end of backward, a pass interrupted by an error); no copy stays current but those
        gathered again now (a gather in flight)."""
        keep = list(keep)
        if kept_too:
            self.kept.clear()
        self.held = self.building = False
        self.depth = 0
        self.finished = None
        self.current.clear()
        for unit in self.units:
            if unit not in keep:
                self.release(unit)
            self.progress[unit].forget()

    # ----- forward ------------------------------------------------------------------------------------

    def pre_forward(self, unit: U) -> None:
        """``unit``'s forward starts (outside backward)."""
        if self.progress[unit].is_root:
            self.depth = 0  # (a forward interrupted by an error never came back out)
        if self.depth == 0:  # a new forward pass starts
            if self.forward_order:
                self.previous_forward = self.forward_order
                self._check_order(len(self.forward_order), ended=True)
                if self.first_forward is None:
                    self.first_forward = self.forward_order
            self.forward_order = []
        self._release_finished(keep=unit)
        self.depth += 1
        self.forward_order.append(unit)
        self._check_order(len(self.forward_order) - 1, ended=False)
        self.wait(unit, backward=False)
        self._prefetch(self.forward_order, self.previous_forward, backward=False)

    def inputs_hooked(self, unit: U) -> None:
        """A forward call of ``unit`` has inputs whose gradients backward will compute (:meth:`inputs_done`)."""
        self.progress[unit].pending_inputs += 1

    def recompute(self, unit: U) -> None:
        """``unit``'s forward runs inside backward (activation checkpointing): backward releases it."""
        self.wait(unit, backward=True)

    def post_forward(self, unit: U, outputs: Outputs) -> None:
        """``unit``'s forward ended (outside backward); ``outputs``: see :data:`Outputs`."""
        self.depth = max(0, self.depth - 1)
        progress = self.progress[unit]
        if outputs == "no_grad":  # no backward will come
            self.release(unit)
            if progress.is_root:  # also units prefetched but not used
                for other in self.units:
                    if not self.progress[other].in_backward:
                        self.release(other)
        elif outputs == "none":
            self.release(unit)
        elif outputs == "hooked" and self.reshard_after_forward and not progress.is_root:
            self._release_finished(keep=unit)
            self.finished = unit
        # ("unseen": kept for backward, which releases it at its end)

    def _release_finished(self, keep: U) -> None:
        finished, self.finished = self.finished, None
        if finished is not None and finished != keep and not self.progress[finished].in_backward:
            self.release(finished)

    def _prefetch(self, order: list[U], previous: list[U], *, backward: bool) -> None:
        """Start gathering the units that followed this one last time (if the order still matches)."""
        position = len(order)
        if self.prefetch == 0 or len(previous) < position or previous[position - 1] != order[-1]:
            return
        for unit in previous[position : position + self.prefetch]:
            self.gather(unit, backward=backward)

    def _check_order(self, position: int, *, ended: bool) -> None:
        """Compare this forward's units with the first forward's (without a root unit, forward passes have no
        visible start: nothing to compare)."""
        first = self.first_forward
        if first is None or self.diverged or not self.has_root:
            return
        order = self.forward_order
        ran = order[position] if position < len(order) and not ended else None
        expected = first[position] if position < len(first) else None
        if ran == expected:
            return
        self.diverged = True
        self.gathers.diverged(position, ran, expected)

    # ----- backward -----------------------------------------------------------------------------------

    def pre_backward(self, unit: U, *, builds_graph: bool = False) -> None:
        """Backward reaches ``unit`` (the gradient of one of its forward's outputs); ``builds_graph``: the pass
        records a graph of its own (``create_graph=True``), which reads the unit's parameters later."""
        if builds_graph:
            self.held = self.building = True
        progress = self.progress[unit]
        if progress.in_backward:
            return
        progress.in_backward = True
        if not self.reshard_after_backward:
            self.kept.add(unit)
        self.backward_order.append(unit)
        self.wait(unit, backward=True)
        self._prefetch(self.backward_order, self.previous_backward, backward=True)

    def inputs_done(self, unit: U) -> None:
        """Autograd computed the gradients of one forward call's inputs: that call's backward is over."""
        progress = self.progress[unit]
        progress.pending_inputs = max(0, progress.pending_inputs - 1)  # (a retained graph's second pass comes again)
        self._release_if_done(unit)

    def grad_arrived(self, unit: U) -> None:
        """The gradient of one of ``unit``'s trainable parameters arrived."""
        self.progress[unit].num_grads += 1
        self._release_if_done(unit)

    def _release_if_done(self, unit: U) -> None:
        """Release ``unit`` once its backward is over (units with unused parameters wait for the end)."""
        progress = self.progress[unit]
        if progress.in_backward and progress.pending_inputs == 0 and progress.num_grads >= progress.num_params:
            if not progress.is_root:  # (the root stays gathered until the step: see end_backward)
                self.release(unit)
            progress.in_backward = False

    def end_backward(self) -> None:
        """Release every unit but the root, which stays gathered until the step: a second backward pass through a
        retained graph, or a loss term built from root parameters after forward (an L2 penalty on the embeddings),
        reads them again, and the next forward (accumulation) needs it first. A pass that built a graph releases
        nothing: the backward through that graph reads every unit it gathered."""
        if self.building:
            self.building = False
            for progress in self.progress.values():
                progress.forget()
        else:
            self.release_all(keep=[u for u in self.units if self.progress[u].is_root
                                   and self.progress[u].state is not UnitState.SHARDED], kept_too=False)
        self.previous_backward, self.backward_order = self.backward_order, []

    def backward_interrupted(self) -> None:
        """The previous backward pass died with an error: forget it."""
        self.previous_backward, self.backward_order = self.backward_order, []
        self.release_all()
