"""What the ranks agree on at the end of every reduction round, in one small MAX all-reduce of int32 flags.

The gradients of a round are not used until the ranks have compared, in one collective, four things that have
nothing else in common; :class:`RoundFlags` packs them in a fixed order and unpacks the reduced values into
:class:`Agreed`, so that each check reads its own field:

* ``used``: per parameter, whether it got a gradient on this rank. MAX: on any rank, which is when PyTorch would give
  it a ``p.grad`` (the others get none, as single-process training leaves an unused parameter).
* ``steps``: the optimizer steps taken so far, sent as ``(v, -v)``; MAX gives back ``(v, -v)`` only if every rank
  had ``v``: ranks that skipped or added a ``step()`` have diverged, and the step is refused.
* ``gathers``: stage 3, the gatherer's fingerprint of the units it gathered (its own ``(v, -v)``): ranks that ran
  different modules exchanged parameters between mismatched units (``zero.runtime.gathering.gatherer``).
* ``overflow``: fp16 loss scaling, this rank's overflow flag, a device tensor (MAX: set if any rank's is), last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.runtime.buffers.placement import to_device_async

_AGREE_MOD = 2**31 - 1  # values compared across ranks ride in int32 flags


@dataclass(frozen=True)
class Agreed:
    """The all-reduced flags, by name."""

    used: list[bool]  # per parameter: got a gradient on some rank
    steps_agree: bool  # every rank has taken the same number of optimizer steps
    gathers: list[int]  # the gatherer's reduced fingerprint (``gatherer.fingerprints_agree`` reads it)
    overflow: list[int]  # the loss scaler's reduced flag (``scaler.agree`` takes it)


@dataclass(frozen=True)
class RoundFlags:
    """This rank's side of the agreement (see the module docstring)."""

    used: list[bool]
    steps: int
    gathers: list[int]
    overflow: torch.Tensor  # int32, 0 or 1 element, on the device

    @property
    def step_flags(self) -> list[int]:
        steps = self.steps % _AGREE_MOD
        return [steps, -steps]

    def pack(self, device: torch.device) -> torch.Tensor:
        """The flags to all-reduce with MAX, on ``device``: the host-side ones copied over, then ``overflow``."""
        host = torch.tensor([*map(int, self.used), *self.step_flags, *self.gathers], dtype=torch.int32)
        return torch.cat([to_device_async(host, device), self.overflow])

    def unpack(self, agreed: list[int]) -> Agreed:
        """The reduced flags (read back to the host), by name."""
        n, g = len(self.used), len(self.gathers)
        return Agreed(used=[bool(u) for u in agreed[:n]], steps_agree=agreed[n] == -agreed[n + 1],
                      gathers=agreed[n + 2 : n + 2 + g], overflow=agreed[n + 2 + g :])
