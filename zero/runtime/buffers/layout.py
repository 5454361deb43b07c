"""Pure arithmetic for flat, padded, sharded buffers.

Nothing here touches ``torch.distributed`` or allocates memory: given the sizes of
the parameters (in the order they should be packed), a bucket capacity and a shard
count, it decides

* which parameters share a bucket (one contiguous flat buffer per bucket),
* where each parameter lives inside its bucket,
* how much padding makes the bucket split into ``num_shards`` equal chunks,
* which pieces of which parameters fall inside a given rank's chunk.

Note: a bucket is both the unit of communication (one reduce-scatter / all-gather)
and the unit of sharding: rank ``r`` owns elements ``[r * chunk, (r + 1) * chunk)``
of every bucket. Every rank therefore holds exactly the same number of elements
(padding included), and a bucket's reduce-scatter output is exactly that rank's
shard of it, with no copies between a communication layout and a sharding layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives inside its bucket's flat buffer."""

    param_index: int  # index into the list given to ``plan_buckets``
    offset: int  # first element inside the bucket
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside one rank's chunk of a bucket."""

    param_index: int
    param_start: int  # first element within the (flattened) parameter
    chunk_start: int  # first element within the rank's chunk
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """A contiguous run of parameters packed into one padded flat buffer (1D)."""

    index: int
    key: Hashable  # e.g. (dtype, device): every parameter in a bucket shares it
    spans: tuple[ParamSpan, ...]
    num_shards: int
    padded_numel: int

    @property
    def numel(self) -> int:
        """Real (unpadded) elements in the bucket."""
        return self.spans[-1].end

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def chunk_numel(self) -> int:
        """Elements per shard (the same on every rank)."""
        return self.padded_numel // self.num_shards

    def chunk_range(self, shard: int) -> tuple[int, int]:
        """``[start, end)`` of shard ``shard`` inside the flat buffer."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} out of range for {self.num_shards} shards")
        start = shard * self.chunk_numel
        return start, start + self.chunk_numel

    def pieces(self, shard: int) -> list[Piece]:
        """The parameter pieces that overlap shard ``shard``, in bucket order."""
        lo, hi = self.chunk_range(shard)
        out = []
        for span in self.spans:
            start, end = max(lo, span.offset), min(hi, span.end)
            if start < end:
                out.append(Piece(span.param_index, start - span.offset, start - lo, end - start))
        return out


def padded_size(numel: int, num_shards: int, align: int = 1) -> int:
    """Smallest multiple of ``num_shards * align`` that holds ``numel`` elements."""
    if numel < 0 or num_shards < 1 or align < 1:
        raise ValueError(f"bad sizes: numel={numel}, num_shards={num_shards}, align={align}")
    block = num_shards * align
    return max(block, math.ceil(numel / block) * block)


def plan_buckets(
    numels: Sequence[int],
    keys: Sequence[Hashable],
    bucket_cap: int,
    num_shards: int,
    align: int = 1,
) -> list[BucketLayout]:
    """Pack parameters, in the given order, into buckets of at most ``bucket_cap`` elements.

    A new bucket starts when the key changes (buckets never mix dtypes or devices) or
    when adding the next parameter would exceed ``bucket_cap``; a parameter larger
    than the cap gets a bucket of its own. Each bucket is padded so that it splits
    into ``num_shards`` equal chunks of a multiple of ``align`` elements.
    """
    if len(numels) != len(keys):
        raise ValueError("numels and keys must have the same length")
    if bucket_cap < 1:
        raise ValueError(f"bucket_cap must be >= 1 element, got {bucket_cap}")
    groups: list[list[int]] = []
    filled = 0
    for i, numel in enumerate(numels):
        if numel < 1:
            raise ValueError(f"parameter {i} has no elements")
        fits = groups and keys[groups[-1][0]] == keys[i] and filled + numel <= bucket_cap
        if not fits:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += numel
    buckets = []
    for b, members in enumerate(groups):
        spans, offset = [], 0
        for i in members:
            spans.append(ParamSpan(i, offset, numels[i]))
            offset += numels[i]
        buckets.append(
            BucketLayout(b, keys[members[0]], tuple(spans), num_shards, padded_size(offset, num_shards, align))
        )
    return buckets
