"""The wrapped optimizers, priced where their state lives (``zero.runtime.step.inner``): which optimizer steps each
parameter, on which path, and what each holds and allocates on the rank priced.

* *flat* optimizers (torch's elementwise ones, or classes declared in ``ZeroConfig.elementwise_optimizers``) step
  1-D pieces of every rank's chunk: their state is traced on the pieces of the priced rank's chunk (each piece's own
  state: Adam's 8 bytes per element and a step count per piece), their temporaries on one bucket's pieces at a time;
* *whole* optimizers (Muon, Adafactor, LAMB, SOAP, any other class) step whole parameters on their owner, assigned
  as the runtime assigns them (``zero.runtime.buffers.owners``: largest first to the shard holding the fewest
  elements; one owner for all the parameters of an optimizer whose step may read several): their state is traced on
  whole parameters (Muon: one momentum matrix; Adafactor: row and column statistics and a step count), and only the
  owned parameters' is this rank's. Their step (``zero.runtime.step.owner_step``) holds the owned parameters' whole
  gradient and master value, 2x their elements in the master's dtype, and around them either the all-to-all's send
  and receive buffers (each shard's pieces of them in, the pieces this rank holds of others' out; the master's pieces
  only where no rank holds the parameters whole; the send buffer goes before the whole tensors come) or the
  optimizers' own temporaries.

Fake tensors have no values: where an optimizer reads one on the host (Adafactor's ``param.norm().item()``), the
trace reads 1 (:class:`HostReads`), which changes no shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zero.runtime.buffers.owners import Exchange, assign_unit_owners
from zero.runtime.step.inner import (
    ParamGroups,
    as_list,
    check_optimizers,
    is_elementwise,
    is_per_parameter,
    same_kind,
)


class HostReads(TorchDispatchMode):
    """A fake tensor's value read on the host (``.item()``, ``bool()``) reads 1 (``True``): an optimizer's step may
    read a norm to scale its update (Adafactor), which decides no shape."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() or t.is_complex() else 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Assignment:
    """The training script's optimizers, built on the fake model: which one steps each trainable parameter (by its
    global parameter group, as ``ZeroOptimizer`` numbers the groups of all its optimizers) and on which path."""

    optimizers: tuple[torch.optim.Optimizer, ...]
    whole: tuple[bool, ...]  # per optimizer: stepped on whole parameters
    group_of: dict[str, int]  # trainable parameter's name -> its global group number
    ranges: tuple[range, ...]  # per optimizer: its global group numbers
    shapes: dict[str, tuple[int, ...]]
    shared: tuple[bool, ...] = ()  # per whole optimizer: its step may read several parameters (one owner for all)

    def optimizer_of(self, name: str) -> int:
        gi = self.group_of[name]
        return next(k for k, r in enumerate(self.ranges) if gi in r)

    def is_whole(self, name: str) -> bool:
        return self.whole[self.optimizer_of(name)]

    def unit_of(self, name: str, order: int) -> tuple[str, int]:
        """The unit owned as one (``zero.runtime.step.owner_step.OwnerStep``): the whole-parameter optimizer when its
        step may read several of its parameters, else the parameter (by its ``order`` in the model)."""
        k = self.optimizer_of(name)
        return ("optimizer", k) if self.shared[k] else ("parameter", order)

    @property
    def several_or_whole(self) -> bool:
        return len(self.optimizers) > 1 or self.whole[0]

    def describe(self) -> str:
        names = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"several optimizers ({names})" if len(self.optimizers) > 1 else f"{names}, stepped on whole parameters"

    def rebuilt(self, k: int, params: dict[int, list[torch.Tensor]]) -> torch.optim.Optimizer:
        """Optimizer ``k`` rebuilt over ``params`` (global group number -> tensors), as the runtime rebuilds it (its
        groups' hyperparameters; a group may be empty)."""
        groups = [{**{key: v for key, v in group.items() if key != "params"}, "params": params.get(gi, [])}
                  for gi, group in zip(self.ranges[k], self.optimizers[k].param_groups)]
        return same_kind(self.optimizers[k], groups)


