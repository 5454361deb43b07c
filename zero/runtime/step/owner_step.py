"""The whole-parameter step: each whole parameter is updated once, by its owner, on its whole gradient.

Before the flat path steps its buckets (``zero.runtime.step.stepper``), :meth:`OwnerStep.step`

1. sends each owner, in one all-to-all, every other shard's pieces of the gradient (reduced, unscaled and clipped:
   the optimizer's, ``Bucket.step_grads``) and of the master value of the parameters it owns
   (``zero.runtime.buffers.owners.Exchange``);
2. assembles them into whole tensors, in the parameter's shape, in the master's dtype and where the master lives
   (on the host with the optimizer offloaded), puts them behind the wrapped optimizer's stand-ins of the owned
   parameters (``.data`` and ``.grad``), and calls each whole-parameter optimizer's ``step()`` once: it sees what
   single-process training gives it, and keeps its state (Muon's momentum, Adafactor's row and column statistics)
   in the parameter's own shape;
3. sends every updated piece back to the shard that holds it, in a second all-to-all, into its master chunk.

The flat path then casts each bucket's master into its parameters and shares them as for any other piece. Only
parameters with a gradient this step (on any rank) travel: as torch skips ``p.grad is None``, the others are not
stepped. With one shard (stage 0) every rank steps every whole parameter, as every rank steps everything there.

Between steps a stand-in holds a zero-stride placeholder of the parameter's shape (no memory): the whole tensors
exist only during the step, 2x the owned parameters' elements, beside the exchange's receive buffer (the pieces of
them the other shards hold; their send buffer is gone before the whole tensors come, and the whole gradients before
the updates travel back): about 2.5x the owned parameters at 2 shards (3x where the master travels), was 3x (4x).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.owners import Exchange, Transfer, assign_unit_owners
from zero.runtime.parallel.tensor_parallel import NoTensorParallel
from zero.runtime.step.inner import Inner


class OwnerStep:
    """Owners, stand-ins and the exchange of the whole-parameter optimizers' parameters (see the module docstring);
    inert (``active`` False) when every optimizer takes the flat path."""

    def __init__(self, buckets: list[Bucket], whole_groups: dict[int, int | None], comm: Communicator,
                 num_shards: int, tensor_parallel: NoTensorParallel = NoTensorParallel()):
        """``whole_groups``: the whole-path optimizers' parameter groups, each mapped to its optimizer's number when
        all its parameters must share an owner (a rule that may read several at once), else to ``None``.
        ``tensor_parallel``: the model's tp dimension; a tp-sharded parameter's owners (one per tp rank, at the same
        dp position) gather it over tp and each steps the global tensor, keeping its own part."""
        self.buckets, self.comm, self.tensor_parallel = buckets, comm, tensor_parallel
        self.shard = comm.rank if num_shards > 1 else 0
        slots = sorted((s for b in buckets for s in b.slots if s.group_index in whole_groups), key=lambda s: s.order)
        units = [("optimizer", whole_groups[s.group_index]) if whole_groups[s.group_index] is not None
                 else ("parameter", s.order) for s in slots]
        owners = assign_unit_owners([slot.span.numel for slot in slots], units, num_shards)
        index = {id(bucket): i for i, bucket in enumerate(buckets)}
        self.slot_of = {(index[id(slot.bucket)], slot.span.param_index): slot for slot in slots}  # by key
        self.owner_of = dict(zip(self.slot_of, owners))
        self.exchange = Exchange([b.layout for b in buckets], self.owner_of, num_shards, self.shard)
        tensor_parallel.check_agree([[*key, owner] for key, owner in self.owner_of.items()],
                                    "the owners of the parameters stepped whole")
        # the owned parameters' stand-ins, which the rebuilt optimizers hold (in model order)
        self.stand_ins = {key: _placeholder(self.slot_of[key]) for key, o in self.owner_of.items() if o == self.shard}
        self.inners: list[Inner] = []  # the whole-parameter optimizers, rebuilt over ``stand_ins``
        self.updates = 0  # whole-parameter updates this rank computed, over every step so far
        dtypes = {slot.bucket.master.dtype for slot in slots}
        if len(dtypes) > 1:
            raise ValueError(
                f"parameters stepped whole have master weights of several dtypes ({sorted(map(str, dtypes))}); give "
                "the whole-parameter optimizers parameters of one dtype"
            )
        self.dtype = dtypes.pop() if dtypes else torch.float32  # what the exchange carries

    def owned(self) -> list[tuple[ParamSlot, torch.Tensor]]:
        """This rank's owned whole parameters and their stand-ins, in model order."""
        return [(self.slot_of[key], stand_in) for key, stand_in in self.stand_ins.items()]

    @property
    def active(self) -> bool:
        return bool(self.inners)

    @torch.no_grad()
    def step(self, step_kwargs: dict[str, Any]) -> None:
        """Update the whole parameters with a gradient: this rank's owned ones here, the rest by their owners; every
        rank's master chunk holds the updated values afterwards."""
        used = {key for key, slot in self.slot_of.items() if slot.used_anywhere}
        tp = self.tensor_parallel
        wholes = {key: tuple(tp.whole(self.slot_of[key], t) for t in pair) for key, pair in self._gather(used).items()}
        for key, (grad, value) in wholes.items():
            self.stand_ins[key].data, self.stand_ins[key].grad = value, grad
        try:
            for inner in self.inners:  # the class's step: not a wrapper an LR scheduler set on the instance
                type(inner.optimizer).step(inner.optimizer, **step_kwargs)
        finally:
            for key in wholes:
                self.stand_ins[key].data, self.stand_ins[key].grad = _placeholder(self.slot_of[key]), None
        self.updates += len(wholes)
        values = {key: tp.local_part(self.slot_of[key], value) for key, (_, value) in wholes.items()}
        del wholes  # (the whole gradients go before the updates travel)
        self._scatter(used, values)

    # ----- the exchange --------------------------------------------------------------------------------

    def _gather(self, used: set) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """The whole gradient and master value of each owned parameter in ``used``, by key. The master travels only
        where no rank holds it whole: at stages 0-2 without a separate master, every rank's parameter buffer holds
        the whole current values (shared after the last step, edits included), so the owner reads its own. The whole
        tensors are made once the exchange is done and its send buffer gone: they are held beside the received
        pieces only."""
        ex = self.exchange
        sends = {o: Exchange.select(t, used) for o, t in ex.outgoing.items()}
        receives = {h: Exchange.select(t, used) for h, t in ex.incoming.items()}
        received = self._all_to_all(
            {o: [self._local(t, grad) for grad, t in self._packed(ts)] for o, ts in sends.items()},
            {h: sum(t.piece.numel for _, t in self._packed(ts)) for h, ts in receives.items()},
            "gradients and masters to owners")
        wholes = {}
        for key in self.stand_ins:
            if key in used:
                slot, master = self.slot_of[key], self.buckets[key[0]].master
                wholes[key] = tuple(torch.empty(slot.shape, dtype=master.dtype, device=master.device)
                                    for _ in range(2))
                if not self._master_travels(key[0]):
                    wholes[key][1].copy_(slot.view)
        for h, ts in receives.items():
            for grad, t in self._packed(ts):
                self._whole_piece(wholes, t, grad).copy_(received[h].take(t.piece.numel))
        for grad, t in self._packed(Exchange.select(ex.own, used)):
            self._whole_piece(wholes, t, grad).copy_(self._local(t, grad))
        return wholes

    def _packed(self, transfers: list[Transfer]) -> list[tuple[bool, Transfer]]:
        """What travels of ``transfers`` to their owner, in order: every gradient piece, then the master pieces."""
        return [(True, t) for t in transfers] + [(False, t) for t in transfers if self._master_travels(t.bucket)]

    def _master_travels(self, bucket: int) -> bool:
        """Whether the owner needs the holders' master pieces of the bucket's parameters (see :meth:`_gather`)."""
        b = self.buckets[bucket]
        return b.master_apart

    def _scatter(self, used: set, values: dict[tuple[int, int], torch.Tensor]) -> None:
        """Every updated piece into the master chunk of the shard that holds it: this rank's own first, then the
        others' through the exchange, ``values`` emptied once packed (the updates go before the receive buffer
        comes)."""
        ex = self.exchange
        for t in Exchange.select(ex.own, used):
            self._local(t, grad=False).copy_(self._piece_of(values[t.param], t))
        sends = {h: Exchange.select(t, used) for h, t in ex.incoming.items()}
        receives = {o: Exchange.select(t, used) for o, t in ex.outgoing.items()}
        received = self._all_to_all(
            {h: [self._piece_of(values[t.param], t) for t in ts] for h, ts in sends.items()},
            {o: sum(t.piece.numel for t in ts) for o, ts in receives.items()}, "updated parameters from owners",
            release=values.clear)
        for o, ts in receives.items():
            for t in ts:
                self._local(t, grad=False).copy_(received[o].take(t.piece.numel))

    def _all_to_all(self, sends: dict[int, list[torch.Tensor]], sizes: dict[int, int], what: str,
                    release: Callable[[], None] = lambda: None) -> dict:
        """Send ``sends[s]`` (pieces, concatenated) to each other shard ``s`` and receive ``sizes[s]`` elements from
        it, read back piece by piece in the order the sender packed them (both ends walk the same lists).
        ``release()`` drops what the pieces were read from, once packed; the pieces' device copies go then too."""
        dtype = self.dtype
        shards = range(self.exchange.num_shards)
        out_splits = [sum(t.numel() for t in sends.get(s, [])) for s in shards]
        in_splits = [sizes.get(s, 0) for s in shards]
        flat = [t.reshape(-1).to(device=self.comm.device, dtype=dtype) for s in shards for t in sends.pop(s, [])]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.comm.device)
        del flat
        release()
        receive = torch.empty(sum(in_splits), dtype=dtype, device=self.comm.device)
        if self.exchange.num_shards > 1:
            self.comm.all_to_all(receive, send, in_splits, out_splits, what=f"all-to-all of {what}").wait()
        return {s: _Reader(chunk) for s, chunk in zip(shards, receive.split(in_splits)) if s in sizes}

    def _local(self, t: Transfer, grad: bool) -> torch.Tensor:
        """This rank's piece ``t`` of the optimizer's gradient (``grad``) or of the master (1D views)."""
        bucket = self.buckets[t.bucket]
        source = bucket.step_grads if grad else bucket.master
        return source.narrow(0, t.piece.chunk_start, t.piece.numel)

    def _whole_piece(self, wholes: dict, t: Transfer, grad: bool) -> torch.Tensor:
        return self._piece_of(wholes[t.param][0 if grad else 1], t)

    @staticmethod
    def _piece_of(whole: torch.Tensor, t: Transfer) -> torch.Tensor:
        return whole.view(-1).narrow(0, t.piece.param_start, t.piece.numel)


def _placeholder(slot: ParamSlot) -> torch.Tensor:
    """A zero-stride tensor of the parameter's (global) shape, in the master's dtype and device (no memory)."""
    master = slot.bucket.master
    return torch.zeros((), dtype=master.dtype, device=master.device).expand(slot.param.shape)


class _Reader:
    """Consecutive pieces of a received buffer."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.at = flat, 0

    def take(self, numel: int) -> torch.Tensor:
        piece = self.flat.narrow(0, self.at, numel)
        self.at += numel
        return piece
