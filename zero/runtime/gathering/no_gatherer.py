"""Stages 0-2's gatherer: parameters are always whole, so there is nothing to gather, release or compare (the
null object standing in for ``zero.runtime.gathering.gatherer.ParamGatherer``)."""

from __future__ import annotations

from typing import Iterable

from torch import nn

from zero.runtime.buffers.bucket import Bucket
from zero.runtime.gathering.gatherer import Unit


class NoGatherer:
    """Stages 0-2: parameters are always whole, so there is nothing to gather, release or compare."""

    units: tuple[Unit, ...] = ()
    hooks: tuple = ()
    in_forward = False
    sharded = False

    def reshard_all(self, keep: list[Unit] = ()) -> None:
        pass

    def set_reshard_after_backward(self, reshard: bool) -> None:
        pass

    def gathering_buckets(self) -> set[Bucket]:
        return set()

    def units_of(self, params: Iterable[nn.Parameter]) -> list[Unit]:
        return []

    def fingerprint_flags(self) -> list[int]:
        return []

    @staticmethod
    def fingerprints_agree(agreed: list[int]) -> bool:
        return True