def assign(optimizers: Any, model: nn.Module, declared: Sequence[str], per_parameter: Sequence[str] = ()) -> Assignment:
    """``optimizers`` (one, or a list, built over ``model``'s parameters) checked as ``ZeroOptimizer`` checks them
    (``zero.runtime.step.inner.check_optimizers``: with several, every trainable parameter in exactly one), with
    ``ZeroConfig``'s ``elementwise_optimizers`` (``declared``) and ``per_parameter_optimizers``."""
    optimizers = as_list(optimizers)
    check_optimizers(optimizers, model)
    names = {p: n for n, p in model.named_parameters()}
    groups = ParamGroups(optimizers)
    group_of: dict[str, int] = {}
    for gi, group in enumerate(groups.param_groups):
        for p in group["params"]:
            if p not in names:
                raise ValueError(f"an optimizer of the workload holds a parameter of shape {tuple(p.shape)} that is "
                                 "not in the model; build the optimizers from the model the function is given")
            if p.requires_grad:  # (a frozen one is never stepped)
                group_of[names[p]] = gi
    whole = tuple(not is_elementwise(o, declared) for o in optimizers)
    shared = tuple(w and not is_per_parameter(o, per_parameter) for o, w in zip(optimizers, whole))
    return Assignment(tuple(optimizers), whole, group_of, tuple(groups.ranges),
                      {n: tuple(p.shape) for p, n in names.items()}, shared)


@dataclass(frozen=True)
class Owned:
    """A whole parameter the priced shard owns."""

    name: str
    bucket: int  # index into the layout's buckets
    numel: int
    here: int  # its elements in the priced shard's own chunk (the rest arrive from the other shards)


@dataclass(frozen=True)
class Ownership:
    """The whole parameters of one shard: those it owns and steps, and the pieces it holds of those others own."""

    shard: int
    owned: tuple[Owned, ...] = ()  # in model order
    lent: tuple[tuple[int, int], ...] = ()  # (bucket, elements) of this shard's pieces of parameters owned elsewhere
    state: tuple[float, ...] = ()  # per shard: the optimizer state it holds (bytes; when the shard was chosen)
    num_shards: int = 1  # (one, or no whole-parameter optimizer: no exchange)
    travels: tuple[bool, ...] = ()  # per bucket: the master's pieces travel to the owner too, not just the gradient's
    elements: tuple[int, ...] = ()  # per shard: the whole parameters' elements it owns

    def rivals(self) -> set[int]:
        """Other shards whose peak may be higher than the chosen one's (the one holding the most state): the one
        owning the most elements, whose step holds the largest whole tensors."""
        if not self.state or not self.elements:
            return set()
        return {self.elements.index(max(self.elements))} - {self.shard}

    def sent(self, offloaded: Sequence[bool] = ()) -> tuple[int, int]:
        """Elements this shard sends to the owners (its pieces of others' parameters: gradient, and master where it
        travels) and back to the holders (the updates of the others' pieces of its own), of buckets ``offloaded``
        only when given (those leave host memory through a copy on the device)."""
        def counted(bucket: int) -> bool:
            return not offloaded or offloaded[bucket]

        out = sum((1 + self.travels[b]) * n for b, n in self.lent if counted(b))
        back = sum(o.numel - o.here for o in self.owned if counted(o.bucket))
        return out, back

    def received(self) -> tuple[int, int]:
        """Elements this shard receives from the holders (their pieces of its parameters: gradient, and master where
        it travels) and back from the owners (the updates of its pieces of theirs)."""
        into = sum((1 + self.travels[o.bucket]) * (o.numel - o.here) for o in self.owned)
        return into, sum(n for _, n in self.lent)

    @property
    def exchanged(self) -> int:
        """Elements this shard sends in one step's two all-to-alls (``opt.comm_stats``' count)."""
        return sum(self.sent())


def ownership(buckets: Sequence[Any], assignment: Assignment, whole: dict[str, float],
              flat: dict[str, tuple[float, float]], num_shards: int, rank: int | None) -> Ownership:
    """The owners of the whole parameters (``whole``: name -> bytes of its state) over the runtime's trainable
    ``buckets``, as ``zero.runtime.step.owner_step.OwnerStep`` assigns them (their slots in model order, one owner per
    unit: ``zero.runtime.buffers.owners.assign_unit_owners``), and the shard priced: ``rank``'s (``rank %
    num_shards``), else the one holding the most optimizer state (ties: the lowest), the whole parameters' it owns and
    the flat pieces' of its chunk (``flat``: name -> bytes per element and per piece)."""
    slots = sorted(((i, s) for i, b in enumerate(buckets) for s in b.slots if s.name in whole),
                   key=lambda item: item[1].order)
    owners = assign_unit_owners([s.span.numel for _, s in slots],
                                [assignment.unit_of(s.name, s.order) for _, s in slots], num_shards)
    per_shard = torch.zeros(num_shards, dtype=torch.float64)
    elements = [0] * num_shards
    for (_, slot), owner in zip(slots, owners):
        per_shard[owner] += whole[slot.name]
        elements[owner] += slot.span.numel
    if rank is None:
        for bucket in buckets:
            per_shard += _flat_state_by_shard(bucket.layout, {s.span.param_index: flat[s.name] for s in bucket.slots
                                                              if s.name in flat})
    shard = rank % num_shards if rank is not None else int(torch.argmax(per_shard))  # (the first of equals)
    state = tuple(per_shard.tolist()) if rank is None else ()
    if not whole:  # (several flat optimizers: nothing is owned, nothing exchanged)
        return Ownership(shard, state=state)
    owner_of = {(i, s.span.param_index): o for (i, s), o in zip(slots, owners)}
    exchange = Exchange([b.layout for b in buckets], owner_of, num_shards, shard)
    lent: dict[int, int] = {}
    for transfers in exchange.outgoing.values():
        for t in transfers:
            lent[t.bucket] = lent.get(t.bucket, 0) + t.piece.numel
    here: dict[tuple[int, int], int] = {}
    for t in exchange.own:
        here[t.param] = here.get(t.param, 0) + t.piece.numel
    owned = tuple(Owned(s.name, i, s.span.numel, here.get((i, s.span.param_index), 0))
                  for (i, s), o in zip(slots, owners) if o == shard)
    # (as OwnerStep._master_travels: the owner reads the master itself where every rank holds the parameters whole)
    travels = tuple(b.master_apart for b in buckets)
    return Ownership(shard, owned, tuple(sorted(lent.items())), state, num_shards, travels, tuple(elements))


