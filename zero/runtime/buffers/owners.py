"""Which shard steps each whole parameter, and which pieces travel to it and back (construction only, pure
arithmetic).

Optimizers whose update of a parameter depends on the whole tensor (Muon's orthogonalized momentum, Adafactor's
row and column statistics, LAMB's per-tensor trust ratio, Shampoo's and SOAP's preconditioners) are stepped on
whole parameters, each by one shard, its *owner*, over the same flat shards the elementwise path steps
(owner-compute): once the gradients are reduced, every other shard sends the owner its pieces of the parameter's
gradient and master value, the owner steps the whole parameter and sends each piece back to the shard that holds
it (``zero.runtime.step.owner_step``). The update is computed once per step, on the fully reduced gradient, and the
layout of every bucket stays the one the elementwise path uses.

Owners are assigned largest parameter first, each to the shard holding the fewest elements so far: every such
optimizer's state grows with the parameter's elements (Muon's momentum, SOAP's factors per dimension), so the
state, and with it most of the work, is balanced. The flat path's state is not the owners' to balance: it stays
where the buckets' chunks put it (why: docs/design.md, owner-compute). An optimizer whose step may read several of
its parameters at once (``zero.runtime.step.inner.is_per_parameter``) is one unit: all its parameters get one
owner. With one shard (stage 0) every rank owns every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from zero.runtime.buffers.layout import BucketLayout, Piece


def assign_owners(numels: Sequence[int], num_shards: int) -> list[int]:
    """The owning shard of each parameter: largest first (equal sizes in the given order), each to the shard with
    the fewest elements so far (ties: the lowest shard). The same on every rank: nothing is exchanged."""
    load = [0] * num_shards
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        owners[i] = shard
        load[shard] += numels[i]
    return owners


def assign_unit_owners(numels: Sequence[int], units: Sequence[Hashable], num_shards: int) -> list[int]:
    """The owning shard of each parameter when the parameters of one unit (``units[i]``: the parameter's unit) must
    share an owner: :func:`assign_owners` over the units' elements."""
    order = list(dict.fromkeys(units))
    sizes = {unit: 0 for unit in order}
    for numel, unit in zip(numels, units):
        sizes[unit] += numel
    owner = dict(zip(order, assign_owners([sizes[unit] for unit in order], num_shards)))
    return [owner[unit] for unit in units]


@dataclass(frozen=True)
class Transfer:
    """One piece that travels: bucket ``bucket``'s piece ``piece`` of a whole parameter, held by shard ``holder``."""

    bucket: int  # index into the buckets the exchange was planned over
    holder: int
    piece: Piece

    @property
    def param(self) -> tuple[int, int]:
        """The parameter: (bucket, index in the bucket's layout)."""
        return self.bucket, self.piece.param_index


class Exchange:
    """The pieces of whole parameters that shard ``shard`` sends to each owner and receives from each holder.

    ``owners`` maps each whole parameter, as ``(bucket, param_index)``, to its owning shard. The lists are in the
    same order on both ends (bucket order, then the holder's chunk order), so that a buffer packed by one rank is
    read by the other without any index being sent."""

    def __init__(self, layouts: Sequence[BucketLayout], owners: dict[tuple[int, int], int], num_shards: int,
                 shard: int):
        self.num_shards, self.shard = num_shards, shard
        held = {h: [Transfer(b, h, p) for b, layout in enumerate(layouts) for p in layout.pieces(h)
                    if (b, p.param_index) in owners] for h in range(num_shards)}
        self.outgoing = {o: [t for t in held[shard] if owners[t.param] == o] for o in range(num_shards) if o != shard}
        self.incoming = {h: [t for t in held[h] if owners[t.param] == shard] for h in range(num_shards) if h != shard}
        self.own = [t for t in held[shard] if owners[t.param] == shard]  # pieces this shard holds of its own

    @staticmethod
    def select(transfers: list[Transfer], used: set[Hashable]) -> list[Transfer]:
        """The transfers of parameters in ``used`` (those with a gradient this step)."""
        return [t for t in transfers if t.param in used]
