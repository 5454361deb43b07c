"""Weights tied across pipeline parts: one tensor that two parts on different pp ranks both use, as GPT-2's token
embedding (first part) is its output head (last part).

Each holder keeps a copy, and the copies stay one tensor if every holder takes the same step: they start equal
(checked), each holder's gradient is the sum of all holders' (:meth:`Tie.sum_local`: one all-reduce of the local
gradient over the pipeline's ranks, before the dp reduction, so the sum over the tie then the mean over dp, exactly
the whole model's gradient), and the clip norm counts the tie once (:meth:`Tie.counts`). Elementwise and
whole-parameter optimizers then compute the same update on every holder.

A tie left undeclared would drift silently (each copy stepped on its own part's gradient), so one is caught when the
pipeline is set up: parameters of parts on different pp ranks with the same shape and the same values (not constant)
are refused by name, with the fix (:func:`plan_tie`), if one of them is an embedding's or their modules differ in
kind (layers of one kind at the same place in parts built from one seed start equal without being one tensor).
Values are compared by :func:`fingerprints` (a few weighted sums of each parameter's elements, added over its pieces
on the dp ranks), which two copies share to rounding and two independently initialized tensors never do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket, ParamSlot

TIE_RTOL = 1e-6  # copies of one tensor differ in their fingerprints by the order of their sums only
_WEIGHTS = ((0.7548776662466927, 0.1), (0.5698402909980532, 1.3))  # cos(a i + b): element weights, by index


@dataclass(frozen=True)
class Held:
    """What a pp rank reports of one of its trainable parameters (by its name in the whole model)."""

    name: str
    shape: tuple[int, ...]
    features: tuple[float, ...]  # sum, sum of squares, two cosine-weighted sums
    dtype: str  # its reduction buffer's (the tie's all-reduce runs in it)
    kind: str = ""  # its module's class name

    def may_tie(self, other: Held) -> bool:
        """Whether these two, holding the same values, are taken for an undeclared tie (see the module docstring)."""
        return self.kind != other.kind or "Embedding" in self.kind

    @property
    def constant(self) -> bool:
        total, squares = self.features[:2]
        n = math.prod(self.shape)
        return squares * n - total * total <= 1e-9 * squares * n

    def same_values(self, other: Held) -> bool:
        return self.shape == other.shape and all(
            math.isclose(a, b, rel_tol=TIE_RTOL, abs_tol=TIE_RTOL * math.sqrt(self.features[1]))
            for a, b in zip(self.features, other.features))


@torch.no_grad()
def fingerprints(buckets: Iterable[Bucket], slots: Sequence[ParamSlot], dp: Communicator,
                 sharded: bool) -> torch.Tensor:
    """``(len(slots), 4)`` float64: each slot's features (:attr:`Held.features`) over its pieces on every dp rank
    (the pieces of this rank summed here, the ranks' by one all-reduce when ``sharded``)."""
    row = {id(slot): i for i, slot in enumerate(slots)}
    out = torch.zeros(len(slots), 2 + len(_WEIGHTS), dtype=torch.float64, device=dp.device)
    for bucket in buckets:
        for piece in bucket.pieces:
            if id(piece.slot) not in row:
                continue
            x = piece.tensor.detach().to(torch.float64)
            index = torch.arange(piece.piece.param_start, piece.piece.param_start + x.numel(), dtype=torch.float64,
                                 device=x.device)
            weighted = [(x * torch.cos(index * a + b)).sum() for a, b in _WEIGHTS]
            out[row[id(piece.slot)]] += torch.stack([x.sum(), (x * x).sum(), *weighted]).to(out.device)
    if sharded:
        dp.all_reduce(out, what="all-reduce of the parameters' fingerprints (tied weights)").wait()
    return out


def report(parts: Sequence[torch.nn.Module], slots: Sequence[ParamSlot], buckets: Iterable[Bucket],
           dp: Communicator, sharded: bool) -> tuple[dict[str, Held], dict[str, ParamSlot]]:
    """This rank's trainable parameters by their names in ``parts`` (the parts' own: the whole model's), as
    :class:`Held` records and as slots; ``slots``: the trainable ones, whose ``buckets`` hold their pieces."""
    features = dict(zip(map(id, slots), fingerprints(buckets, slots, dp, sharded).tolist()))
    slot_of = {id(slot.param): slot for slot in slots}
    mine, held = {}, {}
    for part in parts:
        for prefix, module in part.named_modules(remove_duplicate=False):
            for name, p in module.named_parameters(prefix, recurse=False, remove_duplicate=False):
                if id(p) in slot_of:
                    slot = mine[name] = slot_of[id(p)]
                    held[name] = Held(name, tuple(slot.shape), tuple(features[id(slot)]),
                                      str(slot.bucket.staging.dtype).removeprefix("torch."), type(module).__name__)
    return held, mine


class NoTie:
    """No weight tied across the pipeline's ranks: nothing to sum, every parameter counts in the norm."""

    def sum_local(self, bucket: Bucket, grads: torch.Tensor) -> None:
        pass

    def take_part(self) -> None:
        pass

    def counts(self, slot: ParamSlot) -> bool:
        return True


class Tie:
    """One tensor held by several pp ranks: this rank's copy (``slot``, or ``None``: held elsewhere, this rank adds
    zeros to the sum), the all-reduce over the pipeline's ranks, and whether this copy counts in the clip norm."""

    def __init__(self, pp: Communicator, slot: ParamSlot | None, names: tuple[str, ...], numel: int,
                 dtype: torch.dtype, counted: bool):
        self.pp, self.slot, self.names, self.numel, self.dtype = pp, slot, names, numel, dtype
        self.counted = counted
        self.summed = False  # this round's all-reduce is done

    def _all_reduce(self, grad: torch.Tensor) -> None:
        self.pp.all_reduce(grad, what=f"all-reduce over the pipeline of the gradient of tied {self.names}").wait()

    def sum_local(self, bucket: Bucket, grads: torch.Tensor) -> None:
        """As the bucket goes to its dp reduction: this rank's local gradient of the tie (in ``grads``, the bucket's
        collected gradients) made the sum over its holders."""
        if self.slot is not None and self.slot.bucket is bucket:
            self._all_reduce(bucket.staging_view(self.slot).view(-1))
            self.summed = True

    def take_part(self) -> None:
        """After this rank's reduction of the step: a rank that holds no copy adds zeros to the holders' sum."""
        summed, self.summed = self.summed, False
        if summed:
            return
        self._all_reduce(torch.zeros(self.numel, dtype=self.dtype, device=self.pp.device))
        if self.slot is not None:
            raise ValueError(f"the weight tied across pipeline parts {self.names} got no gradient on this rank in "
                             "this step, so its copies would step apart; every part holding it must use it")

    def counts(self, slot: ParamSlot) -> bool:
        return slot is not self.slot or self.counted


def plan_tie(declared: Sequence[Sequence[str]], held: list[dict[str, Held]], mine: dict[str, ParamSlot],
             pp: Communicator) -> Tie | NoTie:
    """The tie this rank takes part in, from what every pp rank holds (``held``, in pp rank order: each rank's
    trainable parameters by name) and the ties ``declared``; raises ``ValueError`` for a declared tie whose copies
    differ or are not found, and for copies of one tensor on several ranks that are not declared."""
    ties = [tuple(names) for names in declared]
    spanning = []
    for names in ties:
        holders = {r: [n for n in names if n in ranks] for r, ranks in enumerate(held)}
        holders = {r: found for r, found in holders.items() if found}
        missing = set(names) - {n for found in holders.values() for n in found}
        if missing:
            raise ValueError(f"tied_weights names {sorted(missing)}, which no part of the pipeline holds (its "
                             "parameters are named as in the whole model, e.g. 'tok_embeddings.weight')")
        copies = [held[r][n] for r, found in holders.items() for n in found]
        if not all(c.same_values(copies[0]) for c in copies):
            raise ValueError(f"the weights tied across pipeline parts {names} hold different values (or shapes): a "
                             "tie is one tensor; give every part the same initial copy (cut the parts from one "
                             "model, built alike on every rank)")
        if len(holders) > 1:
            spanning.append((names, holders))
    _refuse_undeclared(ties, held)
    if not spanning:
        return NoTie()
    if len(spanning) > 1:
        raise ValueError(f"several weights are tied across pipeline ranks ({[n for n, _ in spanning]}); one such tie "
                         "is built (the embedding and the output head): hold the others on one rank")
    names, holders = spanning[0]
    here = {id(mine[n]): mine[n] for n in holders.get(pp.rank, ())}
    if len(here) > 1:
        raise ValueError(f"the weights tied across pipeline parts {names} are separate tensors on one rank: make "
                         "them one nn.Parameter there (module.weight = other.weight)")
    first = held[min(holders)][holders[min(holders)][0]]
    return Tie(pp, next(iter(here.values()), None), names, math.prod(first.shape), getattr(torch, first.dtype),
               counted=pp.rank == min(holders))


def _refuse_undeclared(ties: list[tuple[str, ...]], held: list[dict[str, Held]]) -> None:
    """Copies of one tensor on two pp ranks, outside the declared ties: their gradients would never be summed."""
    tied = {n: i for i, names in enumerate(ties) for n in names}
    by_shape: dict[tuple[int, ...], list[tuple[int, Held]]] = {}
    for rank, params in enumerate(held):
        for h in params.values():
            if not h.constant:
                by_shape.setdefault(h.shape, []).append((rank, h))
    for group in by_shape.values():
        for i, (r, a) in enumerate(group):
            for s, b in group[i + 1:]:
                declared = a.name in tied and tied.get(b.name) == tied[a.name]
                if r != s and not declared and a.may_tie(b) and a.same_values(b):
                    raise ValueError(
                        f"parameters {a.name!r} (pp rank {r}) and {b.name!r} (pp rank {s}) hold the same values: a "
                        "weight tied across pipeline parts, whose copies would train apart. Declare the tie on every "
                        "stage, zero.pipelining.PipelineStage(..., tied_weights=[(name, other_name)]), with "
                        "ZeroOptimizer(..., mesh=mesh['dp']); if they are distinct weights that happen to start "
                        "equal, initialize each part from its own seed")