def _flat_state_by_shard(layout: Any, rates: dict[int, tuple[float, float]]) -> torch.Tensor:
    """Each shard's flat optimizer state in one bucket (``rates``: param_index -> bytes per element and per piece),
    from the spans' boundaries against the chunks' (no loop over the shards: worlds may be large)."""
    spans = [span for span in layout.spans if span.param_index in rates]
    total = torch.zeros(layout.num_shards, dtype=torch.float64)
    if not spans:
        return total
    bounds = torch.arange(layout.num_shards + 1, dtype=torch.int64) * layout.chunk_numel
    for rate in set(rates.values()):  # (one pass per kind of state)
        same = [span for span in spans if rates[span.param_index] == rate]
        starts = torch.tensor([span.offset for span in same], dtype=torch.int64)
        ends = torch.tensor([span.end for span in same], dtype=torch.int64)
        before = torch.cumsum(ends - starts, 0) - (ends - starts)  # elements of the spans before each
        k = (torch.searchsorted(starts, bounds, right=True) - 1).clamp(min=0)
        upto = torch.where(bounds > starts[0], before[k] + torch.minimum(bounds - starts[k], ends[k] - starts[k]),
                           torch.zeros_like(bounds))  # elements of these spans below each bound
        elements = (upto[1:] - upto[:-1]).double()
        pieces = (torch.searchsorted(starts, bounds[1:], right=False)
                  - torch.searchsorted(ends, bounds[:-1], right=True)).double()
        total += rate[0] * elements + rate[1] * pieces
    return total


def state_bytes(state: dict) -> float:
    """Bytes of one parameter's optimizer state (tensors, or lists of them: SOAP's per-dimension factors)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in tree_leaves(state) if isinstance(t, torch.Tensor)}
    return float(sum(storages.values()))


def fake_params(specs: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[nn.Parameter]:
    """Zero parameters of these shapes with zero gradients (under the caller's fake mode)."""
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in specs]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def steps(optimizers: Sequence[torch.optim.Optimizer], recorder: Callable[[], Any] | None = None) -> Any:
    """Step each optimizer once (its class's ``step``, as the runtime calls it), which makes its state; with
    ``recorder``, once more (the steady state) under ``recorder()``, which is returned."""
    with torch.no_grad(), HostReads():
        for optimizer in optimizers:
            type(optimizer).step(optimizer)
        if recorder is None:
            return None
        made = recorder()
        with made:
            for optimizer in optimizers:
                type(optimizer).step(optimizer)
    return made


def owner_step_bytes(ownership: Ownership, offloaded: Sequence[bool], itemsize: int, temporaries: float) -> float:
    """Device bytes the owner step holds at its peak besides the model states (``zero.runtime.step.owner_step``'s
    order): the exchange to the owners (the pieces sent, those of buckets in host memory copied to the device first
    and gone once packed, then the pieces received); the whole gradient and master value of each owned parameter whose
    master is on the device, made after the send buffer is gone, beside the received pieces and then the optimizers'
    ``temporaries`` on the device; the exchange back (the updates packed while the whole masters exist, the whole
    gradients gone, then sent beside the pieces received)."""
    on_device = [o for o in ownership.owned if not offloaded[o.bucket]]
    wholes = 2 * itemsize * sum(o.numel for o in on_device)
    (out, back), (into, returned) = ownership.sent(), ownership.received()
    copied_out, copied_back = ownership.sent(offloaded) if any(offloaded) else (0, 0)
    to_owners = itemsize * max(out + copied_out, out + into)
    back_out = max(wholes / 2 + itemsize * (back + copied_back), itemsize * (back + returned))
    return max(to_owners, wholes + itemsize * into, wholes + temporaries, back_out)
